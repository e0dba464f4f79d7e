"""Chunk stepper: a torch optimizer of the user's class over one chunk's fp32 master, stepped per run.

`ChunkStepper` is what `ChunkedOptimizer` holds per chunk; the host steps of offloaded chunks
(`host_steps.py`) and the device steps of persistent ones call `step`, and speculation calls `snapshot` and
`restore` to undo a step. The stepper of a sharded chunk (issue 20) steps this rank's shard only: its
entries are the parameters' pieces inside the shard (`chunks.clipped_entries`), offsets from the shard's start.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from agent.runtime.chunks import ChunkState, clipped_entries, views
from agent.runtime.layout import ParamEntry

# Group keys that choose an implementation, not a hyper-parameter: set per side, never copied.
IMPL_KEYS = frozenset({"params", "foreach", "fused", "capturable", "differentiable"})


def hyper_parameters(group: dict[str, Any]) -> dict[str, Any]:
    """A param group's hyper-parameters (its implementation keys and parameters left out)."""
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
    entries: list[int]  # positions in the stepper's entries, consecutive in memory
    start: int  # element offsets in the master (the chunk, or this rank's shard of it)
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
        # what this stepper steps: the chunk's parameters, or their pieces in this rank's shard; `positions[i]`
        # is entry i's position in the chunk's entries (`touched` and the optimizer speak those)
        self.entries: list[ParamEntry]
        if state.shard is not None:
            self.entries, self.positions = clipped_entries(state.spec.entries, state.shard)
        else:
            self.entries, self.positions = state.spec.entries, list(range(len(state.spec.entries)))
        self._local = {j: i for i, j in enumerate(self.positions)}
        # the user's optimizer steps some parameter of the chunk (the same on every rank, unlike `runs`: a
        # rank's shard may hold none of them): sharded chunks' collectives are issued on this
        self.steps_chunk = any(id(e.param) in group_of for e in state.spec.entries)
        entries = self.entries
        assert state.master is not None
        self.masters = views(state.master, entries)  # by position in self.entries
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
            # Persistent chunks step with the user's implementation choice; offloaded chunks with an fp32
            # master step on the host with the fused (or foreach) CPU implementation (equal to the others
            # within an ulp in fp32). A bf16/fp16 master (fp32_master=False) steps with the user's choice
            # too: in low precision torch's fused CPU kernels round differently from the loop and foreach
            # ones (several ulps after a few steps), and that option promises plain PyTorch's values.
            self.impl_kwargs = (
                host_impl(cls, hyper_parameters(outer_groups[self.runs[0].outer]))
                if state.offloaded and state.master.dtype == torch.float32
                else device_impl
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
            [{"params": ps, **hyper_parameters(self._outer_groups[g])} for g, ps in groups.items()],
            **self.impl_kwargs,
        )
        for t, st in states.items():
            self.inner.state[t] = st

    def _split(self, key: Callable[[int], Any]) -> None:
        """Split every run where `key(entry)` changes; the pieces keep their slices of the run's state."""
        assert self.inner is not None
        entries = self.entries
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

    def step(
        self,
        hypers: list[dict[str, Any]],
        grad: torch.Tensor,
        touched: set[int],
        *,
        grad_offsets: Sequence[int | None] | None = None,
    ) -> None:
        """One optimizer step from the chunk's flat gradient `grad` (fp32, same layout as the master, or with
        `grad_offsets` each entry's offset in `grad`: a persistent chunk's gradient area holds its trainable
        parameters only, consecutive ones at their distance in the master), with the given hyper-parameters (a snapshot of the outer groups). Parameters not in `touched`
        have no gradient this step and are skipped, as torch skips parameters whose grad is None."""
        if self.inner is None:
            return
        if self.state.shard is not None:
            touched = {i for i, j in enumerate(self.positions) if j in touched}
        if any(0 < sum(j in touched for j in r.entries) < len(r.entries) for r in self.runs):
            self._split(lambda j: j in touched)
        for g, group in zip(self._group_order, self.inner.param_groups, strict=True):
            group.update(hypers[g])
        any_grad = False
        for r in self.runs:
            has = r.entries[0] in touched
            lo = r.start
            if has and grad_offsets is not None:
                first = grad_offsets[r.entries[0]]
                assert first is not None  # a touched entry has a gradient slot
                lo = first
            r.tensor.grad = grad[lo : lo + r.end - r.start] if has else None
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

    def local(self, j: int) -> int | None:
        """The position in this stepper's entries of the chunk's entry j (None: no piece of it in the shard)."""
        return self._local.get(j)

    def load_master(self, j: int, value: torch.Tensor) -> None:
        """The chunk's entry j's master from a whole parameter's value (its piece in the shard, if sharded)."""
        i = self._local.get(j)
        if i is None:
            return
        if self.state.shard is None:
            self.masters[i].copy_(value)
            return
        lo = self.entries[i].offset + self.state.shard.start - self.state.spec.entries[j].offset
        self.masters[i].copy_(value.reshape(-1)[lo : lo + self.entries[i].numel])

    def param_state(self, j: int) -> dict[str, Any] | None:
        """The chunk's entry j's state in plain-PyTorch form (tensors shaped like the parameter; views, not
        copies). Sharded chunk: the state of its piece in this rank's shard (flat), None without one."""
        i = self._local.get(j)
        if i is None:
            return None
        r = self._run_of(i)
        if r is None or self.inner is None:
            return None
        st = self.inner.state.get(r.tensor)
        if not st:
            return None
        e = self.entries[i]
        return {k: _param_state(v, r, e.offset, e.end, e.shape) for k, v in st.items()}

    def load_param_states(self, states: dict[int, dict[str, Any]]) -> None:
        """Replace the state by per-entry states (plain-PyTorch values, keyed by the chunk's entry positions);
        entries absent start fresh. Sharded chunk: each parameter's state is cut to its piece in the shard."""
        if self.inner is None:
            return
        if self.state.shard is not None:
            states = self._pieces(states)

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
            entries = self.entries
            st: dict[str, Any] = {}
            for k, v in first.items():
                if k == "step":
                    st[k] = _step_tensor(v, r.tensor, self.impl_kwargs)
                elif isinstance(v, torch.Tensor) and v.numel() == entries[r.entries[0]].numel:
                    # each entry's state at its offset in the run: alignment padding between parameters
                    # (narrow dtypes) stays zero, and the state is as long as the run's master
                    flat = torch.zeros(r.end - r.start, dtype=r.tensor.dtype, device=r.tensor.device)
                    for j in r.entries:
                        e = entries[j]
                        flat[e.offset - r.start : e.end - r.start].copy_(states[j][k].reshape(-1))
                    st[k] = flat
                else:
                    st[k] = v
            self.inner.state[r.tensor] = st

    def _pieces(self, states: dict[int, dict[str, Any]]) -> dict[int, dict[str, Any]]:
        """Whole parameters' states (by chunk entry) -> their pieces' states in this shard (by stepper entry)."""
        assert self.state.shard is not None
        out: dict[int, dict[str, Any]] = {}
        whole = self.state.spec.entries
        for i, (piece, j) in enumerate(zip(self.entries, self.positions, strict=True)):
            st = states.get(j)
            if st is None:
                continue
            lo = (
                piece.offset + self.state.shard.start - whole[j].offset
            )  # where the piece starts in the parameter
            out[i] = {
                k: v.reshape(-1)[lo : lo + piece.numel]
                if isinstance(v, torch.Tensor) and v.numel() == whole[j].numel and v.dim() > 0
                else v
                for k, v in st.items()
            }
        return out


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
