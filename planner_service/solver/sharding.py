"""The multi-rank constants of a planning instance (issue 20): shards, collectives, per-rank host work.

The design (docs/architecture/solver.md, "Multi-rank jobs"): ZeRO-Offload style, ZeRO-2 on the host, for
offloaded chunks; a persistent chunk is replicated (whole on every rank, its gradient all-reduced) or sharded on
the device (ZeRO-3, `agent/runtime/device_shards.py`: `device_shard_bytes_of` etc., at the end of
`multi_rank_fields`). For a sharded offloaded chunk of n used
elements in a job of N ranks, each rank owns s = ceil(n / N) rounded up to 4 elements (16-byte alignment in
fp32) of a zero-padded flat chunk of N * s elements (`shard_elements`), as the runtime lays it out:
- host, WHOLE on every rank (N * s elements, compute dtype): the exposed `.grad` (the averaged full gradient);
- host, the compute copy (the upload source, compute dtype): where every rank runs on one node
  (`client.contract.compute_copy_shared`), ONE node-shared copy per chunk that rank r writes its stepped shard
  into and every rank uploads from, so a rank's share of it is one shard (s elements: N shards over the N
  ranks of the node); with several nodes a private whole copy per rank (N * s elements);
- host, SHARDED (s elements): everything else per element (`host_extra_bytes_per_element` and the trace's
  gradient, optimizer state and master bytes): host gradient, fp32 master, optimizer state, gradient staging,
  undo backup;
- pinned: `client.contract.sharded_chunk_pinned_bytes` (its `shared_compute` as above);
- device: unchanged (the chunk is uploaded whole from the full compute copy into a buffer);
- time: the whole chunk's upload (as a replicated chunk), a reduce-scatter of the gradient after the chunk's
  backward and a D2H copy of the rank's shard only, then on the host worker the all-gather of the shards' host
  gradients into the exposed `.grad` (N * s elements of the compute dtype: `HostSteps.fill_user_grad`, before
  the speculative step: `grad_fill_ns`) and the host step of the shard, and at optimizer.step():
  several nodes: one all-gather of the compute copy (N * s elements) per sharded chunk (`gather_ns`); one node:
  no gather (the ranks wrote their shards into the shared copy) but ONE barrier per step, on the host worker
  after every chunk's host step, that each sharded chunk's next upload waits on (`step_barrier_ns`, charged
  once when any chunk is sharded; `gather_ns` is 0 for every chunk).

Control checks: every multi-rank iteration pays the runtime's tiny synchronous collectives
(`cost_model.control_checks_ns` counts them): at a phase's end (`phase_control_ns` each: the trace's
`phase_control_s`, measured on a CPU device after a phase's worth of compute, whose wait for the later rank
grows with that compute; `control_ns` where not measured) the same-use check at backward's start when any chunk
is offloaded, the persistent chunks' union at backward's end when any chunk is persistent, and with
device-sharded chunks one agreement at the end of forward and one at the end of backward; and for
device-sharded chunks an agreement before each of their two all-gathers (`control_ns` each).

Collective times come from the trace's measured curves (`CollectiveCurves`, algorithm bandwidth of the
whole tensor), read as times (`bandwidth.collective_ns`: linear in size between samples, at least the smallest
sample's time). A barrier or a control check is one tiny collective: the measured `control_s`, or in traces
from before it the smallest all-gather sample's measured time (`control_ns`), a latency-bound collective on
the same group, which over-counts it by that sample's bytes over the link (cautious). Copies of a shard are its bytes over the host<->device curves, plus the
runtime's measured per-copy overhead as for a whole chunk (serial devices only: `instance.build_instance`
adds it). Times are integer ns, as everywhere.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from client.contract import (
    IN_STEP_BURST_S,
    CollectiveCurves,
    Trace,
    compute_copy_shared,
    shard_elements,
    sharded_chunk_pinned_bytes,
)
from planner_service.solver.bandwidth import (
    collective_ns,
    host_copy_ns,
    host_step_copy_bytes,
    host_step_ns,
    host_stepped_bytes,
    host_validate_bytes,
    transfer_ns,
)

if TYPE_CHECKING:
    from planner_service.solver.chunk_grid import ChunkGrid

PERMILLE = 1000


def collective_overlap_permille(trace: Trace) -> int:
    """How much collectives and host<->device copies hide behind each other, in 1/1000: the least of the
    measured pairs (`CollectiveCopyOverlap.factor`), 0 (serialised, the cautious reading) when none was
    measured. (On a device whose copies are serial with compute, a CPU, every window is a sum anyway.)"""
    d = trace.hardware.distributed
    if d is None or d.collectives is None or not d.collectives.copy_overlap:
        return 0
    return round(PERMILLE * min(o.factor for o in d.collectives.copy_overlap))


def control_ns(curves: CollectiveCurves) -> int:
    """One tiny latency-bound collective on the group (a control check, a barrier): the measured
    `control_s` (a tiny all-gather timed as the runtime issues its checks); older traces, which did not measure
    it, the smallest all-gather sample's time (the group's most latency-bound measured collective, so likely
    more than a tiny one takes: cautious)."""
    if curves.control_s > 0:
        return max(1, round(curves.control_s * 1e9))
    s = curves.all_gather[0]
    return round(s.size_bytes / s.bytes_per_s * 1e9)


def phase_control_ns(curves: CollectiveCurves) -> int:
    """One control check at a phase's end: the measured `phase_control_s` (a CPU device: after a phase's worth
    of compute), else `control_ns` (a GPU, older traces)."""
    if curves.phase_control_s > 0:
        return max(1, round(curves.phase_control_s * 1e9))
    return control_ns(curves)


def reduction_wait_ns(trace: Trace, layout: ChunkGrid) -> tuple[int, ...]:
    """Per chunk, the wait for the later rank at its gradient reduction beyond what the in-step curves price.

    On a CPU device the curves are timed after `IN_STEP_BURST_S` of compute, their wait for the later rank
    included; in training a chunk's reduction comes after the backward of its window's blocks, and the wait
    grows with the compute before the call and levels off (2 ranks on the 2-core VM, after bursts of 5, 10, 20
    and 40 ms: ~1.3, ~2.5, ~2.9, ~2.4 ms; session 13). The trace measures both ends, the tiny control
    collective after one burst (`control_s`) and after a phase's worth (`phase_control_s`): a chunk pays
    their difference times min(1, (X - burst) / burst) for X, its blocks' measured backward, past one burst
    (0 below it, all of it from two bursts, where the wait has levelled off). Not measured (a GPU, older
    traces: no `phase_control_s`): 0. Before it the 2-rank benchmark's gradient reductions measured a median of
    -0.8 to +3.6 ms per iteration above their prediction in the runs of policies 1.6-1.7 (sessions 13-15), the
    iteration a median of +2.5% to +16%; with it, still +3.4 ms (docs/BENCHMARKS.md, session 15)."""
    d = trace.hardware.distributed
    assert d is not None and d.collectives is not None
    c = d.collectives
    extra = c.phase_control_s - c.control_s if c.phase_control_s > 0 and c.control_s > 0 else 0.0
    if extra <= 0:
        return (0,) * layout.n_chunks
    compute = [0.0] * layout.n_chunks
    for m in trace.measurements.blocks:
        compute[layout.chunk_of_block[m.block]] += m.backward_s
    return tuple(
        round(extra * min(1.0, max(0.0, (x - IN_STEP_BURST_S) / IN_STEP_BURST_S)) * 1e9) for x in compute
    )


def multi_rank_fields(
    trace: Trace,
    layout: ChunkGrid,
    grad_bytes: list[int],
    *,
    grad_offload_ns: tuple[int, ...],
    elt: int,
    host_bytes_per_elt: int,
    separate_master: bool,
    device_optim_ns: tuple[int, ...] = (),
    trained_bytes: tuple[int, ...] = (),
    charge_copies: bool = False,
) -> dict[str, Any]:
    """The `PolicyInstance` fields of `trace`'s process group, for an instance built for one rank as if alone
    (its chunks' gradient bytes `grad_bytes` and whole-chunk `grad_offload_ns`, compute element bytes `elt`, all host bytes per element of an
    offloaded chunk `host_bytes_per_elt` (model state and the runtime's host extras) and whether an fp32
    master separate from the compute copy is stepped, given by `instance.build_instance`, which applies
    them; this module does not import `instance.py`)."""
    d = trace.hardware.distributed
    assert d is not None and d.collectives is not None, "validated: a multi-rank trace has its collectives"
    n = d.world_size
    w = trace.workload
    bw = trace.hardware.bandwidth
    opt = trace.measurements.optimizer
    ag, rs, ar = d.collectives.all_gather, d.collectives.reduce_scatter, d.collectives.all_reduce
    shards = [shard_elements(u // elt, n) for u in layout.used_bytes]
    # the runtime's measured per-copy cost (serial devices: build_instance added it to the whole copy)
    grad_rest = [t - transfer_ns(bw.d2h_pinned, g) for t, g in zip(grad_offload_ns, grad_bytes, strict=True)]
    # whole per element: the exposed .grad and the compute copy (compute dtype each); sharded: the rest
    rest_per_elt = host_bytes_per_elt - 2 * elt
    # one node: the compute copy is node-shared, a rank's share is one shard; several: a private whole copy
    shared = compute_copy_shared(n, d.ranks_per_node)
    copy_shards = 1 if shared else n
    # a device-sharded persistent chunk (ZeRO-3 on the device): the shard of compute copy, master and optimizer
    # state (for its trained share), the whole gradient area (N * s, the runtime keeps `.grad` whole on the device)
    trained = trained_bytes or tuple(layout.used_bytes)
    device_shard = tuple(
        s * (elt + w.master_bytes_per_param)
        + n * s * w.gradient_bytes_per_param
        + -(-s * w.optimizer_state_bytes_per_param * t // max(u, 1))
        for s, u, t in zip(shards, layout.used_bytes, trained, strict=True)
    )
    dev_opt = device_optim_ns or (0,) * len(shards)
    # one all-gather of a chunk's N shards in the compute dtype: the device-sharded gather, the private compute
    # copy's gather at step(), the exposed .grad's fill
    gathered = tuple(n * s * elt for s in shards)
    gather = tuple(collective_ns(ag, b) for b in gathered)
    control = control_ns(d.collectives)
    wait = reduction_wait_ns(trace, layout)
    return dict(
        device_shard_bytes_of=device_shard,
        device_gather_bytes_of=gathered,
        device_gather_ns=gather,
        shard_device_optim_ns=tuple(-(-t // n) for t in dev_opt),
        world_size=n,
        ranks_per_node=d.ranks_per_node,
        compute_copy_shared=shared,
        # several nodes: each sharded chunk's compute copy all-gathered at step(); one node: one barrier instead
        gather_ns=(0,) * len(shards) if shared else gather,
        # a barrier is one tiny collective, as a control check is (the probe times no barrier itself)
        step_barrier_ns=control if shared else 0,
        control_ns=control,
        phase_control_ns=phase_control_ns(d.collectives),
        # the exposed .grad: every rank's averaged host-gradient shard, all-gathered in the compute dtype
        grad_fill_ns=gather,
        # each reduction with the wait for the later rank after its chunk's backward (`reduction_wait_ns`)
        reduce_scatter_ns=tuple(
            collective_ns(rs, n * s * w.gradient_bytes_per_param) + (k if g else 0)
            for s, g, k in zip(shards, grad_bytes, wait, strict=True)
        ),
        # a replicated chunk's gradient average: the measured all-reduce; older traces (no all-reduce curve) a
        # reduce-scatter plus an all-gather of the whole gradient
        all_reduce_ns=tuple(
            (collective_ns(ar, g) if ar else collective_ns(rs, g) + collective_ns(ag, g)) + (k if g else 0)
            for g, k in zip(grad_bytes, wait, strict=True)
        ),
        shard_grad_offload_ns=tuple(
            transfer_ns(bw.d2h_pinned, s * w.gradient_bytes_per_param) + r
            for s, r in zip(shards, grad_rest, strict=True)
        ),
        # a shard's step, plus (`charge_copies`: not a serial device) the runtime's copies around it by bytes
        shard_host_optim_ns=tuple(
            host_step_ns(opt, host_stepped_bytes(s, elt, separate_master=separate_master))
            + (
                host_copy_ns(
                    opt,
                    host_step_copy_bytes(
                        s,
                        -(-s * t // max(u, 1)),
                        elt,
                        w.undo_backup_bytes_per_param,
                        separate_master=separate_master,
                        fill=False,
                    ),
                )
                if charge_copies and t
                else 0
            )
            for s, u, t in zip(shards, layout.used_bytes, trained, strict=True)
        ),
        # optimizer.step()'s check of the rank's shard of the exposed `.grad` (`instance.validate_ns`)
        shard_validate_ns=tuple(
            host_copy_ns(opt, host_validate_bytes(s, elt, separate_master=separate_master))
            if charge_copies and t
            else 0
            for s, t in zip(shards, trained, strict=True)
        ),
        shard_host_bytes_of=tuple(n * s * elt + copy_shards * s * elt + s * rest_per_elt for s in shards),
        # the compute copy (whole, or the rank's share of the node's); the shard's staging buffer and, without a
        # separate master, its host gradient
        shard_pinned_bytes_of=tuple(
            sharded_chunk_pinned_bytes(
                u // elt, n, elt, separate_master=separate_master, shared_compute=shared
            )
            for u in layout.used_bytes
        ),
        collective_overlap_permille=collective_overlap_permille(trace),
    )
