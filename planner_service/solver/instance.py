"""The integer-scaled planning instance: every constant the cost model and the solvers read, in ns and bytes.

One instance = one trace + one chunk layout + one set of limits. The cost model (`cost_model.py`), the
ProTrain search and the CP-SAT model all read the same integers, so the CP-SAT objective equals the cost
model's prediction exactly (no second rounding). Units: times are integer nanoseconds (`_ns`), memory is
integer bytes. Conversions from the trace's seconds round to the nearest nanosecond once, here.

Model-state accounting (what the runtime must match; see docs/architecture/solver.md):
- element size `elt` of the compute copy: 4 bytes for fp32, 2 for bf16/fp16; a chunk of `S` bytes holds S/elt elements.
- persistent chunk on device: U + (U/elt) * (grad + optimizer state + master) bytes, U = the chunk's used
  bytes (the runtime allocates each chunk's compute copy, gradient, master and optimizer state at its used
  size; `chunk_state_bytes_of`). Frozen parameters (`ParameterInfo.trainable` False) have neither gradient
  nor optimizer state: those two count over the chunk's trainable slots T only, U + (U/elt) * master +
  (T/elt) * (grad + optimizer state) (`chunk_model_state_bytes`; the runtime's gradient area holds the
  trainable parameters only, `agent.runtime.chunks.gradient_offsets`), and so does the optimizer's time. Policy-1.1 and earlier counted the full chunk size S here, which
  over-predicted the peak by the padding of every persistent chunk.
- offloaded chunk: the same bytes on host memory (compute-dtype copy to upload from, fp32 master if
  mixed precision, optimizer state, gradient landing area); on device only the shared buffers. Of these,
  the pinned (page-locked) part is `client.contract.offloaded_chunk_pinned_bytes` (`pinned_bytes_of`),
  the runtime's host arena counts with the same function (issue 19, defect 8).
- one device buffer: S + (S/elt) * grad bytes (the uploaded compute copy and its gradient before copy-back).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import IntEnum

from client.contract import (
    BlockKind,
    Constraints,
    DeviceType,
    ParameterInfo,
    Precision,
    Trace,
    Workload,
    offloaded_chunk_pinned_bytes,
)
from planner_service.solver.bandwidth import (
    host_copy_ns,
    host_step_copy_bytes,
    host_step_ns,
    host_stepped_bytes,
    host_validate_bytes,
    transfer_ns,
)
from planner_service.solver.chunk_grid import ChunkGrid, co_needed_chunks, slot_bytes
from planner_service.solver.held_gradients import held_gradient_bytes
from planner_service.solver.late_uses import late_use_windows
from planner_service.solver.sharding import multi_rank_fields

DEFAULT_ALPHA = 0.10


class Mode(IntEnum):
    """Per-block activation mode, as small integers for the solvers (maps to `ActivationMode`)."""

    keep = 0
    checkpoint = 1
    swap = 2


@dataclass(frozen=True)
class CostParams:
    """Knobs of the cost model that are not in the trace.

    alpha: fragmentation margin; a plan fits when peak * (1 + alpha) <= device limit. Default 0.10 until
      the trace measures it (`alpha_for(trace)` derives it from a measured allocation trace when present).
    full_duplex: H2D and D2H copies use separate links (CUDA GPUs have separate copy engines). False gives
      ProTrain's reference model, where swap traffic and prefetch share one link.
    copy_overlap: copies (chunk uploads, gradient copies, swap traffic) and the host optimizer run
      concurrently with device compute, as on a CUDA GPU with copy engines and a host CPU beside it. When
      False (a CPU "device": device and host are the same memory and cores, streams are no-ops) every copy
      is serial with compute, each window costs compute + H2D + D2H, and the host optimizer's work adds to
      the iteration. None (default) means "from the trace": True exactly when
      `trace.hardware.device_type == cuda`; `build_instance` resolves it, so an instance never holds None.
    """

    alpha: float = DEFAULT_ALPHA
    full_duplex: bool = True
    copy_overlap: bool | None = None


def copy_overlap_for(trace: Trace) -> bool:
    """Whether copies and the host optimizer overlap device compute on the trace's hardware (CUDA: yes)."""
    return trace.hardware.device_type == DeviceType.cuda


