"""Fixtures of the planned-allocator tests: hand-built events and plans, the host library built once."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from client.contract import AllocationEvent, AllocationPlan, BufferOffset, SolverStatus

KiB = 1024


def event(
    id: int, size: int, alloc: int, free: int | None, category: str = "temp", phase: str = "forward"
) -> AllocationEvent:
    return AllocationEvent(
        id=id, size_bytes=size, alloc_index=alloc, free_index=free, category=category, phase=phase
    )


def plan_for(
    events: Sequence[AllocationEvent], offsets: dict[int, int], alignment: int = 512, arena: int | None = None
) -> AllocationPlan:
    """An AllocationPlan with the given offsets; the arena defaults to the highest end, as the planner reports."""
    arena = arena if arena is not None else max(offsets[e.id] + e.size_bytes for e in events)
    return AllocationPlan(
        arena_bytes=arena,
        lower_bound_bytes=arena,
        alignment_bytes=alignment,
        offsets=[BufferOffset(id=e.id, offset_bytes=offsets[e.id]) for e in events],
        status=SolverStatus.optimal,
        solve_s=0.0,
        solver="hand",
    )


@pytest.fixture(scope="session", autouse=True)
def host_library() -> None:
    """Build the host library once per session (cached across sessions); a build failure fails loudly."""
    from agent.allocator.library import load_library

    load_library("host")


@pytest.fixture()
def three_buffers() -> tuple[list[AllocationEvent], AllocationPlan]:
    """a [0,2) and b [1,3) side by side; c [2,4) reuses a's bytes; the arena has 2 KiB spare at the top."""
    evs = [event(0, 1000, 0, 2), event(1, 600, 1, 3), event(2, 1024, 2, 4)]
    return evs, plan_for(evs, {0: 0, 1: 1024, 2: 0}, arena=4096)
