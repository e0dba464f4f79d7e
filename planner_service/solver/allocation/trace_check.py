"""Validate an `AllocationPlan` against its `AllocationTrace`, over two iterations in a row.

What the service runs before it stores any allocation plan: every event has exactly one offset, each
offset is aligned, nothing ends beyond the plan's arena or the capacity, the plan's lower bound is the
trace's, and no two buffers live at the same time share an address, with the iteration repeated once
(times of the second copy shifted by the horizon; a long-lived buffer lives from its allocation in
the first copy to the end of the second, so the second copy is the steady state), which is the
periodic steady state a training loop runs.

Reads the trace's columns and the plan's offsets as numpy arrays (no event objects), so 10^6 events
validate in seconds; the overlap sweep is `validate.check_placement_arrays`.
"""

from __future__ import annotations

import numpy as np

from client.contract import AllocationPlan, AllocationTrace, SolverStatus
from planner_service.solver.allocation.intervals import trace_arrays, trace_lower_bound_arrays
from planner_service.solver.allocation.validate import AllocationValidationError, check_placement_arrays


def trace_lower_bound(trace: AllocationTrace) -> int:
    """Max over time of live bytes, long-lived buffers counted at every time."""
    return trace_lower_bound_arrays(trace_arrays(trace))


def validate_allocation(
    trace: AllocationTrace, plan: AllocationPlan, *, capacity_bytes: int | None = None
) -> None:
    """Raise `AllocationValidationError` naming the first broken rule; return None for a usable plan."""
    if plan.status == SolverStatus.infeasible:
        if plan.offsets:
            raise AllocationValidationError("offsets: an infeasible plan must carry no offsets")
        return
    m = len(plan.offsets)
    pid = np.fromiter((o.id for o in plan.offsets), dtype=np.int64, count=m)
    poff = np.fromiter((o.offset_bytes for o in plan.offsets), dtype=np.int64, count=m)
    by_id = np.argsort(pid, kind="stable")
    sorted_ids = pid[by_id]
    repeated = sorted_ids[1:] == sorted_ids[:-1]
    if repeated.any():
        i = int(by_id[1:][repeated].min())  # first position whose id appeared before
        raise AllocationValidationError(f"offsets[{i}].id: buffer {int(pid[i])} is placed twice")
    arr = trace_arrays(trace)
    unknown = np.setdiff1d(pid, arr.ids)
    if unknown.size:
        raise AllocationValidationError(f"offsets: buffer {int(unknown[0])} is not in the trace")
    placed = np.isin(arr.ids, pid)
    if not placed.all():
        raise AllocationValidationError(
            f"offsets: buffer {int(arr.ids[np.argmin(placed)])} of the trace has no offset"
        )
    off = poff[by_id][np.searchsorted(sorted_ids, arr.ids)]  # offset of each event, in trace order
    ends = off + arr.sizes
    beyond = ends > plan.arena_bytes
    if beyond.any():
        i = int(np.argmax(beyond))
        raise AllocationValidationError(
            f"buffer {int(arr.ids[i])}: ends at {int(ends[i])} bytes, beyond the plan's arena_bytes {plan.arena_bytes}"
        )
    bound = trace_lower_bound_arrays(arr)
    if plan.lower_bound_bytes != bound:
        raise AllocationValidationError(
            f"lower_bound_bytes: is {plan.lower_bound_bytes}, the trace's live-bytes peak is {bound}"
        )
    # Two iterations unrolled, event by event: a long-lived buffer once, over [alloc, 2h); any other
    # buffer twice, the second copy shifted by the horizon.
    h = arr.horizon
    ll = arr.long_lived
    copies = np.where(ll, 1, 2)
    event_of = np.repeat(np.arange(arr.ids.shape[0]), copies)
    second = np.zeros(event_of.shape[0], dtype=np.bool_)
    second[np.cumsum(copies)[~ll] - 1] = True
    shift = np.where(second, h, 0)
    lowers = arr.alloc[event_of] + shift
    uppers = np.where(ll[event_of], 2 * h, arr.free[event_of] + shift)

    def name(i: int) -> str:
        eid = int(arr.ids[event_of[i]])
        return f"{eid} (next iteration)" if second[i] else str(eid)

    check_placement_arrays(
        lowers,
        uppers,
        arr.sizes[event_of],
        off[event_of],
        name,
        capacity=capacity_bytes,
        alignment=plan.alignment_bytes,
    )
