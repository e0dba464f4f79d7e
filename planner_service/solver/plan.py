"""One way to solve a plan: the memory policy, then the placement of the iteration's buffers.

`solve_plan` is what the service's worker (`jobs/tasks.py`) and the agent's in-process path
(`agent/planning.solve_embedded`) both run, so a plan solved without a server carries the same allocation
(and passed the same validator) as one the service returns for the same trace.
"""

from __future__ import annotations

from typing import Literal

from client.contract import (
    AllocationPlan,
    AllocationTrace,
    Constraints,
    Plan,
    PlanRequest,
    SolverStatus,
    Trace,
)
from planner_service.solver.allocation import plan_allocation, validate_allocation
from planner_service.solver.entry import solve


def solve_plan(trace: Trace, request: PlanRequest | Constraints, *, seed: int = 0) -> Plan:
    """Solve the memory policy for `trace` under the request's constraints with its solver (a bare
    `Constraints`: the default solver), then, when the trace carries an allocation trace and the policy is
    feasible, place the iteration's buffers and validate the placement (nothing unchecked leaves here)."""
    if isinstance(request, PlanRequest):
        constraints, solver = request.constraints, request.solver
    else:
        constraints, solver = request, PlanRequest.model_fields["solver"].default
    plan = solve(trace, constraints, solver=solver, seed=seed)
    if trace.allocation_trace is not None and plan.solver.status in (
        SolverStatus.optimal,
        SolverStatus.feasible,
    ):
        plan = plan.model_copy(update={"allocation": _allocate(trace, constraints)})
    return plan


def _allocate(trace: Trace, constraints: Constraints) -> AllocationPlan:
    """Place the buffers of the trace's allocation trace (the profiled, un-managed iteration) within half the
    solve's time limit, validated; the plan carries the events it places."""
    assert trace.allocation_trace is not None
    return solve_allocation(
        trace.allocation_trace, max(1.0, constraints.time_limit_s / 2), iteration="profiled"
    )


def solve_allocation(
    events: AllocationTrace, time_limit_s: float, *, iteration: Literal["profiled", "managed"]
) -> AllocationPlan:
    """Place `events` (an iteration's buffers) and validate the placement; the plan carries `events`, so it
    is all the planned allocator needs. `iteration` says whose buffers they are: the trace's profiled
    iteration, or one iteration run under the plan's policy (`managed`, recorded by the agent)."""
    allocation = plan_allocation(events, time_limit_s=time_limit_s)
    validate_allocation(events, allocation)
    return allocation.model_copy(update={"iteration": iteration, "events": events})
