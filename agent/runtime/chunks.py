"""Chunk storage: the flat buffers a chunk's parameters, master copy and gradients live in.

A persistent chunk owns device memory: compute copy (parameters are views into it), gradient (the
parameters' `.grad` are views into it; none while every parameter of the chunk is frozen) and, in mixed precision, an fp32 master. An offloaded chunk owns
host memory: compute copy (the upload source; parameters point here while the chunk is not resident),
fp32 master (the same tensor as the compute copy in fp32 training), fp32 gradient, and a staging buffer
for gradient copies that must be added rather than written. Optimizer state is held by the chunk's
optimizer (see `optimizer.py`) on the same side as the master. The host buffers asked for `pinned` are
slices of the runtime's one host arena when it has one (`host_arena.py`, via `DeviceContext.host_empty`).

A sharded offloaded chunk (issue 20, `shards.py`) keeps the compute copy (zero padded to world_size shards)
and the exposed gradient whole, and the fp32 master, host gradient and staging buffer for its own shard only
(in fp32 training the master is the shard's slice of the compute copy). Where the compute copy is node-shared
(`node_shared.py`) it is a view of the node's segment, and this rank writes only its shard of it.

A device-sharded persistent chunk (issue 20, `device_shards.py`) keeps on the device its own shard of the compute
copy (`own`), of the fp32 master (mixed precision; in fp32 the master is `own`) and of the optimizer state, and the
whole gradient area (the parameters' `.grad`, as a replicated persistent chunk); `params` is the whole compute copy
(N*s elements) whose storage exists only while the chunk is gathered (resized to 0 bytes when released).
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from agent.runtime.device import DeviceContext, Event
from agent.runtime.layout import ChunkSpec, ParamEntry
from agent.runtime.shards import Shard
from client.contract import parameter_slot_bytes


def views(flat: torch.Tensor, entries: list[ParamEntry]) -> list[torch.Tensor]:
    """Per-parameter views of a flat chunk buffer, shaped like the parameters."""
    return [flat[e.offset : e.end].view(e.shape) for e in entries]


def bind(flat: torch.Tensor, entries: list[ParamEntry], cached: list[torch.Tensor] | None = None) -> None:
    """Point every parameter of the chunk at its slice of `flat` (no copy; autograd sees the same leaf).

    `cached`: the views of `flat` from an earlier `views(flat, entries)` (the runtime keeps them per
    buffer and chunk: making the views is most of the cost of a bind)."""
    with torch.no_grad():
        for e, v in zip(entries, cached if cached is not None else views(flat, entries), strict=True):
            e.param.data = v


@dataclass(frozen=True)
class ShownBackup:
    """What the parameters looked like when they were pointed at `backup_master` (`ChunkResidency.show_before_step`):
    their version counters (an in-place op on a parameter bumps it) and a few of the backup's elements at
    `sample_at` (first, middle and last of each parameter: a write through `p.data` bumps no counter, but one that
    scales, decays or shifts a parameter changes them)."""

    versions: tuple[int, ...]
    sample_at: torch.Tensor
    samples: torch.Tensor


@dataclass
class ChunkState:
    """One chunk's memory and its per-iteration bookkeeping (entry indices are positions in spec.entries)."""

    spec: ChunkSpec
    mixed: bool  # a separate fp32 master exists (compute dtype narrower than fp32, fp32_master)
    shard: Shard | None = None  # this rank's shard of a sharded offloaded chunk (master, host_grad, stage)
    node_shared: bool = False  # host_params is a view of the node-shared segment (this rank writes its shard)
    # persistent (device)
    params: torch.Tensor | None = (
        None  # device-sharded: the gathered copy (storage of 0 bytes while released)
    )
    own: torch.Tensor | None = None  # device-sharded persistent chunk: this rank's shard of the compute copy
    gathered: bool = False  # device-sharded: `params` holds every rank's shard and the parameters view it
    grad: torch.Tensor | None = None
    # per entry: its element offset in `grad` (None: no gradient slot, a frozen parameter; `gradient_offsets`)
    grad_offsets: list[int | None] = field(default_factory=list)
    # both: fp32 master (device for persistent, host for offloaded); equals params/host_params in fp32
    master: torch.Tensor | None = None
    # offloaded (host)
    host_params: torch.Tensor | None = None
    host_grad: torch.Tensor | None = None
    stage: torch.Tensor | None = None
    # residency (offloaded only)
    slot: int | None = None
    ready: Event = None  # upload finished (on the upload stream)
    # gradient bookkeeping
    expected: set[int] = field(default_factory=set)  # entries used with grad enabled since last backward
    received: set[int] = field(default_factory=set)  # entries whose grad arrived in this backward
    in_slot: set[int] = field(default_factory=set)  # received entries whose grad is still in the device slot
    touched: set[int] = field(default_factory=set)  # entries with a gradient since zero_grad
    # entries this backward's forward used on some ranks only (`GradientFlow.check_same_use`): every rank counts
    # them touched when the chunk completes (a gradient it did not get joins as zero), as DDP's
    # find_unused_parameters=True gives a locally unused, globally used parameter the averaged gradient
    joined: set[int] = field(default_factory=set)
    flushes: int = 0  # gradient copies into host_grad since zero_grad (0: the next one overwrites)
    unaveraged: bool = False  # host_grad holds this rank's own gradients not yet averaged across the ranks
    # a sharded chunk: user_grad holds its whole un-averaged local sum of no_sync() backwards (host_grad is
    # stale); the next synchronising flush adds it into the gradient area before the reduce-scatter (local_grads)
    local: bool = False
    complete: bool = False  # all expected grads of this backward have reached the host
    # a persistent chunk of a job of several ranks, averaged as its gradients complete in a synchronising backward
    # (`GradientFlow.average_early`): `early` once issued in this backward, `averaging` the host worker's task
    # (CUDA), `averaged` the event after the average on the offload stream (CUDA), `late` a gradient arrived
    # after it (the chunk is averaged again at the end of backward: exact, the averaged part is the same on every
    # rank)
    early: bool = False
    averaging: Future[None] | None = None
    averaged: Event = None
    late: bool = False
    recompute_pins: int = 0  # pins taken by recomputation in backward, held until gradients complete
    stepped: bool = False  # a speculative host step for this chunk ran since the last optimizer.step()
    # backward used the chunk again after its speculative step (a recomputation of a block run several times
    # under re-entrant checkpointing, a gradient after it): the step was undone, and the chunk is no longer
    # stepped during backward (its step waits for optimizer.step())
    reused: bool = False
    # an offloaded chunk's gradient arrived after its turn in a synchronising backward's issue order (a block run
    # again under re-entrant checkpointing): a replicated chunk's host gradient is averaged again at the end of
    # backward on every rank, a sharded chunk's later gradients (`late_sum`) are reduce-scattered then and added
    # to its shard (`GradientFlow.agree`)
    again: bool = False
    # a sharded chunk: user_grad holds this rank's own gradients flushed after its turn (un-averaged), added to
    # the averaged shard at the end of backward (`GradientFlow._add_late`)
    late_sum: bool = False
    # speculation (offloaded only): the gradient `.grad` shows after backward, and what undoing a step needs
    user_grad: torch.Tensor | None = None  # host, compute dtype; the parameters' `.grad` are views of it
    user_grad_filled: bool = False  # filled from host_grad since this backward's end (or the step)
    exposed: bool = False  # the parameters' `.grad` point into user_grad
    backup_master: torch.Tensor | None = None  # fp32 master before the speculative step
    spec_backup: bool = False  # the speculative step can be undone (master and optimizer state kept)
    spec_hypers: list[dict[str, Any]] | None = None  # hyper-parameters the speculative step used
    spec_touched: frozenset[int] = frozenset()  # entries the speculative step stepped
    # the parameters show `backup_master` (the values before the speculative step) until optimizer.step(): what
    # tells a write by the user there (None: they show host_params or a buffer); `written`: one was seen (kept
    # until the step is settled or undone, whatever re-points the parameters meanwhile)
    shown_backup: ShownBackup | None = None
    written: bool = False
    # the parameters' version counters when they were pointed at a device buffer: an in-place write by user code
    # there (an evaluation left the chunk resident, then `p.copy_(w)`) is copied back to the host at eviction
    slot_versions: tuple[int, ...] = ()
    # a node-shared chunk (`node_shared.py`): the parameters' version counters when they were pointed at the host
    # copy, which every rank of the node shares: an in-place write by user code there (`p.mul_(0.9)` after step())
    # is applied once per rank; seen at the next upload and said once (`ChunkResidency.upload`)
    host_versions: tuple[int, ...] | None = None
    host_work: Future[None] | None = None  # last host task touching this chunk (absorb or step)
    pending_events: list[Event] = field(default_factory=list)  # d2h copies the next host task must await

    @property
    def index(self) -> int:
        return self.spec.index

    def param_versions(self) -> tuple[int, ...]:
        """The parameters' version counters (an in-place write through a parameter bumps its own)."""
        return tuple(e.param._version for e in self.spec.entries)

    @property
    def offloaded(self) -> bool:
        return self.spec.offloaded

    @property
    def numel(self) -> int:
        return self.spec.used_numel

    def wait_host(self) -> None:
        """Block until this chunk's host work (gradient absorb, optimizer step) has finished."""
        if self.host_work is not None:
            self.host_work.result()
            self.host_work = None


