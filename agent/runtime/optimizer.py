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
from collections.abc import Callable
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
                raise ValueError(f"optimizer.param_groups[{gi}].params[{pi}]: is not a parameter of the wrapped model")


def _hyper(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k not in IMPL_KEYS}


def host_impl(cls: type[torch.optim.Optimizer], hyper: dict[str, Any]) -> dict[str, bool]:
    """The host optimizer: torch's fused CPU kernel if this class has one for these hyper-parameters,
    else the foreach (multi-tensor) implementation."""
    try:
        probe = torch.zeros(4)
        probe.grad = torch.ones(4)
        cls([{"params": [probe], **hyper}], fused=True).step()
        return {"fused": True}
    except (RuntimeError, ValueError, TypeError):
        return {"foreach": True}


@dataclass
class GroupSlice:
    outer: int  # index into ChunkedOptimizer.param_groups
    entries: list[int]  # positions in the chunk's entries


class ChunkStepper:
    """A torch optimizer of the user's class over one chunk's fp32 master views."""

    def __init__(self, state: ChunkState, cls: type[torch.optim.Optimizer], outer_groups: list[dict[str, Any]],
                 group_of: dict[int, int], device_impl: dict[str, bool]) -> None:
        self.state = state
        entries = state.spec.entries
        assert state.master is not None
        self.masters = views(state.master, entries)
        by_group: dict[int, GroupSlice] = {}
        for j, e in enumerate(entries):
            g = group_of.get(id(e.param))
            if g is not None:  # a parameter the user's optimizer does not hold is never stepped
                by_group.setdefault(g, GroupSlice(outer=g, entries=[])).entries.append(j)
        self.slices = list(by_group.values())
        self.inner: torch.optim.Optimizer | None = None
        self.impl = "none"
        if self.slices:
            # Persistent chunks step exactly as the user's optimizer would (same implementation flags);
            # offloaded chunks step on the host with the fused (or foreach) CPU implementation.
            impl = host_impl(cls, _hyper(outer_groups[self.slices[0].outer])) if state.offloaded else device_impl
            self.impl = next(iter(impl), "default")
            self.inner = cls(
                [{"params": [self.masters[j] for j in s.entries], **_hyper(outer_groups[s.outer])} for s in self.slices],
                **impl,
            )

    def step(self, hypers: list[dict[str, Any]], grads: list[torch.Tensor], touched: set[int]) -> None:
        """One optimizer step with the given hyper-parameters (snapshot of the outer groups)."""
        if self.inner is None:
            return
        for s, group in zip(self.slices, self.inner.param_groups, strict=True):
            group.update(hypers[s.outer])
            for j, p in zip(s.entries, group["params"], strict=True):
                p.grad = grads[j] if j in touched else None
        self.inner.step()
        for group in self.inner.param_groups:
            for p in group["params"]:
                p.grad = None

    def param_state(self, j: int) -> dict[str, Any] | None:
        if self.inner is None:
            return None
        st = self.inner.state.get(self.masters[j])
        return st if st else None

    def load_param_states(self, states: dict[int, dict[str, Any]]) -> None:
        """Load per-entry states (plain-PyTorch values) through the inner optimizer's own casting rules."""
        if self.inner is None:
            return
        local: dict[int, dict[str, Any]] = {}
        groups = []
        k = 0
        for s, group in zip(self.slices, self.inner.param_groups, strict=True):
            ids = []
            for j in s.entries:
                if j in states:
                    local[k] = states[j]
                ids.append(k)
                k += 1
            groups.append({**{key: v for key, v in group.items() if key != "params"}, "params": ids})
        self.inner.state.clear()
        self.inner.load_state_dict({"state": local, "param_groups": groups})


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

    def state_dict(self) -> dict[str, Any]:
        """Plain-PyTorch format: {"state": {index: {...}}, "param_groups": [...]}, indices in group order."""
        self._manager.synchronize()
        state: dict[int, dict[str, Any]] = {}
        for idx, p in enumerate(self._index):
            entry = self._manager.layout.entry(p)
            assert entry is not None
            stepper = self._manager.steppers[entry.chunk]
            j = stepper.state.spec.entries.index(entry)
            st = stepper.param_state(j)
            if st is None:
                continue
            out = dict(st)
            if stepper.state.mixed:
                out[MASTER_KEY] = stepper.masters[j]
            state[idx] = out
        groups = []
        start = 0
        for g in self.param_groups:
            n = len(g["params"])
            groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": list(range(start, start + n))})
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
        id_to_index = {saved_id: i for i, saved_id in enumerate(sid for sg in saved_groups for sid in sg["params"])}
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
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False) -> torch.Tensor:
        return self._manager.clip_grad_norm_(max_norm, norm_type=norm_type, error_if_nonfinite=error_if_nonfinite)
