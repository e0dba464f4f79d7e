"""Optimizer wrapper: the user's optimizer, reproduced chunk by chunk on the side each chunk lives on.

Each chunk gets a genuine torch optimizer of the user's class (same hyper-parameters, same state
semantics: per-parameter `step`, moments, momentum buffers, skipping of parameters without a gradient)
over per-parameter views of the chunk's fp32 master. Persistent chunks step on the device; offloaded
chunks step on the host with torch's fused CPU kernel (or foreach where fused is unavailable), on the
runtime's worker thread. `ChunkedOptimizer` is the `torch.optim.Optimizer` the user holds: its
`param_groups` are the source of truth for hyper-parameters (so LR schedulers work), and its
`state_dict()` is exactly the plain-PyTorch format, keyed by the user's parameter order.

Sharded chunks (issue 20): each rank holds the state of its shard. `state_dict()` is still the whole
plain-PyTorch format on every rank (the shards' states are all-gathered: a collective, call it on every rank,
as FSDP's full optimizer state dict), and `load_state_dict` takes that format and keeps this rank's shard, so a
checkpoint saved at N ranks loads at M ranks or in plain PyTorch. `optimizer.state[p]` (no collective) shows
the state of p's piece in this rank's shard (flat; {} without one).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol

import torch

from agent.runtime.chunks import ChunkState
from agent.runtime.layout import ChunkLayout
from agent.runtime.options import RuntimeOptions
from agent.runtime.process_group import RankGroup
from agent.runtime.stepper import ChunkStepper, hyper_parameters


class ChunkRuntime(Protocol):
    """What the optimizer asks of the runtime that holds the chunks (`ModelStateManager` is one): the
    optimizer never imports the runtime, the runtime imports the optimizer."""

    layout: ChunkLayout
    group: RankGroup | None
    options: RuntimeOptions
    backwards_started: int  # backward passes begun (`RankGroup.check_arrival`)

    def step(self) -> None: ...

    def zero_grad(self, *, set_to_none: bool = True, held: frozenset[int] | None = None) -> None: ...

    def synchronize(self) -> None: ...

    def refresh_compute_from_master(self) -> None: ...

    def clip_grad_norm_(
        self, max_norm: float, *, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> torch.Tensor: ...


# Optimizers whose update of a parameter depends only on that parameter's own gradient and state (so they
# can be split into chunks exactly) and that the wire contract describes (`OptimizerKind`: the planner needs
# their state size and step cost). Adagrad, RMSprop, Adamax, NAdam and RAdam are elementwise too, but the
# contract does not describe them and no test trains them: refused, as the README says, until both exist.
SUPPORTED: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.AdamW,
    torch.optim.Adam,
    torch.optim.SGD,
)
MASTER_KEY = "master_param"  # extra per-parameter state key in mixed precision: the fp32 master copy


class UnsupportedOptimizerError(TypeError):
    pass


def check_supported(optimizer: torch.optim.Optimizer) -> None:
    inner = getattr(optimizer, "optimizer", None)
    if type(optimizer) not in SUPPORTED and isinstance(inner, torch.optim.Optimizer):
        # Accelerate's AcceleratedOptimizer, Lightning's LightningOptimizer: `prepare` ran before `wrap`
        raise UnsupportedOptimizerError(
            f"optimizer: {type(optimizer).__name__} around {type(inner).__name__}; wrap first, then hand "
            "wrapped.model and wrapped.optimizer to the library (accelerator.prepare(wrapped.model, "
            "wrapped.optimizer, ...)), or pass the optimizer inside it"
        )
    if type(optimizer) not in SUPPORTED:
        names = ", ".join(c.__name__ for c in SUPPORTED)
        raise UnsupportedOptimizerError(
            f"optimizer: {type(optimizer).__name__} is not supported by the chunk runtime (supported: {names})"
        )
    for i, g in enumerate(optimizer.param_groups):
        if g.get("differentiable"):
            raise UnsupportedOptimizerError(f"optimizer.param_groups[{i}].differentiable: must be False")


def check_owned(optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> None:
    """Every parameter the optimizer holds is one of `model`'s (`wrap`'s check before anything is profiled: an
    optimizer built over another model's parameters, or a copy's, was refused only after a whole profile)."""
    own = {id(p) for p in model.parameters()}
    _check_each(
        optimizer,
        lambda p: id(p) in own,
        " (build the optimizer over model.parameters() of the model you wrap)",
    )


def check_parameters(optimizer: torch.optim.Optimizer, layout: ChunkLayout) -> None:
    """Every parameter the optimizer holds must be one the plan places."""
    _check_each(optimizer, lambda p: layout.entry(p) is not None)


def _check_each(
    optimizer: torch.optim.Optimizer, known: Callable[[torch.Tensor], bool], hint: str = ""
) -> None:
    """ValueError naming the first of the optimizer's parameters that is not `known`."""
    for gi, g in enumerate(optimizer.param_groups):
        for pi, p in enumerate(g["params"]):
            if not known(p):
                raise ValueError(
                    f"optimizer.param_groups[{gi}].params[{pi}]: is not a parameter of the wrapped model{hint}"
                )


