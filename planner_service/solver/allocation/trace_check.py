"""Validate an `AllocationPlan` against its `AllocationTrace`, over two iterations in a row.

What the service runs before it stores any allocation plan: every event has exactly one offset, each
offset is aligned, nothing ends beyond the plan's arena or the capacity, the plan's lower bound is the
trace's, and no two buffers live at the same time share an address, with the iteration repeated once
(times of the second copy shifted by the horizon; a long-lived buffer lives from its allocation in
the first copy to the end of the second, so the second copy is the steady state), which is the
periodic steady state a training loop runs.
"""

from __future__ import annotations

from client.contract import AllocationPlan, AllocationTrace, SolverStatus
from planner_service.solver.allocation.buffers import Buffer, peak_live_bytes
from planner_service.solver.allocation.validate import AllocationValidationError, validate_placement


def trace_lower_bound(trace: AllocationTrace) -> int:
    """Max over time of live bytes, long-lived buffers counted at every time."""
    long_lived = sum(e.size_bytes for e in trace.events if e.free_index is None)
    rest = [e for e in trace.events if e.free_index is not None]
    return long_lived + peak_live_bytes(
        [e.alloc_index for e in rest], [e.free_index or 0 for e in rest], [e.size_bytes for e in rest]
    )


def validate_allocation(trace: AllocationTrace, plan: AllocationPlan, *, capacity_bytes: int | None = None) -> None:
    """Raise `AllocationValidationError` naming the first broken rule; return None for a usable plan."""
    if plan.status == SolverStatus.infeasible:
        if plan.offsets:
            raise AllocationValidationError("offsets: an infeasible plan must carry no offsets")
        return
    by_id: dict[int, int] = {}
    for i, o in enumerate(plan.offsets):
        if o.id in by_id:
            raise AllocationValidationError(f"offsets[{i}].id: buffer {o.id} is placed twice")
        by_id[o.id] = o.offset_bytes
    event_ids = {e.id for e in trace.events}
    unknown = sorted(set(by_id) - event_ids)
    if unknown:
        raise AllocationValidationError(f"offsets: buffer {unknown[0]} is not in the trace")
    missing = [e.id for e in trace.events if e.id not in by_id]
    if missing:
        raise AllocationValidationError(f"offsets: buffer {missing[0]} of the trace has no offset")
    for e in trace.events:
        end = by_id[e.id] + e.size_bytes
        if end > plan.arena_bytes:
            raise AllocationValidationError(
                f"buffer {e.id}: ends at {end} bytes, beyond the plan's arena_bytes {plan.arena_bytes}"
            )
    bound = trace_lower_bound(trace)
    if plan.lower_bound_bytes != bound:
        raise AllocationValidationError(
            f"lower_bound_bytes: is {plan.lower_bound_bytes}, the trace's live-bytes peak is {bound}"
        )
    h = trace.horizon
    buffers: list[Buffer] = []
    offsets: list[int] = []
    for e in trace.events:
        off = by_id[e.id]
        if e.free_index is None:
            buffers.append(Buffer(str(e.id), e.alloc_index, 2 * h, e.size_bytes))
            offsets.append(off)
        else:
            buffers.append(Buffer(str(e.id), e.alloc_index, e.free_index, e.size_bytes))
            buffers.append(Buffer(f"{e.id} (next iteration)", h + e.alloc_index, h + e.free_index, e.size_bytes))
            offsets += [off, off]
    validate_placement(buffers, offsets, capacity=capacity_bytes, alignment=plan.alignment_bytes)
