"""The solve task: Trace + constraints -> Plan (policy, then allocation). Same function for every worker."""

from __future__ import annotations

from client.contract import Constraints, Plan, PlanRequest, SolverStatus, Trace


def solve_request(trace: Trace, request: PlanRequest, *, seed: int = 0) -> Plan:
    """Solve the memory policy, then place the iteration's buffers when the trace carries an allocation trace."""
    from planner_service.solver import solve

    plan = solve(trace, request.constraints, solver=request.solver, seed=seed)
    if trace.allocation_trace is not None and plan.solver.status in (SolverStatus.optimal, SolverStatus.feasible):
        plan = plan.model_copy(update={"allocation": _allocate(trace, request.constraints)})
    return plan


def _allocate(trace: Trace, constraints: Constraints):  # type: ignore[no-untyped-def]
    from planner_service.solver.allocation import plan_allocation, validate_allocation

    assert trace.allocation_trace is not None
    allocation = plan_allocation(trace.allocation_trace, time_limit_s=max(1.0, constraints.time_limit_s / 2))
    validate_allocation(trace.allocation_trace, allocation)  # nothing unchecked is ever stored
    return allocation
