"""Turn a plan's `allocation` section and the trace's allocation events into the allocator's slots and replay ops.

Slot order is the iteration's allocation order: (alloc_index, id), the order the allocation planner
and its caching-allocator simulation use. Within one logical time step frees come before
allocations ([alloc, free) lifetimes), then event id order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from client.contract import AllocationEvent, AllocationPlan, SolverStatus


class PlanReplayError(ValueError):
    """The plan's allocation section does not fit the trace's allocation events (message names the field)."""


@dataclass(frozen=True)
class Slots:
    """The planned allocations in iteration order: the C++ core's input."""

    sizes: list[int]
    offsets: list[int]
    persistent: list[bool]
    event_ids: list[int]
    arena_bytes: int
    alignment_bytes: int


@dataclass(frozen=True)
class ReplayOps:
    """One iteration of a trace as allocator operations: `ops[i] >= 0` allocates dense buffer `ops[i]`,
    `ops[i] < 0` frees buffer `-ops[i] - 1`; `sizes[k]` and `event_ids[k]` describe dense buffer k."""

    ops: list[int]
    sizes: list[int]
    event_ids: list[int]


def plan_slots(plan: AllocationPlan, events: Sequence[AllocationEvent]) -> Slots:
    """The slots of `plan` for `events`; raises PlanReplayError naming the field that does not fit."""
    if plan.status == SolverStatus.infeasible:
        raise PlanReplayError(
            "allocation.status: the allocation plan is infeasible, it has no offsets to replay"
        )
    a = plan.alignment_bytes
    if a & (a - 1):
        raise PlanReplayError(f"allocation.alignment_bytes: must be a power of two, got {a}")
    offsets: dict[int, int] = {}
    for i, o in enumerate(plan.offsets):
        if o.id in offsets:
            raise PlanReplayError(f"allocation.offsets[{i}].id: {o.id} appears twice")
        offsets[o.id] = o.offset_bytes
    event_ids = {e.id for e in events}
    for i, o in enumerate(plan.offsets):
        if o.id not in event_ids:
            raise PlanReplayError(f"allocation.offsets[{i}].id: {o.id} names no allocation_trace event")
    arena = -(-plan.arena_bytes // a) * a
    slots = Slots([], [], [], [], plan.arena_bytes, a)
    for e in sorted(events, key=lambda e: (e.alloc_index, e.id)):
        if e.id not in offsets:
            raise PlanReplayError(f"allocation.offsets: no offset for allocation_trace event id {e.id}")
        off = offsets[e.id]
        if off % a:
            raise PlanReplayError(
                f"allocation.offsets (id {e.id}).offset_bytes: {off} is not a multiple of {a}"
            )
        if off + e.size_bytes > arena:
            raise PlanReplayError(
                f"allocation.offsets (id {e.id}): the buffer ends at {off + e.size_bytes}, beyond arena_bytes "
                f"{plan.arena_bytes}"
            )
        slots.sizes.append(e.size_bytes)
        slots.offsets.append(off)
        slots.persistent.append(e.free_index is None)
        slots.event_ids.append(e.id)
    return slots


def iteration_ops(events: Sequence[AllocationEvent]) -> ReplayOps:
    """One iteration's operations; long-lived buffers are allocated (the replay skips them while held)."""
    dense = {e.id: k for k, e in enumerate(events)}
    steps: list[tuple[int, int, int]] = []  # (time, 0 free / 1 alloc, event id)
    for e in events:
        steps.append((e.alloc_index, 1, e.id))
        if e.free_index is not None:
            steps.append((e.free_index, 0, e.id))
    steps.sort()
    ops = [dense[eid] if kind == 1 else -dense[eid] - 1 for _, kind, eid in steps]
    return ReplayOps(ops=ops, sizes=[e.size_bytes for e in events], event_ids=[e.id for e in events])
