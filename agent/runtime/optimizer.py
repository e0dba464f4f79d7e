"""Optimizer wrapper: the user's optimizer, reproduced chunk by chunk on the side each chunk lives on.

Each chunk gets a genuine torch optimizer of the user's class (same hyper-parameters, same state
semantics: per-parameter `step`, moments, momentum buffers, skipping of parameters without a gradient)
over per-parameter views of the chunk's fp32 master. Persistent chunks step on the device; offloaded
chunks step on the host with torch's fused CPU kernel (or foreach where fused is unavailable), on the
runtime's worker thread. `ChunkedOptimizer` is the `torch.optim.Optimizer` the user holds: its
`param_groups` are the source of truth for hyper-parameters (so LR schedulers work), and its
`state_dict()` is exactly the plain-PyTorch format, keyed by the user's parameter order.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from agent.runtime.chunks import ChunkState, views
from agent.runtime.layout import ChunkLayout

if TYPE_CHECKING:
    from agent.runtime.manager import ModelStateManager

# Optimizers whose update of a parameter depends only on that parameter's own gradient and state,
# so they can be split into chunks exactly.
SUPPORTED: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.AdamW,
    torch.optim.Adam,
    torch.optim.SGD,
    torch.optim.Adagrad,
    torch.optim.RMSprop,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
)
# Group keys that choose an implementation, not a hyper-parameter: set per side, never copied.
IMPL_KEYS = frozenset({"params", "foreach", "fused", "capturable", "differentiable"})
MASTER_KEY = "master_param"  # extra per-parameter state key in mixed precision: the fp32 master copy


class UnsupportedOptimizerError(TypeError):
    pass


def check_supported(optimizer: torch.optim.Optimizer) -> None:
    if type(optimizer) not in SUPPORTED:
        names = ", ".join(c.__name__ for c in SUPPORTED)
        raise UnsupportedOptimizerError(
            f"optimizer: {type(optimizer).__name__} is not supported by the chunk runtime (supported: {names})"
        )
    for i, g in enumerate(optimizer.param_groups):
        if g.get("differentiable"):
            raise UnsupportedOptimizerError(f"optimizer.param_groups[{i}].differentiable: must be False")


def check_parameters(optimizer: torch.optim.Optimizer, layout: ChunkLayout) -> None:
    """Every parameter the optimizer holds must be one the plan places."""
    for gi, g in enumerate(optimizer.param_groups):
        for pi, p in enumerate(g["params"]):
            if layout.entry(p) is None:
                raise ValueError(
                    f"optimizer.param_groups[{gi}].params[{pi}]: is not a parameter of the wrapped model"
                )


def _hyper(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k not in IMPL_KEYS}


def host_impl(cls: type[torch.optim.Optimizer], hyper: dict[str, Any]) -> dict[str, bool]:
    """The host optimizer: torch's fused CPU kernel if this class has one for these hyper-parameters,
    else the foreach (multi-tensor) implementation."""
    try:
        probe = torch.zeros(4)
        probe.grad = torch.ones(4)
        make: Any = cls  # the supported classes all take fused=
        make([{"params": [probe], **hyper}], fused=True).step()
        return {"fused": True}
    except (RuntimeError, ValueError, TypeError):
        return {"foreach": True}


@dataclass
class Run:
    """Consecutive parameters of one chunk in one param group, stepped as a single flat tensor."""

    outer: int  # index into ChunkedOptimizer.param_groups
    entries: list[int]  # positions in the chunk's entries, consecutive in memory
    start: int  # element offsets in the chunk
    end: int
    tensor: torch.Tensor  # master[start:end], the inner optimizer's parameter


class ChunkStepper:
    """A torch optimizer of the user's class over one chunk's fp32 master, one flat tensor per run.

    The supported optimizers are elementwise, so stepping a run of parameters as one flat tensor does
    the same arithmetic as stepping them one by one, with far fewer kernel launches (on the host, the
    fused CPU kernel over a whole chunk is several times faster than over its parameters). A run is
    split, keeping its state, when its parameters' histories diverge (some lack a gradient in a step,
    or a loaded checkpoint gives them different step counts), so per-parameter semantics are exact.
    """

    def __init__(
        self,
        state: ChunkState,
        cls: type[torch.optim.Optimizer],
        outer_groups: list[dict[str, Any]],
        group_of: dict[int, int],
        device_impl: dict[str, bool],
    ) -> None:
        self.state = state
        self.cls = cls
        entries = state.spec.entries
        assert state.master is not None
        self.masters = views(state.master, entries)
        self.runs: list[Run] = []
        for j, e in enumerate(entries):
            g = group_of.get(id(e.param))
            if g is None:
                continue  # not held by the user's optimizer: never stepped
            last = self.runs[-1] if self.runs else None
            if last is not None and last.outer == g and last.entries[-1] == j - 1:
                last.entries.append(j)
                last.end = e.end
            else:
                self.runs.append(Run(outer=g, entries=[j], start=e.offset, end=e.end, tensor=state.master))
        for r in self.runs:
            r.tensor = state.master[r.start : r.end]
        self.inner: torch.optim.Optimizer | None = None
        self.impl = "none"
        # speculation (see `snapshot`): state copies by (run start, run end, key), and the last snapshot
        self._backup: dict[tuple[int, int, str], torch.Tensor] = {}
        self._undo: tuple[list[Run], torch.optim.Optimizer, list[int], list[Any]] | None = None
        self._outer_groups = outer_groups
        if self.runs:
            # Persistent chunks step with the user's implementation choice; offloaded chunks step on
            # the host with the fused (or foreach) CPU implementation.
            self.impl_kwargs = (
                host_impl(cls, _hyper(outer_groups[self.runs[0].outer])) if state.offloaded else device_impl
            )
            self.impl = next(iter(self.impl_kwargs), "default")
            self._rebuild({})

    def _rebuild(self, states: dict[torch.Tensor, dict[str, Any]]) -> None:
        groups: dict[int, list[torch.Tensor]] = {}
        for r in self.runs:
            groups.setdefault(r.outer, []).append(r.tensor)
        self._group_order = list(groups)
        make: Any = self.cls  # the supported classes all take foreach=/fused=
        self.inner = make(
            [{"params": ps, **_hyper(self._outer_groups[g])} for g, ps in groups.items()], **self.impl_kwargs
        )
        for t, st in states.items():
            self.inner.state[t] = st

    def _split(self, key: Callable[[int], Any]) -> None:
        """Split every run where `key(entry)` changes; the pieces keep their slices of the run's state."""
        assert self.inner is not None
        entries = self.state.spec.entries
        new_runs: list[Run] = []
        states: dict[torch.Tensor, dict[str, Any]] = {}
        changed = False
        for r in self.runs:
            old = self.inner.state.get(r.tensor)
            pieces: list[list[int]] = []
            for j in r.entries:
                if pieces and key(pieces[-1][-1]) == key(j):
                    pieces[-1].append(j)
                else:
                    pieces.append([j])
            if len(pieces) == 1:
                new_runs.append(r)
                if old:
                    states[r.tensor] = old
                continue
            changed = True
            for piece in pieces:
                a, b = entries[piece[0]].offset, entries[piece[-1]].end
                sub = Run(
                    outer=r.outer, entries=piece, start=a, end=b, tensor=r.tensor[a - r.start : b - r.start]
                )
                new_runs.append(sub)
                if old:
                    states[sub.tensor] = {k: _slice_state(v, r, a, b) for k, v in old.items()}
        if changed:
            self.runs = new_runs
            self._rebuild(states)

    def step(self, hypers: list[dict[str, Any]], grad: torch.Tensor, touched: set[int]) -> None:
        """One optimizer step from the chunk's flat gradient `grad` (fp32, same layout as the master),
        with the given hyper-parameters (a snapshot of the outer groups). Parameters not in `touched`
        have no gradient this step and are skipped, as torch skips parameters whose grad is None."""
        if self.inner is None:
            return
        if any(0 < sum(j in touched for j in r.entries) < len(r.entries) for r in self.runs):
            self._split(lambda j: j in touched)
        for g, group in zip(self._group_order, self.inner.param_groups, strict=True):
            group.update(hypers[g])
        any_grad = False
        for r in self.runs:
            has = r.entries[0] in touched
            r.tensor.grad = grad[r.start : r.end] if has else None
            any_grad |= has
        if any_grad:
            self.inner.step()
        for r in self.runs:
            r.tensor.grad = None

    def snapshot(self) -> None:
        """Keep what `restore` needs to undo the next `step`: the runs, the inner optimizer, and a copy of
        every state value (into buffers reused from step to step, so speculation allocates once)."""
        if self.inner is None:
            return
        saved: list[tuple[Run, dict[str, Any] | None, dict[str, Any]]] = []
        for r in self.runs:
            st = self.inner.state.get(r.tensor)
            values: dict[str, Any] = {}
            for k, v in (st or {}).items():
                if isinstance(v, torch.Tensor):
                    key = (r.start, r.end, k)
                    buf = self._backup.get(key)
                    if buf is None or buf.shape != v.shape or buf.dtype != v.dtype or buf.device != v.device:
                        buf = self._backup[key] = torch.empty_like(v)
                    buf.copy_(v)
                    values[k] = buf
                else:
                    values[k] = v
            saved.append((r, st if st else None, values))
        self._undo = (list(self.runs), self.inner, list(self._group_order), saved)

    def restore(self) -> None:
        """Undo the step since the last `snapshot` (state values copied back in place; a split the step made
        is forgotten: its pieces were views of the runs' state, which now hold the old values again)."""
        if self._undo is None:
            return
        runs, inner, order, saved = self._undo
        self.runs, self.inner, self._group_order = runs, inner, order
        for r, st, values in saved:
            if st is None:
                inner.state.pop(r.tensor, None)
                continue
            live = inner.state[r.tensor] = st
            for k, v in values.items():
                cur = live.get(k)
                if isinstance(v, torch.Tensor) and isinstance(cur, torch.Tensor) and cur.shape == v.shape:
                    cur.copy_(v)
                elif isinstance(v, torch.Tensor):
                    live[k] = v.clone()
                else:
                    live[k] = v
        self._undo = None

    def backup_nbytes(self) -> int:
        """Host bytes held for undoing a speculative step (the optimizer-state copies)."""
        return sum(t.nbytes for t in self._backup.values())

    def _run_of(self, j: int) -> Run | None:
        return next((r for r in self.runs if r.entries[0] <= j <= r.entries[-1]), None)

    def param_state(self, j: int) -> dict[str, Any] | None:
        """Entry j's state in plain-PyTorch form (tensors shaped like the parameter; views, not copies)."""
        r = self._run_of(j)
        if r is None or self.inner is None:
            return None
        st = self.inner.state.get(r.tensor)
        if not st:
            return None
        e = self.state.spec.entries[j]
        return {k: _param_state(v, r, e.offset, e.end, e.shape) for k, v in st.items()}

    def load_param_states(self, states: dict[int, dict[str, Any]]) -> None:
        """Replace the state by per-entry states (plain-PyTorch values); entries absent start fresh."""
        if self.inner is None:
            return

        def key(j: int) -> Any:
            st = states.get(j)
            if st is None:
                return None
            return tuple(sorted((k, float(v) if k == "step" else type(v).__name__) for k, v in st.items()))

        self.inner.state.clear()
        self._split(key)
        assert self.inner is not None
        for r in self.runs:
            first = states.get(r.entries[0])
            if first is None:
                continue
            entries = self.state.spec.entries
            st: dict[str, Any] = {}
            for k, v in first.items():
                if k == "step":
                    st[k] = _step_tensor(v, r.tensor, self.impl_kwargs)
                elif isinstance(v, torch.Tensor) and v.numel() == entries[r.entries[0]].numel:
                    st[k] = torch.cat([states[j][k].reshape(-1) for j in r.entries]).to(
                        r.tensor.device, r.tensor.dtype
                    )
                else:
                    st[k] = v
            self.inner.state[r.tensor] = st


