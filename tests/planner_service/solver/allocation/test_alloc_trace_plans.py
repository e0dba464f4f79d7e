"""`plan_allocation` on contract traces: optimal on hand-made iterations, valid when iterations repeat,
aligned, infeasible at once below the bound; `validate_allocation` rejects broken plans."""

from __future__ import annotations

import pytest

from client.contract import AllocationPlan, BufferOffset, SolverStatus
from planner_service.solver.allocation import AllocationValidationError, plan_allocation, validate_allocation
from tests.planner_service.solver.allocation.conftest import event, trace

KIB = 1024


def forward_backward_trace() -> object:
    # Two parameters (long-lived), three layer activations kept for backward (LIFO), temporaries.
    return trace(
        12,
        event(0, 8 * KIB, 0, None, "param"),
        event(1, 8 * KIB, 1, None, "param"),
        event(2, 4 * KIB, 2, 11),  # activation of layer 1
        event(3, 4 * KIB, 3, 10),  # activation of layer 2
        event(4, 2 * KIB, 4, 6, "temp"),
        event(5, 4 * KIB, 5, 9),  # activation of layer 3
        event(6, 6 * KIB, 6, 8, "temp"),  # backward temporary
        event(7, 8 * KIB, 9, 12, "temp"),
    )


def test_hand_made_iteration_is_planned_at_its_lower_bound() -> None:
    tr = forward_backward_trace()
    plan = plan_allocation(tr)
    validate_allocation(tr, plan)
    assert plan.lower_bound_bytes == 16 * KIB + 18 * KIB  # params + (4+4+4+6) KiB live at time 6..8
    assert plan.arena_bytes == plan.lower_bound_bytes
    assert plan.status == SolverStatus.optimal and plan.gap == 0.0


def test_long_lived_buffers_sit_below_everything_and_iterations_repeat() -> None:
    # A long-lived buffer allocated mid-iteration (like gradients in backward) must not reuse the address
    # of a buffer freed earlier in the same iteration: in iteration k+1 that buffer is back, the grad still there.
    tr = trace(6, event(0, 1000, 0, 2, "temp"), event(1, 1000, 3, None, "grad"), event(2, 1000, 3, 6))
    plan = plan_allocation(tr, alignment_bytes=1)
    validate_allocation(tr, plan)
    offsets = {o.id: o.offset_bytes for o in plan.offsets}
    assert offsets[1] == 0  # long-lived at the bottom
    assert offsets[0] != offsets[1]
    assert plan.arena_bytes == plan.lower_bound_bytes == 2000


def test_validator_rejects_plan_valid_for_one_iteration_but_not_the_next() -> None:
    tr = trace(6, event(0, 1000, 0, 2, "temp"), event(1, 1000, 3, None, "grad"), event(2, 1000, 3, 6))
    # Within one iteration buffer 0 ([0, 2)) and the long-lived buffer 1 (from 3) never meet ...
    one_iteration_only = AllocationPlan(
        arena_bytes=2000,
        lower_bound_bytes=2000,
        alignment_bytes=1,
        offsets=[
            BufferOffset(id=0, offset_bytes=0),
            BufferOffset(id=1, offset_bytes=0),
            BufferOffset(id=2, offset_bytes=1000),
        ],
        status=SolverStatus.feasible,
        solve_s=0.0,
        solver="hand",
    )
    # ... but buffer 0 comes back at time 6 + 0 while buffer 1 still holds its address.
    with pytest.raises(
        AllocationValidationError, match=r"buffers 1 and 0 \(next iteration\) overlap at time 6"
    ):
        validate_allocation(tr, one_iteration_only)


def test_offsets_are_aligned_to_512_by_default() -> None:
    tr = trace(
        5, event(0, 100, 0, None, "param"), event(1, 700, 0, 3), event(2, 1, 1, 4), event(3, 513, 2, 5)
    )
    plan = plan_allocation(tr)
    validate_allocation(tr, plan)
    assert plan.alignment_bytes == 512
    assert all(o.offset_bytes % 512 == 0 for o in plan.offsets)


def test_capacity_below_lower_bound_is_reported_infeasible_with_the_bound() -> None:
    tr = forward_backward_trace()
    plan = plan_allocation(tr, capacity_bytes=20 * KIB, time_limit_s=30.0)
    assert plan.status == SolverStatus.infeasible
    assert plan.lower_bound_bytes == 34 * KIB and plan.offsets == []
    assert plan.solve_s < 5.0  # no search was run (generous: a shared CI machine)
    validate_allocation(tr, plan)


def test_capacity_at_the_bound_is_met() -> None:
    tr = forward_backward_trace()
    plan = plan_allocation(tr, capacity_bytes=34 * KIB)
    validate_allocation(tr, plan, capacity_bytes=34 * KIB)
    assert plan.status == SolverStatus.optimal


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda p: p.offsets.pop(), "buffer 7 of the trace has no offset"),
        (lambda p: p.offsets.append(BufferOffset(id=99, offset_bytes=0)), "buffer 99 is not in the trace"),
        (lambda p: p.offsets.append(p.offsets[0].model_copy()), "buffer 0 is placed twice"),
        (
            lambda p: setattr(p.offsets[3], "offset_bytes", p.offsets[3].offset_bytes + 1),
            "not a multiple of alignment",
        ),
        (lambda p: setattr(p, "arena_bytes", p.arena_bytes - 512), "beyond the plan's arena_bytes"),
        (lambda p: setattr(p, "lower_bound_bytes", 1), "lower_bound_bytes: is 1"),
    ],
)
def test_validator_rejects_broken_plans(mutate: object, message: str) -> None:
    tr = forward_backward_trace()
    plan = plan_allocation(tr)
    mutate(plan)  # type: ignore[operator]
    with pytest.raises(AllocationValidationError, match=message):
        validate_allocation(tr, plan)


def test_validator_enforces_capacity() -> None:
    tr = forward_backward_trace()
    plan = plan_allocation(tr)
    with pytest.raises(AllocationValidationError, match="beyond capacity"):
        validate_allocation(tr, plan, capacity_bytes=plan.arena_bytes - 1)