def resolve_params(trace: Trace, params: CostParams | None) -> CostParams:
    """`params` with every "from the trace" default filled in (alpha from the trace when params is None)."""
    params = params or CostParams(alpha=alpha_for(trace))
    if params.copy_overlap is None:
        params = replace(params, copy_overlap=copy_overlap_for(trace))
    return params


def alpha_for(trace: Trace, default: float = DEFAULT_ALPHA) -> float:
    """Fragmentation margin from the trace: measured peak over the live-bytes lower bound, else `default`.

    Uses `measurements.peak_device_bytes` against the max live bytes of `allocation_trace` (what a perfect
    placement would need). Clamped to [0.02, 0.5]; without both measurements the default applies.
    """
    at = trace.allocation_trace
    peak = trace.measurements.peak_device_bytes
    if at is None or peak <= 0 or not at.events:
        return default
    deltas: dict[int, int] = {}
    for e in at.events:
        deltas[e.alloc_index] = deltas.get(e.alloc_index, 0) + e.size_bytes
        end = e.free_index if e.free_index is not None else at.horizon
        deltas[end] = deltas.get(end, 0) - e.size_bytes
    live = best = 0
    for t in sorted(deltas):
        live += deltas[t]
        best = max(best, live)
    if best <= 0:
        return default
    return min(0.5, max(0.02, peak / best - 1.0))


def element_bytes(precision: Precision) -> int:
    return 4 if precision == Precision.fp32 else 2