def _slice_state(v: Any, r: Run, a: int, b: int) -> Any:
    if isinstance(v, torch.Tensor) and v.dim() == 1 and v.numel() == r.end - r.start:
        return v[a - r.start : b - r.start]  # a view: the piece keeps updating the run's storage
    if isinstance(v, torch.Tensor):
        return v.clone()  # e.g. 'step': each piece counts on its own from now on
    return v


def _param_state(v: Any, r: Run, a: int, b: int, shape: torch.Size) -> Any:
    if isinstance(v, torch.Tensor) and v.dim() == 1 and v.numel() == r.end - r.start:
        return v[a - r.start : b - r.start].view(shape)
    if isinstance(v, torch.Tensor):
        return v.clone()  # never share a scalar between parameters: torch increments 'step' in place
    return v


def _step_tensor(v: Any, like: torch.Tensor, impl: dict[str, bool]) -> torch.Tensor:
    """'step' as torch keeps it: float32 scalar, on the parameter's device only for fused/capturable."""
    device = like.device if impl.get("fused") else torch.device("cpu")
    return torch.as_tensor(float(v), dtype=torch.float32).to(device)


class StateView(Mapping[torch.Tensor, dict[str, Any]]):
    """`optimizer.state` as in plain PyTorch: parameter -> its state dict ({} before its first step).

    Read-only: the state lives in the chunks (write through `load_state_dict`). Reading waits for
    host optimizer work in flight, so values are current."""

    def __init__(self, optimizer: ChunkedOptimizer) -> None:
        self._opt = optimizer

    def __getitem__(self, p: torch.Tensor) -> dict[str, Any]:
        if self._opt._manager.layout.entry(p) is None:
            raise KeyError(p)
        self._opt._manager.synchronize()
        return self._opt.param_state(p) or {}

    def __iter__(self) -> Iterator[torch.Tensor]:
        self._opt._manager.synchronize()
        return iter([p for p in self._opt._index if self._opt.param_state(p) is not None])

    def __len__(self) -> int:
        return sum(1 for _ in self)


