"""What `wrap` tells the user when nothing fits: the smallest device memory that fits, or 'at most' that
much when the solver ran out of time before proving the minimum."""

from __future__ import annotations

import pytest

from agent.planning import PlanInfeasibleError, check_feasible
from client.contract import Constraints, Plan, SolverStatus
from planner_service.solver import solve
from planner_service.solver.testing.synthetic import synthetic_trace

MiB = 2**20


@pytest.fixture(scope="module")
def infeasible() -> tuple[Plan, Constraints]:
    trace = synthetic_trace(n_blocks=4, hidden=256, vocab=1000, batch=2, seq=128)
    cons = Constraints(device_memory_bytes=8 * MiB)
    plan = solve(trace, cons)
    assert plan.solver.status == SolverStatus.infeasible and plan.solver.min_device_memory_bytes
    return plan, cons


def test_a_proven_minimum_is_stated_as_the_smallest(infeasible: tuple[Plan, Constraints]) -> None:
    plan, cons = infeasible
    need = plan.solver.min_device_memory_bytes
    assert plan.solver.min_device_memory_proven is True
    with pytest.raises(
        PlanInfeasibleError, match=f"the smallest device memory that fits is {need} bytes"
    ) as info:
        check_feasible(plan, cons)
    assert "at most" not in str(info.value)


@pytest.mark.parametrize("proven", [False, None])  # None: a plan stored before the field existed
def test_an_unproven_minimum_is_stated_as_at_most(
    infeasible: tuple[Plan, Constraints], proven: bool | None
) -> None:
    plan, cons = infeasible
    solver = plan.solver.model_copy(update={"min_device_memory_proven": proven})
    need = solver.min_device_memory_bytes
    with pytest.raises(
        PlanInfeasibleError, match=f"the smallest device memory that fits is at most {need} bytes"
    ):
        check_feasible(plan.model_copy(update={"solver": solver}), cons)