@dataclass(frozen=True)
class PolicyInstance:
    """Integer constants of one (trace, layout, limits) triple. Block lists are indexed by block."""

    layout: ChunkGrid
    params: CostParams
    # blocks
    optimisable: tuple[bool, ...]  # repeated blocks may checkpoint/swap; prologue/epilogue always keep
    fwd_ns: tuple[int, ...]
    bwd_ns: tuple[int, ...]
    rec_ns: tuple[int, ...]
    act_bytes: tuple[int, ...]
    inp_bytes: tuple[int, ...]
    fwd_peak_bytes: tuple[int, ...]
    # the trace's backward transient plus the tied parameters' gradients held meanwhile (held_gradients.py)
    bwd_peak_bytes: tuple[int, ...]
    swap_out_ns: tuple[int, ...]  # by bandwidth; serial devices: the trace's measured swap_out_s when present
    swap_in_ns: tuple[int, ...]
    # chunks
    upload_ns: tuple[
        int, ...
    ]  # serial devices: plus the measured per-upload rest (trace's upload_overhead_s)
    # gradient copy to the host, charged once per offloaded chunk per iteration; on a serial device plus the
    # chunk runtime's measured per-chunk cost (the trace's offload_overhead_s of the chunk's parameters)
    grad_offload_ns: tuple[int, ...]
    device_optim_ns: tuple[int, ...]
    host_optim_ns: tuple[int, ...]
    chunk_state_bytes: int  # model-state bytes of a full chunk (S + S/elt * state per element)
    buffer_bytes: int
    # limits
    device_limit_bytes: int
    usable_device_bytes: int  # floor(device_limit / (1 + alpha))
    host_limit_bytes: int
    pinned_limit_bytes: int | None
    block_names: tuple[str, ...] = field(default=())
    # per chunk: device bytes when persistent == host bytes when offloaded (its used bytes' model state);
    # empty: every chunk at `chunk_state_bytes`
    chunk_state_bytes_of: tuple[int, ...] = field(default=())
    # per chunk: host bytes when offloaded, beyond `state_bytes` (the runtime's fp32 host gradient where the
    # compute dtype is narrower, the `.grad` it exposes after backward, the staging buffer in mixed precision,
    # the undo backup of speculative host steps); empty: none
    host_extra_bytes_of: tuple[int, ...] = field(default=())
    # speculative host steps are redone at optimizer.step() (the job clips): the host work again, after backward
    redo_host_steps: bool = False
    # per chunk: optimizer.step()'s check of an offloaded chunk's exposed `.grad` against the gradient its host
    # step used (`bandwidth.host_validate_bytes` at the host copy rate), on the training thread after backward,
    # chunk by chunk as their host steps finish; 0 on a serial device (the runtime probe's measured offload
    # overhead holds it) and for chunks without trained parameters; empty: none (older instances)
    validate_ns: tuple[int, ...] = field(default=())
    shard_validate_ns: tuple[int, ...] = field(default=())  # the same for one rank's shard of a sharded chunk
    # per chunk: pinned host bytes when offloaded (`client.contract.offloaded_chunk_pinned_bytes`: the upload
    # source, the gradient staging buffer, and the host gradient when no separate fp32 master exists);
    # empty: `state_bytes`
    pinned_bytes_of: tuple[int, ...] = field(default=())
    # the same copies while the other direction copies too, over the trace's concurrent (duplex) curves: a
    # window with both H2D and D2H copies charges these instead (full duplex with overlap only); empty: not
    # measured (older traces), every copy takes its one-direction time whatever runs beside it
    swap_out_duplex_ns: tuple[int, ...] = field(default=())
    swap_in_duplex_ns: tuple[int, ...] = field(default=())
    upload_duplex_ns: tuple[int, ...] = field(default=())
    grad_offload_duplex_ns: tuple[int, ...] = field(default=())
    # Multi-rank jobs (issue 20; `sharding.py` builds these). At world size 1 every tuple is empty and the
    # cost model, the CP-SAT model and the ProTrain search are exactly the single-process ones. Only offloaded
    # chunks are sharded; a sharded chunk is uploaded whole (`upload_ns`), as a replicated one.
    world_size: int = 1
    ranks_per_node: int = 1  # ranks sharing the node's host RAM: the host limit is per node
    # the ranks keep ONE node-shared compute copy per sharded chunk (all on one node:
    # `client.contract.compute_copy_shared`), not a private whole copy each
    compute_copy_shared: bool = False
    # all-gather of a sharded chunk's private compute copy on the host at step() (N * shard elements); 0 for
    # every chunk when the copy is node-shared
    gather_ns: tuple[int, ...] = field(default=())
    # node-shared copies: the one barrier per step on the host worker, after every chunk's host step, that the
    # sharded chunks' next uploads wait on (charged once when any chunk is sharded); 0 with private copies
    step_barrier_ns: int = 0
    # one of the runtime's control checks per iteration (a tiny synchronous collective: the same-use check, the
    # agreement at backward's end, the device-shard agreements; `cost_model.control_checks_ns` counts them); 0 at N = 1
    control_ns: int = 0
    # one control check at a phase's end (after forward's or backward's compute: the same-use check, the persistent
    # union, the device-shard agreements at the ends of forward and backward), whose wait for the later rank grows
    # with the compute before it: the trace's `phase_control_s`; `control_ns` where it was not measured (resolved
    # once, by `sharding.phase_control_ns`); 0 at N = 1
    phase_control_ns: int = 0
    # all-gather of a sharded chunk's host-gradient shards into its exposed `.grad` (N * shard elements, the
    # compute dtype), on the host worker before the chunk's host step
    grad_fill_ns: tuple[int, ...] = field(default=())
    reduce_scatter_ns: tuple[int, ...] = field(default=())  # reduce-scatter of a sharded chunk's gradient
    all_reduce_ns: tuple[int, ...] = field(default=())  # a replicated chunk's gradient all-reduce
    shard_grad_offload_ns: tuple[int, ...] = field(default=())  # D2H of one rank's gradient shard
    shard_host_optim_ns: tuple[int, ...] = field(default=())  # host step of one rank's shard
    # one rank's host bytes of a sharded offloaded chunk: the exposed .grad whole, the compute copy whole (private)
    # or one shard (the rank's share of the node-shared copy), the rest a shard
    shard_host_bytes_of: tuple[int, ...] = field(default=())
    shard_pinned_bytes_of: tuple[int, ...] = field(default=())  # the pinned part of `shard_host_bytes_of`
    # a DEVICE-sharded persistent chunk (ZeRO-3 on the device, `agent/runtime/device_shards.py`), per rank: its
    # steady device bytes (the shard of compute copy, fp32 master and optimizer state; the gradient area whole,
    # N * shard elements), the bytes of its whole copy while gathered (N * shard elements, compute dtype), one
    # all-gather of that copy (twice per iteration: forward and backward) and the device step of its shard
    device_shard_bytes_of: tuple[int, ...] = field(default=())
    device_gather_bytes_of: tuple[int, ...] = field(default=())
    device_gather_ns: tuple[int, ...] = field(default=())
    shard_device_optim_ns: tuple[int, ...] = field(default=())
    # how much of the shorter of (collectives, copies) in one window hides behind the longer, in 1/1000:
    # 1000 fully concurrent, 0 serialised (`CollectiveCurves.copy_overlap`; see cost_model)
    collective_overlap_permille: int = 1000
    # chunks one module needs resident at once (`chunk_grid.co_needed_chunks`): the offloaded ones of each set
    # must fit in the buffers together, or the runtime refuses the plan; empty: no module spans two chunks
    co_needed: tuple[tuple[int, ...], ...] = field(default=())
    # (chunk, window) pairs, window > chunk: a tied parameter of the chunk used again in a later window
    # (`late_uses.late_use_windows`): an offloaded chunk not resident after forward is uploaded again there and
    # displaces the first resident chunk for backward (cost_model); empty: no such parameter
    late_uses: tuple[tuple[int, int], ...] = field(default=())
    # per chunk: the part of its measured per-chunk cost (in `grad_offload_ns`) paid in forward (a serial device:
    # the trace's offload_forward_s of the chunk's parameters): `cost_model.evaluate_decision` reports it in the
    # chunk's forward window instead of backward, the same sum; empty: not measured (all of it in backward)
    offload_forward_ns: tuple[int, ...] = field(default=())
    # per chunk: the part of it paid in optimizer.step() (settling the chunk's speculative host step: the trace's
    # offload_step_s), reported after backward instead of in it, the same sum; empty: not measured
    offload_step_ns: tuple[int, ...] = field(default=())
    # per chunk: holds a parameter used outside its owning module's forward (`ParameterInfo.used_outside_owner`):
    # never sharded on the device (its released placeholder would be read); empty: none
    no_device_shard: tuple[bool, ...] = field(default=())

    def device_shardable(self, c: int) -> bool:
        """Whether persistent chunk `c` may be sharded on the device (the instance has the terms, and no
        parameter of it is used outside its owning module's forward)."""
        return bool(self.device_shard_bytes_of) and not (self.no_device_shard and self.no_device_shard[c])

    def min_buffers(self, offloaded: tuple[bool, ...]) -> int:
        """Fewest buffers the runtime accepts for these offloaded chunks: 1 when any is offloaded, and for
        every co-needed set (a module spanning chunks) as many as its offloaded chunks; 0 when none is."""
        if not any(offloaded):
            return 0
        return max([1, *(sum(offloaded[c] for c in cs) for cs in self.co_needed)])

    def state_bytes(self, c: int) -> int:
        """Model-state bytes of chunk c (on the device when persistent, on the host when offloaded)."""
        return self.chunk_state_bytes_of[c] if self.chunk_state_bytes_of else self.chunk_state_bytes

    def pinned_bytes(self, c: int) -> int:
        """Pinned host bytes of chunk c when offloaded (the runtime's host arena holds exactly these)."""
        return self.pinned_bytes_of[c] if self.pinned_bytes_of else self.state_bytes(c)

    def validate(self, c: int, *, sharded: bool = False) -> int:
        """optimizer.step()'s check of chunk c's exposed `.grad` when offloaded (`validate_ns`; sharded: of this
        rank's shard, `shard_validate_ns`); 0 where not given."""
        xs = self.shard_validate_ns if sharded else self.validate_ns
        return xs[c] if xs else 0

    def host_bytes(self, c: int) -> int:
        """Host bytes of chunk c when offloaded: its model state plus the runtime's host-side extras."""
        return self.state_bytes(c) + (self.host_extra_bytes_of[c] if self.host_extra_bytes_of else 0)

    @property
    def sharded_job(self) -> bool:
        """More than one rank: chunks may be sharded, collectives are timed."""
        return self.world_size > 1

    @property
    def copy_overlap(self) -> bool:
        """Copies and the host optimizer overlap compute (resolved by `build_instance`; None reads as True)."""
        return self.params.copy_overlap is not False

    @property
    def duplex(self) -> bool:
        """Windows whose copies run both ways at once charge the concurrent (duplex) copy times."""
        return (
            bool(self.upload_duplex_ns)
            and self.params.full_duplex
            and self.copy_overlap
            and not self.sharded_job
        )

    @property
    def n_blocks(self) -> int:
        return len(self.fwd_ns)

    @property
    def n_chunks(self) -> int:
        return self.layout.n_chunks

    def blocks_in_window(self, c: int) -> list[int]:
        return [b for b, w in enumerate(self.layout.chunk_of_block) if w == c]