class ChunkedOptimizer(torch.optim.Optimizer):
    """The optimizer handed back by `agent.wrap`: plain-PyTorch interface over chunked steppers."""

    def __init__(self, user: torch.optim.Optimizer, layout: ChunkLayout, manager: ModelStateManager) -> None:
        check_supported(user)
        self._ready = False
        check_parameters(user, layout)
        groups = [{**g, "params": list(g["params"])} for g in user.param_groups]
        super().__init__(groups, copy.deepcopy(user.defaults))
        self._ready = True
        self.user_class: type[torch.optim.Optimizer] = type(user)
        self._manager = manager
        self._index: list[torch.Tensor] = [p for g in self.param_groups for p in g["params"]]
        self.state = StateView(self)  # type: ignore[assignment]
        # the implementation the user chose (None: torch's default for the device)
        self.device_impl: dict[str, bool] = {
            k: bool(user.defaults[k]) for k in ("fused", "foreach") if user.defaults.get(k) is not None
        }

    def group_of(self) -> dict[int, int]:
        return {id(p): gi for gi, g in enumerate(self.param_groups) for p in g["params"]}

    def hyper_snapshot(self) -> list[dict[str, Any]]:
        """Hyper-parameters of every group now (a scheduler may change them before the host step runs)."""
        return [_hyper(g) for g in self.param_groups]

    # ------------------------------------------------------------------------------- torch interface
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if getattr(self, "_ready", False):
            raise NotImplementedError(
                "add_param_group: the chunk layout is fixed by the plan; wrap the model again to add parameters"
            )
        super().add_param_group(param_group)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._manager.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._manager.zero_grad(set_to_none=set_to_none)

    def param_state(self, p: torch.Tensor) -> dict[str, Any] | None:
        """Parameter p's optimizer state as plain PyTorch keeps it (views into the chunk's state)."""
        entry = self._manager.layout.entry(p)
        if entry is None or not self._manager.steppers:
            return None
        stepper = self._manager.steppers[entry.chunk]
        j = stepper.state.spec.entries.index(entry)
        st = stepper.param_state(j)
        if st is None:
            return None
        out = dict(st)
        if stepper.state.mixed:
            out[MASTER_KEY] = stepper.masters[j]
        return out

    def state_dict(self) -> dict[str, Any]:
        """Plain-PyTorch format: {"state": {index: {...}}, "param_groups": [...]}, indices in group order."""
        self._manager.synchronize()
        state: dict[int, dict[str, Any]] = {}
        for idx, p in enumerate(self._index):
            st = self.param_state(p)
            if st is not None:
                state[idx] = st
        groups = []
        start = 0
        for g in self.param_groups:
            n = len(g["params"])
            groups.append(
                {**{k: v for k, v in g.items() if k != "params"}, "params": list(range(start, start + n))}
            )
            start += n
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._manager.synchronize()
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(
                f"state_dict.param_groups: has {len(saved_groups)} groups, the optimizer has {len(self.param_groups)}"
            )
        for i, (sg, g) in enumerate(zip(saved_groups, self.param_groups, strict=True)):
            if len(sg["params"]) != len(g["params"]):
                raise ValueError(
                    f"state_dict.param_groups[{i}].params: has {len(sg['params'])} parameters, "
                    f"the optimizer's group has {len(g['params'])}"
                )
        # saved ids, in group order, correspond one to one to this optimizer's parameters in group order
        id_to_index = {
            saved_id: i for i, saved_id in enumerate(sid for sg in saved_groups for sid in sg["params"])
        }
        for gi, sg in enumerate(saved_groups):
            self.param_groups[gi].update({k: v for k, v in sg.items() if k not in ("params",)})
        per_chunk: dict[int, dict[int, dict[str, Any]]] = {}
        for saved_id, st in state_dict["state"].items():
            if saved_id not in id_to_index:
                raise ValueError(f"state_dict.state[{saved_id!r}]: names no parameter of the saved groups")
            p = self._index[id_to_index[saved_id]]
            entry = self._manager.layout.entry(p)
            assert entry is not None
            spec = self._manager.steppers[entry.chunk].state.spec
            st = dict(st)
            master = st.pop(MASTER_KEY, None)
            j = spec.entries.index(entry)
            if master is not None:
                with torch.no_grad():
                    self._manager.steppers[entry.chunk].masters[j].copy_(master)
            per_chunk.setdefault(entry.chunk, {})[j] = st
        for ci, stepper in enumerate(self._manager.steppers):
            stepper.load_param_states(per_chunk.get(ci, {}))
        self._manager.refresh_compute_from_master()

    # The runtime extension the user may call: clipping across persistent and offloaded chunks.
    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        return self._manager.clip_grad_norm_(
            max_norm, norm_type=norm_type, error_if_nonfinite=error_if_nonfinite
        )