def gradient_offsets(entries: list[ParamEntry], n: int, dtype: torch.dtype) -> tuple[list[int | None], int]:
    """Each entry's element offset in a persistent chunk's gradient area (None for a frozen parameter, one
    without `requires_grad`) and the area's size in elements. Every parameter trains: the chunk's own
    offsets and `n` elements. Otherwise the trainable parameters' aligned slots packed in order
    (`client.contract.parameter_slot_bytes`, as the plan counts them), so consecutive trainable parameters
    keep their distance and a stepper run over them reads one contiguous slice."""
    if all(e.param.requires_grad for e in entries):
        return [e.offset for e in entries], n
    esize = torch.empty((), dtype=dtype).element_size()
    out: list[int | None] = []
    size = 0
    for e in entries:
        if e.param.requires_grad:
            out.append(size)
            size += parameter_slot_bytes(e.numel, esize) // esize
        else:
            out.append(None)
    return out, size


def grad_views(state: ChunkState) -> list[torch.Tensor | None]:
    """Per-parameter views of a persistent chunk's gradient area; None for a parameter without a slot."""
    flat = state.grad
    assert flat is not None
    return [
        None if o is None else flat[o : o + e.numel].view(e.shape)
        for e, o in zip(state.spec.entries, state.grad_offsets, strict=True)
    ]