def host_extra_bytes_per_element(w: Workload) -> int:
    """Host bytes per element of an offloaded chunk beyond gradient + optimizer state + master (see
    `agent/runtime/chunks.py`): the host gradient is fp32 whenever an fp32 master is stepped (wider than the
    compute gradient the trace counts), the `.grad` exposed after backward (compute dtype), the staging
    buffer of gradient copies that are cast or added (compute dtype: mixed precision, and gradient
    accumulation or a second copy in one backward without an fp32 master, so every offloaded chunk counts
    one; it is pinned, see `client.contract.offloaded_chunk_pinned_bytes`), and the undo backup of
    speculative steps."""
    elt = element_bytes(w.precision)
    fp32_master = w.precision == Precision.fp32 or w.master_bytes_per_param > 0
    host_grad = 4 if fp32_master else elt
    staging = elt
    return max(0, host_grad - w.gradient_bytes_per_param) + elt + staging + w.undo_backup_bytes_per_param


def trained_bytes(params: list[ParameterInfo], layout: ChunkGrid) -> list[int]:
    """Per chunk: bytes of its trainable parameters' slots (`used_bytes` when every parameter trains, 0 for
    a chunk of frozen parameters)."""
    return [
        u
        if all(params[i].trainable for i in range(a, b))
        else sum(slot_bytes(params[i]) for i in range(a, b) if params[i].trainable)
        for u, (a, b) in zip(layout.used_bytes, layout.param_ranges, strict=True)
    ]


