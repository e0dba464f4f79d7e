"""The multi-rank constants of a planning instance (issue 20): shards, collectives, per-rank optimizer work.

A job of N ranks (`Hardware.distributed`) splits a *sharded* chunk's model states across the ranks: each
rank holds ceil(elements / N) elements of the chunk (its compute copy, gradient, master and optimizer state),
on the device when the chunk is persistent, on the host when it is offloaded (an offloaded chunk is always
sharded). Before the chunk's forward and again before its backward (unless it is still in a buffer), the
chunk's compute copy is all-gathered into a device buffer; after its backward the gradient is
reduce-scattered and each rank steps only its shard. A *replicated* (unsharded) chunk is whole on every rank
and its gradient is all-reduced (ring: a reduce-scatter and an all-gather of the gradient).

Collective times come from the trace's measured curves (`CollectiveCurves`, algorithm bandwidth of the
whole tensor): all-gather of the chunk's used bytes, reduce-scatter of its gradient bytes. Copies of a shard
are ceil(bytes / N) over the host<->device curves, plus the runtime's measured per-copy overhead as for a
whole chunk (serial devices only: `instance.build_instance` adds it). Times are integer ns, as everywhere.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from client.contract import Trace
from planner_service.solver.bandwidth import transfer_ns

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


def multi_rank_fields(
    trace: Trace,
    layout: ChunkGrid,
    grad_bytes: list[int],
    *,
    upload_ns: tuple[int, ...],
    grad_offload_ns: tuple[int, ...],
    elt: int,
    host_extra_per_elt: int,
) -> dict[str, Any]:
    """The `PolicyInstance` fields of `trace`'s process group, for an instance built for one rank as if alone
    (its whole-chunk `upload_ns` / `grad_offload_ns`, element bytes and host extras per element given by
    `instance.build_instance`, which applies them; this module does not import `instance.py`)."""
    d = trace.hardware.distributed
    assert d is not None and d.collectives is not None, "validated: a multi-rank trace has its collectives"
    n = d.world_size
    w = trace.workload
    bw = trace.hardware.bandwidth
    opt = trace.measurements.optimizer
    state_per_elt = (
        elt + w.gradient_bytes_per_param + w.optimizer_state_bytes_per_param + w.master_bytes_per_param
    )
    shard = lambda x: -(-x // n)  # noqa: E731
    ns = lambda s: round(s * 1e9)  # noqa: E731
    ag, rs = d.collectives.all_gather, d.collectives.reduce_scatter
    shard_elems = [shard(u // elt) for u in layout.used_bytes]
    # the runtime's measured per-copy cost (serial devices: build_instance added it to the whole copy)
    upload_rest = [
        t - transfer_ns(bw.h2d_pinned, u) for t, u in zip(upload_ns, layout.used_bytes, strict=True)
    ]
    grad_rest = [t - transfer_ns(bw.d2h_pinned, g) for t, g in zip(grad_offload_ns, grad_bytes, strict=True)]
    return dict(
        world_size=n,
        ranks_per_node=d.ranks_per_node,
        shard_upload_ns=tuple(
            transfer_ns(bw.h2d_pinned, shard(u)) + r
            for u, r in zip(layout.used_bytes, upload_rest, strict=True)
        ),
        gather_ns=tuple(transfer_ns(ag, u) for u in layout.used_bytes),
        reduce_scatter_ns=tuple(transfer_ns(rs, g) for g in grad_bytes),
        all_reduce_ns=tuple(transfer_ns(rs, g) + transfer_ns(ag, g) for g in grad_bytes),
        shard_grad_offload_ns=tuple(
            transfer_ns(bw.d2h_pinned, shard(g)) + r for g, r in zip(grad_bytes, grad_rest, strict=True)
        ),
        shard_device_optim_ns=tuple(ns(e * elt / opt.device_bytes_per_s) for e in shard_elems),
        shard_host_optim_ns=tuple(ns(e * elt / opt.host_bytes_per_s) for e in shard_elems),
        shard_state_bytes_of=tuple(e * state_per_elt for e in shard_elems),
        shard_host_bytes_of=tuple(e * (state_per_elt + host_extra_per_elt) for e in shard_elems),
        collective_overlap_permille=collective_overlap_permille(trace),
    )