class StateView(Mapping[torch.Tensor, dict[str, Any]]):
    """`optimizer.state` as in plain PyTorch: parameter -> its state dict ({} before its first step).

    Read-only: the state lives in the chunks (write through `load_state_dict`). Reading waits for
    host optimizer work in flight, so values are current."""

    def __init__(self, optimizer: ChunkedOptimizer) -> None:
        self._opt = optimizer

    def __getitem__(self, p: torch.Tensor) -> dict[str, Any]:
        if self._opt._runtime.layout.entry(p) is None:
            raise KeyError(p)
        self._opt._runtime.synchronize()
        return self._opt.param_state(p) or {}

    def __iter__(self) -> Iterator[torch.Tensor]:
        self._opt._runtime.synchronize()
        return iter([p for p in self._opt._index if self._opt.param_state(p) is not None])

    def __len__(self) -> int:
        return sum(1 for _ in self)


class ChunkedOptimizer(torch.optim.Optimizer):
    """The optimizer handed back by `agent.wrap`: plain-PyTorch interface over chunked steppers."""

    def __init__(self, user: torch.optim.Optimizer, layout: ChunkLayout, runtime: ChunkRuntime) -> None:
        check_supported(user)
        self._ready = False
        check_parameters(user, layout)
        groups = [{**g, "params": list(g["params"])} for g in user.param_groups]
        super().__init__(groups, copy.deepcopy(user.defaults))
        # the user's own group dicts, not copies: a scheduler (or any code) holding the optimizer given to `wrap`
        # sets the hyper-parameters this one steps with (with copies, a scheduler built before `wrap` drove
        # nothing: session 23); `optimizer_alias.py` makes that optimizer's methods this one's
        self.param_groups = user.param_groups
        self._ready = True
        self.user_class: type[torch.optim.Optimizer] = type(user)
        self._user = user
        self._runtime = runtime
        self.steppers: list[ChunkStepper] = []  # one per chunk, made by `bind_chunks`
        self._index: list[torch.Tensor] = [p for g in self.param_groups for p in g["params"]]
        self.state = StateView(self)  # type: ignore[assignment]
        # the implementation the user chose (None: torch's default for the device)
        self.device_impl: dict[str, bool] = {
            k: bool(user.defaults[k]) for k in ("fused", "foreach") if user.defaults.get(k) is not None
        }

    def bind_chunks(self, states: Sequence[ChunkState]) -> None:
        """Make one stepper of the user's class per chunk (the runtime calls this once it holds the chunks)."""
        group_of = self.group_of()
        self._held_ids = frozenset(group_of)  # the parameters this optimizer holds (`zero_grad`)
        self.steppers = [
            ChunkStepper(st, self.user_class, self.param_groups, group_of, self.device_impl) for st in states
        ]

    def group_of(self) -> dict[int, int]:
        return {id(p): gi for gi, g in enumerate(self.param_groups) for p in g["params"]}

    def hyper_snapshot(self) -> list[dict[str, Any]]:
        """Hyper-parameters of every group now (a scheduler may change them before the host step runs)."""
        return [hyper_parameters(g) for g in self.param_groups]

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
        self._runtime.step()
        # what the step wrapper of a scheduler built on the optimizer given to `wrap` records (it checks it at
        # its own step and otherwise warns that it stepped first)
        self._user._opt_called = True  # type: ignore[attr-defined]
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        # this optimizer's parameters only, as torch's: a trainable parameter it does not hold keeps its gradient
        self._runtime.zero_grad(set_to_none=set_to_none, held=self._held_ids)

    def param_state(self, p: torch.Tensor) -> dict[str, Any] | None:
        """Parameter p's optimizer state as plain PyTorch keeps it (views into the chunk's state)."""
        entry = self._runtime.layout.entry(p)
        if entry is None or not self.steppers:
            return None
        stepper = self.steppers[entry.chunk]
        j = stepper.state.spec.entries.index(entry)
        st = stepper.param_state(j)
        if st is None:
            return None
        out = dict(st)
        i = stepper.local(j)
        if stepper.state.mixed and i is not None:
            out[MASTER_KEY] = stepper.masters[i]
        return out

    def _gather_sharded(self) -> dict[int, dict[str, Any]]:
        """Whole per-parameter states (plain-PyTorch values) of the sharded chunks' parameters, by id(param):
        every rank's pieces all-gathered, chunk by chunk in chunk order (a collective on every rank)."""
        out: dict[int, dict[str, Any]] = {}
        group = self._runtime.group
        for stepper in self.steppers:
            sh = stepper.state.shard
            if sh is None or not stepper.steps_chunk:
                continue
            assert group is not None
            whole = stepper.state.spec.entries
            # what this rank holds: per chunk entry, its flat state keys (with dtype) and its other values
            local: dict[int, tuple[dict[str, torch.dtype], dict[str, Any]]] = {}
            pieces: dict[int, dict[str, Any]] = {}
            for i, j in enumerate(stepper.positions):
                st = stepper.param_state(j)
                if st is None:
                    continue
                n = stepper.entries[i].numel
                flat = {
                    k: v
                    for k, v in st.items()
                    if isinstance(v, torch.Tensor) and v.dim() == 1 and v.numel() == n
                }
                other = {k: v for k, v in st.items() if k not in flat}
                local[j] = ({k: v.dtype for k, v in flat.items()}, other)
                pieces[j] = flat
            merged: dict[int, tuple[dict[str, torch.dtype], dict[str, Any]]] = {}
            for rank_meta in group.all_gather_object(local):  # rank order: the lowest rank's other values
                for j, (flat_keys, other) in rank_meta.items():
                    if j not in merged:
                        merged[j] = (dict(flat_keys), other)
                    else:
                        merged[j][0].update(flat_keys)
            keys = sorted({(k, str(dt)) for fk, _ in merged.values() for k, dt in fk.items()})
            dtypes = {k: dt for fk, _ in merged.values() for k, dt in fk.items()}
            gathered: dict[str, torch.Tensor] = {}
            for k, _ in keys:
                own = torch.zeros(sh.size, dtype=dtypes[k])
                for i, j in enumerate(stepper.positions):
                    piece = pieces.get(j, {}).get(k)
                    if piece is not None:
                        e = stepper.entries[i]
                        own[e.offset : e.end].copy_(piece)
                full = torch.empty(sh.total, dtype=dtypes[k])
                group.all_gather(full, own)
                gathered[k] = full
            if stepper.state.mixed and merged:
                assert stepper.state.master is not None
                full = torch.empty(sh.total, dtype=stepper.state.master.dtype)
                group.all_gather(full, stepper.state.master.clone())
                gathered[MASTER_KEY] = full
            for j, (flat_keys, other) in merged.items():
                e = whole[j]
                st = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in other.items()}
                for k in flat_keys:
                    st[k] = gathered[k][e.offset : e.end].view(e.shape)
                if MASTER_KEY in gathered:
                    st[MASTER_KEY] = gathered[MASTER_KEY][e.offset : e.end].view(e.shape)
                out[id(e.param)] = st
        return out

    def check_every_rank(self, call: str, fix: str) -> None:
        """With sharded chunks `call` is a collective: rank 0 checks that every rank reached it
        (`RankGroup.check_arrival`), so a call made on one rank alone is an error naming `fix`, not a hang."""
        group = self._runtime.group
        if group is not None and any(c.sharded for c in self._runtime.layout.chunks):
            group.check_arrival(
                call, fix, self._runtime.options.rank_arrival_timeout_s, self._runtime.backwards_started
            )

    def state_dict(self) -> dict[str, Any]:
        """Plain-PyTorch format: {"state": {index: {...}}, "param_groups": [...]}, indices in group order."""
        self.check_every_rank(
            "optimizer.state_dict()",
            "Call it on every rank and save on rank 0 (`state = optimizer.state_dict()`, then `if rank == 0: "
            "torch.save(...)`), or call agent.checkpoint.save_sharded(wrapped, directory) on every rank.",
        )
        return self.gathered_state_dict()

    def gathered_state_dict(self) -> dict[str, Any]:
        """`state_dict()` without the arrival check (a caller that made its own: `agent.unwrap`)."""
        self._runtime.synchronize()
        sharded = self._gather_sharded()
        state: dict[int, dict[str, Any]] = {}
        for idx, p in enumerate(self._index):
            entry = self._runtime.layout.entry(p)
            if entry is not None and self._runtime.layout.chunks[entry.chunk].sharded:
                st = sharded.get(id(p))
            else:
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
        self.check_every_rank(
            "optimizer.load_state_dict()",
            "Call it on every rank with the same state dict, or agent.checkpoint.load_sharded(wrapped, "
            "directory) on every rank.",
        )
        self._runtime.synchronize()
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
            entry = self._runtime.layout.entry(p)
            assert entry is not None
            spec = self.steppers[entry.chunk].state.spec
            st = dict(st)
            master = st.pop(MASTER_KEY, None)
            j = spec.entries.index(entry)
            if master is not None:
                with torch.no_grad():
                    self.steppers[entry.chunk].load_master(j, master)
            per_chunk.setdefault(entry.chunk, {})[j] = st
        for ci, stepper in enumerate(self.steppers):
            stepper.load_param_states(per_chunk.get(ci, {}))
        self._runtime.refresh_compute_from_master()

    # The runtime extension the user may call: clipping across persistent and offloaded chunks.
    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        return self._runtime.clip_grad_norm_(
            max_norm, norm_type=norm_type, error_if_nonfinite=error_if_nonfinite
        )