def chunk_model_state_bytes(w: Workload, used: int, trained: int) -> int:
    """Model-state bytes of a chunk of `used` bytes, `trained` of them trainable parameters' slots: the
    compute copy and (mixed precision) the fp32 master whole, gradient and optimizer state for the trainable
    slots only (a persistent chunk's gradient area holds its trainable parameters only,
    `agent.runtime.chunks.gradient_offsets`; its steppers hold state for what the optimizer steps)."""
    elt = element_bytes(w.precision)
    return (
        used
        + (used // elt) * w.master_bytes_per_param
        + (trained // elt) * (w.gradient_bytes_per_param + w.optimizer_state_bytes_per_param)
    )


def chunk_host_extra_bytes(w: Workload, used: int, trained: int) -> int:
    """Host bytes of an offloaded chunk beyond `chunk_model_state_bytes` (`host_extra_bytes_per_element`): the
    undo backup for its trainable elements only, and the gradient of its frozen elements (an offloaded
    chunk's host gradient is the whole chunk's; `chunk_model_state_bytes` counted the trainable slots' only)."""
    elt = element_bytes(w.precision)
    undo = w.undo_backup_bytes_per_param
    frozen_grad = (used // elt - trained // elt) * w.gradient_bytes_per_param
    return (used // elt) * (host_extra_bytes_per_element(w) - undo) + (trained // elt) * undo + frozen_grad


def build_instance(
    trace: Trace, layout: ChunkGrid, constraints: Constraints, params: CostParams | None = None
) -> PolicyInstance:
    """Scale the trace's measurements to integers for one layout and one set of limits."""
    params = resolve_params(trace, params)
    w = trace.workload
    m = trace.measurements
    bw = trace.hardware.bandwidth
    elt = element_bytes(w.precision)
    S = layout.chunk_size_bytes
    state_per_elt = w.gradient_bytes_per_param + w.optimizer_state_bytes_per_param + w.master_bytes_per_param
    host_extra_per_elt = host_extra_bytes_per_element(w)
    ns = lambda s: round(s * 1e9)  # noqa: E731
    blocks = trace.model.blocks
    meas = m.blocks
    params_list = trace.model.parameters
    numels = [sum(params_list[i].numel for i in range(a, b)) for a, b in layout.param_ranges]
    # bytes of each chunk's trainable parameters (their slots, as `used_bytes` counts them): frozen ones have
    # no optimizer state and are never stepped; a chunk with none has no gradient (see the module docstring)
    trained = trained_bytes(params_list, layout)
    grad_bytes = [n * w.gradient_bytes_per_param if t else 0 for n, t in zip(numels, trained, strict=True)]
    host_limit = constraints.host_memory_bytes or trace.hardware.host_memory_bytes
    pinned = constraints.pinned_memory_bytes or trace.hardware.pinned_memory_limit_bytes
    serial = params.copy_overlap is False
    offload_forward: tuple[int, ...] = ()  # serial devices only (see the fields)
    offload_step: tuple[int, ...] = ()
    swap_out = [transfer_ns(bw.d2h_pinned, x.activation_bytes) for x in meas]
    swap_in = [transfer_ns(bw.h2d_pinned, x.activation_bytes) for x in meas]
    grad_offload = [transfer_ns(bw.d2h_pinned, g) for g in grad_bytes]
    upload = [transfer_ns(bw.h2d_pinned, u) for u in layout.used_bytes]
    if serial:
        # copies are serial with compute: what the runtime's own code paths measurably cost (trace fields,
        # 0 = not measured) replaces the bytes-over-bandwidth estimate (swap), or adds to it (chunk runtime)
        swap_out = [ns(x.swap_out_s) if x.swap_out_s > 0 else t for x, t in zip(meas, swap_out, strict=True)]
        swap_in = [ns(x.swap_in_s) if x.swap_in_s > 0 else t for x, t in zip(meas, swap_in, strict=True)]
        per_block = [0] * len(blocks)
        for p in params_list:
            per_block[p.block] += 1

        def spread(field: str) -> list[int]:  # a block's figure over its parameters, summed per chunk
            per_param = [getattr(meas[b], field) / n if n else 0.0 for b, n in enumerate(per_block)]
            return [
                ns(sum(per_param[params_list[i].block] for i in range(a, b))) for a, b in layout.param_ranges
            ]

        grad_offload = [g + o for g, o in zip(grad_offload, spread("offload_overhead_s"), strict=True)]
        upload = [u + o for u, o in zip(upload, spread("upload_overhead_s"), strict=True)]
        if any(x.offload_forward_s > 0 for x in meas):
            offload_forward = tuple(spread("offload_forward_s"))
        if any(x.offload_step_s > 0 for x in meas):
            offload_step = tuple(spread("offload_step_s"))
    duplex: dict[str, tuple[int, ...]] = {}
    # copies overlap: both ways at once is possible (single-rank jobs: the multi-rank windows use the collective
    # model of `sharding.py`, which has no duplex terms yet)
    if bw.has_duplex and not serial and params.full_duplex and trace.hardware.world_size == 1:
        up, down = bw.duplex_h2d_pinned, bw.duplex_d2h_pinned
        duplex = {
            "swap_out_duplex_ns": tuple(transfer_ns(down, x.activation_bytes) for x in meas),
            "swap_in_duplex_ns": tuple(transfer_ns(up, x.activation_bytes) for x in meas),
            "upload_duplex_ns": tuple(transfer_ns(up, u) for u in layout.used_bytes),
            "grad_offload_duplex_ns": tuple(transfer_ns(down, g) for g in grad_bytes),
        }
        alone = (tuple(swap_out), tuple(swap_in), tuple(upload), tuple(grad_offload))
        if tuple(duplex.values()) == alone:
            duplex = {}  # nothing slows down when both ways copy (a full-duplex link as modelled): no terms
    inst = PolicyInstance(
        layout=layout,
        params=params,
        optimisable=tuple(b.kind == BlockKind.block for b in blocks),
        fwd_ns=tuple(ns(x.forward_s) for x in meas),
        bwd_ns=tuple(ns(x.backward_s) for x in meas),
        rec_ns=tuple(ns(x.recompute_s) for x in meas),
        act_bytes=tuple(x.activation_bytes for x in meas),
        inp_bytes=tuple(x.input_bytes for x in meas),
        fwd_peak_bytes=tuple(x.forward_transient_peak_bytes for x in meas),
        # a tied parameter's gradient from its later use is held during the blocks' backward in between, above
        # what each block's measured transient counts (`held_gradients.py`)
        bwd_peak_bytes=tuple(
            x.backward_transient_peak_bytes + h
            for x, h in zip(meas, held_gradient_bytes(blocks, params_list), strict=True)
        ),
        swap_out_ns=tuple(swap_out),
        swap_in_ns=tuple(swap_in),
        upload_ns=tuple(upload),
        grad_offload_ns=tuple(grad_offload),
        device_optim_ns=tuple(ns(t / m.optimizer.device_bytes_per_s) for t in trained),
        # one host step call per chunk with trained bytes: its measured per-call overhead plus bytes over the rate,
        # plus the runtime's copies around it by bytes (a serial device: in the measured offload overhead already)
        host_optim_ns=tuple(
            host_step_ns(
                m.optimizer, host_stepped_bytes(t // elt, elt, separate_master=w.master_bytes_per_param > 0)
            )
            + (
                0
                if serial or not t
                else host_copy_ns(
                    m.optimizer,
                    host_step_copy_bytes(
                        u // elt,
                        t // elt,
                        elt,
                        w.undo_backup_bytes_per_param,
                        separate_master=w.master_bytes_per_param > 0,
                        fill=True,
                    ),
                )
            )
            for u, t in zip(layout.used_bytes, trained, strict=True)
        ),
        chunk_state_bytes=S + (S // elt) * state_per_elt,
        chunk_state_bytes_of=tuple(
            chunk_model_state_bytes(w, u, t) for u, t in zip(layout.used_bytes, trained, strict=True)
        ),
        host_extra_bytes_of=tuple(
            chunk_host_extra_bytes(w, u, t) for u, t in zip(layout.used_bytes, trained, strict=True)
        ),
        pinned_bytes_of=tuple(
            offloaded_chunk_pinned_bytes(u, separate_master=w.master_bytes_per_param > 0)
            for u in layout.used_bytes
        ),
        redo_host_steps=w.clips_gradients and w.undo_backup_bytes_per_param > 0,
        validate_ns=tuple(
            0
            if serial or not t
            else host_copy_ns(
                m.optimizer,
                host_validate_bytes(u // elt, elt, separate_master=w.master_bytes_per_param > 0),
            )
            for u, t in zip(layout.used_bytes, trained, strict=True)
        ),
        buffer_bytes=S + (S // elt) * w.gradient_bytes_per_param,
        device_limit_bytes=constraints.device_memory_bytes,
        usable_device_bytes=int(constraints.device_memory_bytes // (1.0 + params.alpha)),
        host_limit_bytes=host_limit,
        pinned_limit_bytes=pinned,
        block_names=tuple(b.name for b in blocks),
        swap_out_duplex_ns=duplex.get("swap_out_duplex_ns", ()),
        swap_in_duplex_ns=duplex.get("swap_in_duplex_ns", ()),
        upload_duplex_ns=duplex.get("upload_duplex_ns", ()),
        grad_offload_duplex_ns=duplex.get("grad_offload_duplex_ns", ()),
        co_needed=co_needed_chunks(trace, layout),
        late_uses=late_use_windows(trace, layout),
        no_device_shard=tuple(
            any(p.used_outside_owner for p in params_list[a:b]) for a, b in layout.param_ranges
        ),
        offload_forward_ns=offload_forward,
        offload_step_ns=offload_step,
    )
    if trace.hardware.world_size == 1:
        return inst
    return replace(
        inst,
        **multi_rank_fields(
            trace,
            layout,
            grad_bytes,
            grad_offload_ns=inst.grad_offload_ns,
            elt=elt,
            host_bytes_per_elt=elt + state_per_elt + host_extra_per_elt,
            separate_master=w.master_bytes_per_param > 0,
            device_optim_ns=inst.device_optim_ns,
            trained_bytes=tuple(trained),
            charge_copies=not serial,
        ),
    )


@dataclass(frozen=True)
class Decision:
    """One point of the decision space: chunk placements, buffer count, per-block modes, and in a multi-rank
    job which chunks are sharded (empty: every offloaded one; an offloaded chunk may also be replicated; a
    sharded persistent chunk is sharded on the device: ZeRO-3, `agent/runtime/device_shards.py`)."""

    offloaded: tuple[bool, ...]  # per chunk
    n_buffers: int
    modes: tuple[Mode, ...]  # per block
    sharded: tuple[bool, ...] = ()  # per chunk; world size 1: empty (nothing is sharded)

    def sharded_chunks(self, inst: PolicyInstance) -> tuple[bool, ...]:
        """Per chunk: sharded across the ranks (always False at world size 1)."""
        if not inst.sharded_job:
            return (False,) * len(self.offloaded)
        return self.sharded or self.offloaded

    def buffered(self, inst: PolicyInstance) -> tuple[bool, ...]:
        """Per chunk: used through the device buffers (the offloaded chunks, sharded or not)."""
        return self.offloaded

    def check(self, inst: PolicyInstance) -> None:
        if len(self.offloaded) != inst.n_chunks:
            raise ValueError(f"offloaded: {len(self.offloaded)} entries for {inst.n_chunks} chunks")
        if len(self.modes) != inst.n_blocks:
            raise ValueError(f"modes: {len(self.modes)} entries for {inst.n_blocks} blocks")
        if any(self.offloaded) and self.n_buffers < 1:
            raise ValueError("n_buffers: offloaded chunks need at least one buffer")
        for cs in inst.co_needed:
            needed = [c for c in cs if self.offloaded[c]]
            if len(needed) > self.n_buffers:
                raise ValueError(
                    f"n_buffers: a module needs the offloaded chunks {needed} resident at once, more than the "
                    f"{self.n_buffers} buffer(s) (the runtime refuses this plan): add buffers or keep one persistent"
                )
        if self.sharded:
            if not inst.sharded_job:
                raise ValueError("sharded: a single-rank job shards nothing")
            if len(self.sharded) != inst.n_chunks:
                raise ValueError(f"sharded: {len(self.sharded)} entries for {inst.n_chunks} chunks")
            if not inst.device_shard_bytes_of and any(
                sh and not o for sh, o in zip(self.sharded, self.offloaded, strict=True)
            ):
                raise ValueError(
                    "sharded: a persistent chunk is sharded, and the instance has no device-shard terms"
                )
            for c, (sh, o) in enumerate(zip(self.sharded, self.offloaded, strict=True)):
                if sh and not o and inst.device_shard_bytes_of and not inst.device_shardable(c):
                    raise ValueError(
                        f"sharded[{c}]: a persistent chunk holding a parameter used outside its owning module's "
                        "forward is sharded on the device (it would read a released placeholder)"
                    )
