"""Run the CP-SAT policy model on one layout: hint, parameters, status and bound, decision read back."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from ortools.sat.python import cp_model

from planner_service.solver import cpsat_model
from planner_service.solver.cost_model import Cost, evaluate_decision
from planner_service.solver.instance import Decision, PolicyInstance

# One worker: CP-SAT is deterministic for a fixed seed only when it searches sequentially, and on the
# project's 2-core machines one worker with linearization level 2 (MIR/knapsack cuts on the memory rows)
# proved the benchmark instances faster than the 2- and 4-worker portfolios (see docs/architecture/solver.md).
NUM_WORKERS = 1
LINEARIZATION_LEVEL = 2
# Probing in presolve cost a third of the CPU time on 80-block models and found nothing the LP did not.
PROBING_LEVEL = 0
# Branching on the LP solution (LP_SEARCH) proved some 50-82-block rows faster, but made exact proofs on
# small random instances 100x slower (20 s instead of 0.2 s); the default search is kept. Switch for ablation.
LP_BRANCHING = False
# Stop once the answer is proven within 0.5% of optimal (the bar is 1%). The remaining gaps on
# large models come from near-ties (which of many identical chunks stay persistent moves the time by
# milliseconds out of seconds) and from the LP bound; closing them exactly can take seconds. Tests pass
# 0.0 to demand exact optima.
RELATIVE_GAP_LIMIT = 5e-3


@dataclass(frozen=True)
class LayoutSolve:
    """Outcome of one CP-SAT solve on one layout (times in ns, as the model)."""

    status: (
        str  # 'optimal' | 'feasible' | 'infeasible' | 'unknown' ('infeasible' under a cutoff: none faster)
    )
    decision: Decision | None
    cost: Cost | None
    lower_bound_ns: float  # valid lower bound on every solution of this layout (inf when none exists)
    solve_s: float


def _parameters(solver: cp_model.CpSolver, time_limit_s: float, seed: int, gap_limit: float = 0.0) -> None:
    p = solver.parameters
    p.relative_gap_limit = gap_limit
    p.num_workers = NUM_WORKERS
    p.random_seed = seed
    p.linearization_level = LINEARIZATION_LEVEL
    p.cp_model_probing_level = PROBING_LEVEL
    if LP_BRANCHING:
        p.search_branching = p.SearchBranching.LP_SEARCH
    p.max_time_in_seconds = max(0.01, time_limit_s)


def complete_hint(pm: cpsat_model.PolicyModel, decision: Decision, seed: int) -> bool:
    """Hint every variable: fix the decision in a copy of the model, let CP-SAT derive the rest, copy it back.

    A hint on the decision booleans alone leaves CP-SAT to complete the window and memory integers, which it
    may do sub-optimally; a full assignment makes the hint's objective the starting incumbent. Returns
    False when the decision violates the model (then only the booleans are hinted).
    """
    pm.hint(decision)
    probe = pm.model.clone()
    probe.clear_objective()
    hints = probe.proto.solution_hint
    for var_index, value in zip(hints.vars, hints.values, strict=True):
        probe.add(probe.get_int_var_from_proto_index(var_index) == value)
    probe.clear_hints()
    # minimising the same objective on the fixed decision gives the tight window values
    target = pm.iteration if pm.iteration is not None else pm.peak
    assert target is not None, "the model has an objective variable"
    probe.minimize(probe.get_int_var_from_proto_index(target.index))
    s = cp_model.CpSolver()
    _parameters(s, 5.0, seed)
    if s.solve(probe) != cp_model.OPTIMAL:
        return False
    pm.model.clear_hints()
    for i in range(len(pm.model.proto.variables)):
        pm.model.add_hint(
            pm.model.get_int_var_from_proto_index(i), s.value(probe.get_int_var_from_proto_index(i))
        )
    return True


def solve_layout(
    inst: PolicyInstance,
    *,
    hint: Decision | None,
    time_limit_s: float,
    seed: int,
    cutoff_ns: int | None = None,
    gap_limit: float = RELATIVE_GAP_LIMIT,
) -> LayoutSolve:
    """Minimise iteration time on one layout, stopping when proven within `gap_limit` (relative).

    With `cutoff_ns`, only answers strictly faster than the cutoff are sought (status 'infeasible' then
    means none exists, and the cutoff is a valid lower bound for this layout).
    """
    t0 = time.perf_counter()
    pm = cpsat_model.build(inst, objective="time", cutoff_ns=cutoff_ns)
    if hint is not None:
        hint_cost = evaluate_decision(inst, hint)
        if cutoff_ns is None or hint_cost.iteration_ns < cutoff_ns:
            complete_hint(pm, hint, seed)
        else:
            pm.hint(hint)  # not a solution under the cutoff, still a direction for the search
    solver = cp_model.CpSolver()
    _parameters(solver, time_limit_s - (time.perf_counter() - t0), seed, gap_limit)
    status = solver.solve(pm.model)
    elapsed = time.perf_counter() - t0
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        decision = pm.decision(solver)
        cost = evaluate_decision(inst, decision)
        # the objective is an integer (ns): a bound of 41568196.99999999 proves 41568197 (CP-SAT reports
        # the bound as a double, and large objectives can come back a rounding error below)
        raw = solver.best_objective_bound
        bound = float(round(raw)) if abs(raw - round(raw)) < 1e-3 else float(math.ceil(raw))
        if cutoff_ns is not None:
            bound = min(bound, float(cutoff_ns))
        proven = status == cp_model.OPTIMAL and bound >= cost.iteration_ns
        return LayoutSolve("optimal" if proven else "feasible", decision, cost, bound, elapsed)
    if status == cp_model.INFEASIBLE:
        bound = float(cutoff_ns) if cutoff_ns is not None else float("inf")
        return LayoutSolve("infeasible", None, None, bound, elapsed)
    bound = float(solver.best_objective_bound) if status == cp_model.UNKNOWN else 0.0
    if cutoff_ns is not None:
        bound = min(bound, float(cutoff_ns))
    return LayoutSolve("unknown", None, None, bound, elapsed)


def min_peak_bytes(inst: PolicyInstance, *, time_limit_s: float, seed: int) -> tuple[int | None, bool]:
    """Smallest peak device bytes over the decision space of this layout (host limits respected).

    Returns (peak, proven): (the minimum, True) when proven optimal, (an upper bound on it, False) when time
    ran out with an answer, (None, True) when nothing fits this layout (proven), (None, False) when time ran
    out with no answer.
    """
    pm = cpsat_model.build(inst, objective="memory")
    solver = cp_model.CpSolver()
    _parameters(solver, time_limit_s, seed)
    status = solver.solve(pm.model)
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return int(solver.objective_value), status == cp_model.OPTIMAL
    return None, status == cp_model.INFEASIBLE