def allocate(
    spec: ChunkSpec,
    ctx: DeviceContext,
    compute_dtype: torch.dtype,
    *,
    fp32_master: bool = True,
    shard: Shard | None = None,
    shared: torch.Tensor | None = None,
) -> ChunkState:
    """Allocate a chunk's memory on its side and copy the parameters' current values into it. Without an
    fp32 master (`fp32_master` False, narrow compute dtype) the compute copy is the master and the host
    gradient has the compute dtype. `shard`: this rank's shard of a sharded offloaded chunk. `shared`: its
    compute copy in the node-shared segment (N*s elements), of which this rank writes its shard only (the
    whole chunk is built in a temporary first); the caller makes every rank wait for all shards
    (a barrier) before anything reads it."""
    n = spec.used_numel
    mixed = compute_dtype != torch.float32 and fp32_master
    master_dtype = torch.float32 if mixed else compute_dtype
    state = ChunkState(spec=spec, mixed=mixed, shard=shard, node_shared=shared is not None)
    with torch.no_grad():
        if spec.offloaded and shard is not None:
            if shared is not None:
                state.host_params = torch.zeros(shard.total, dtype=compute_dtype)  # private until the end
            else:
                state.host_params = ctx.host_empty(shard.total, compute_dtype, pinned=True)
                state.host_params.zero_()  # the padding past the last parameter: zeros on every rank
            full_master = torch.empty(shard.total, dtype=torch.float32) if mixed else state.host_params
            state.host_grad = ctx.host_empty(shard.size, master_dtype, pinned=not mixed)
            state.stage = ctx.host_empty(shard.size, compute_dtype, pinned=True)
            target = full_master
            if mixed:
                target.zero_()
        elif spec.offloaded:
            state.host_params = ctx.host_empty(n, compute_dtype, pinned=True)
            state.master = ctx.host_empty(n, torch.float32, pinned=False) if mixed else state.host_params
            state.host_grad = ctx.host_empty(n, master_dtype, pinned=not mixed)
            # the staging buffer up front: the plan counts it for every offloaded chunk (pinned, in the host arena)
            state.stage = ctx.host_empty(n, compute_dtype, pinned=True)
            target = state.master
        elif shard is not None:  # device-sharded persistent (`device_shards.py`): whole until released
            state.params = ctx.device_empty(shard.total, compute_dtype).zero_()
            # the gradient area in the chunk's own layout, zero padded to N*s (the all-reduce moves it whole)
            state.grad_offsets = [e.offset if e.param.requires_grad else None for e in spec.entries]
            if any(o is not None for o in state.grad_offsets):
                state.grad = ctx.device_empty(shard.total, compute_dtype).zero_()
            target = (
                torch.zeros(shard.total, dtype=torch.float32, device=state.params.device)
                if mixed
                else state.params
            )
        else:
            state.params = ctx.device_empty(n, compute_dtype)
            # the gradient area holds the chunk's trainable parameters only, each in its aligned slot (none
            # for a chunk of frozen parameters): what the plan counts (`chunk_model_state_bytes`). A gradient
            # arriving for a frozen one after all widens it to the whole chunk (`GradientFlow.receive`).
            state.grad_offsets, size = gradient_offsets(spec.entries, n, compute_dtype)
            if size:
                state.grad = ctx.device_empty(size, compute_dtype).zero_()
            state.master = ctx.device_empty(n, torch.float32) if mixed else state.params
            target = state.master
        if n != sum(e.numel for e in spec.entries):
            target.zero_()  # alignment padding between parameters: zeros, never stepped into NaN by garbage
        for e, v in zip(spec.entries, views(target, spec.entries), strict=True):
            v.copy_(e.param.detach().reshape(e.shape))  # fp32 master from the original values
        if mixed:
            (state.host_params if spec.offloaded else state.params)[: target.numel()].copy_(target)  # type: ignore[index]
        if shard is not None and not spec.offloaded:
            assert state.params is not None
            state.own = state.params[shard.start : shard.end].clone()
            state.master = target[shard.start : shard.end].clone() if mixed else state.own
            state.gathered = True  # until the runtime releases it (`DeviceShards.release`)
        elif shard is not None:
            # the shard's master: a slice of the compute copy (fp32), or its own fp32 copy (mixed precision)
            own = target[shard.start : shard.end]
            state.master = own.clone() if mixed else own
            if shared is not None:
                assert state.host_params is not None and shared.numel() == shard.total
                shared = ctx.host_adopt(shared, pinned=True)  # page-locked on CUDA by `node_shared.py`
                shared[shard.start : shard.end].copy_(state.host_params[shard.start : shard.end])
                state.host_params = shared
                if not mixed:
                    state.master = shared[shard.start : shard.end]
        bind(state.host_params if spec.offloaded else state.params, spec.entries)  # type: ignore[arg-type]
        # no gradient until backward makes one, as in plain PyTorch (the gradient hook copies it into the chunk's
        # gradient area and points `.grad` there); before session 23 every trainable parameter showed a zero view
        # here, which the step then took for a gradient assigned by hand
        for e in spec.entries:
            e.param.grad = None
    return state


