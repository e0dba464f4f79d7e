"""Policy and allocation solvers. Depend only on `client.contract`, so the agent can run them in-process.

Entry point: `solve(trace, constraints, solver=...) -> Plan`.
"""

from planner_service.solver.entry import SOLVER_VERSION, solve
from planner_service.solver.errors import PlanRequestRefused

__all__ = ["SOLVER_VERSION", "PlanRequestRefused", "solve"]