def clipped_entries(entries: list[ParamEntry], shard: Shard) -> tuple[list[ParamEntry], list[int]]:
    """The parts of a sharded chunk's parameters inside `shard`, as flat entries whose offsets count from the
    shard's start, and each one's position in `entries`: what the shard's optimizer steps (its runs and
    per-parameter states are these pieces, so per-parameter semantics stay exact)."""
    out: list[ParamEntry] = []
    positions: list[int] = []
    for j, e in enumerate(entries):
        a, b = max(e.offset, shard.start), min(e.end, shard.end)
        if a < b:
            out.append(dataclasses.replace(e, offset=a - shard.start, numel=b - a, shape=torch.Size([b - a])))
            positions.append(j)
    return out, positions


def stage_for(state: ChunkState, ctx: DeviceContext, compute_dtype: torch.dtype) -> torch.Tensor:
    """The chunk's pinned staging buffer for gradient copies that must be added or cast (`allocate` makes it for
    offloaded chunks; made here on first use otherwise)."""
    if state.stage is None:
        state.stage = ctx.host_empty(state.numel, compute_dtype, pinned=True)
    return state.stage


class ViewCache:
    """Per-parameter views of a chunk's flat tensors, made once per (place, chunk): making them is most of
    the cost of binding parameters to a buffer or of re-pointing `.grad`."""

    HOST = -1  # the chunk's host compute copy (a buffer slot is its index, >= 0)
    USER_GRAD = -3  # an offloaded chunk's exposed `.grad` (user_grad)
    BACKUP = -4  # an offloaded chunk's master before its speculative step (fp32 parameters: `backup_master`)
    PERSISTENT = -5  # a persistent chunk's device copy (`params`)

    def __init__(self) -> None:
        self._views: dict[tuple[int, int], list[torch.Tensor]] = {}

    def get(self, where: int, st: ChunkState, flat: torch.Tensor | None) -> list[torch.Tensor]:
        """The views of `flat` (the chunk's tensor at `where`) per parameter of chunk `st`."""
        key = (where, st.index)
        cached = self._views.get(key)
        if cached is None:
            assert flat is not None
            cached = self._views[key] = views(flat, st.spec.entries)
        return cached

    def clear(self) -> None:
        self._views = {}
