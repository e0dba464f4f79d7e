"""The rules about plans, in one place for the HTTP endpoints (a few lines each) and the solve jobs.

- An identical earlier request (same trace content, limits, objective, solver and solver version) of the
  project is reused unless it failed; a new plan and its solve job are written in one transaction. Identical
  requests at once make one plan (a unique index on the request keys of plans that did not fail; the losers
  roll back and reuse it).
- Feedback is for plans that were applied: only a `done` plan takes it.
- The allocation of a `done` plan can be replaced once the agent has run it: the agent records one iteration
  under the plan (its offloading, checkpointing, swap) and sends it; the service places those buffers (the
  same planner and validator as at solve time) and stores the placement, counting a revision of the plan.
- A plan this process changes is dropped from the change feed's memory before the commit, so no poll here
  answers from the old entity tag afterwards.
- The solve job (`jobs/tasks.py`) counts an attempt before it reads anything; a plan found running was
  orphaned by a lost worker and is failed once its last allowed attempt is used; an attempt's outcome is
  written only while the plan still runs that attempt; a runner that gives up on a job fails its plan.

The functions raise the domain errors below; the API turns them into responses (`api/plans.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy.orm import Session

from client.contract import (
    FINAL_PLAN_STATUSES,
    PENDING_PLAN_STATUSES,
    AllocationTrace,
    Feedback,
    PlanRequest,
    PlanStatus,
)
from planner_service.db.change_feed import ChangeFeed
from planner_service.db.models import FeedbackRow, PlanRow
from planner_service.db.repositories import (
    FeedbackRepository,
    PlanRepository,
    TraceRepository,
    once_more_on_conflict,
)
from planner_service.observability import PLAN_OUTCOMES
from planner_service.solver import SOLVER_VERSION
from planner_service.solver.plan import solve_allocation

Enqueue = Callable[[Session, str], None]


class TraceNotFound(LookupError):
    """The request names a trace the project does not have."""


class PlanNotFound(LookupError):
    """No such plan in the project."""


class AllocationNotAccepted(Exception):
    """A managed allocation for a plan that is not `done` (nothing was applied), or events that cannot be placed."""


class AllocationInvalid(ValueError):
    """Managed allocation events that cannot be an iteration of the plan (none at all, a block it does not have)."""


class FeedbackNotAccepted(Exception):
    """Feedback for a plan that is not `done` (still solving, failed or infeasible: nothing was applied)."""


@dataclass(frozen=True)
class Requested:
    plan: PlanRow
    reused: bool  # an identical earlier request's plan, returned as it is


def solver_version() -> str:
    """The version of the solver that new plans are solved with (part of the request key)."""
    return SOLVER_VERSION


@once_more_on_conflict
def request_plan(session: Session, project_id: str, request: PlanRequest, enqueue: Enqueue) -> Requested:
    """The project's plan for `request`: an identical earlier one that did not fail, else a new queued plan
    whose solve job `enqueue` adds to this session's transaction (the plan and its job, or neither). Identical
    requests at once make one plan: the others get it as reused (`once_more_on_conflict`)."""
    trace = TraceRepository(session).get(request.trace_id, project_id, payload=False)
    if trace is None:
        raise TraceNotFound(f"trace_id: trace {request.trace_id} not found")
    row, created = PlanRepository(session).reusable_or_new(
        trace, request.constraints, request.objective, request.solver, solver_version()
    )
    if created:
        enqueue(session, row.id)
    return Requested(row, reused=not created)


def add_feedback(
    session: Session, project_id: str, plan_id: str, feedback: Feedback, feed: ChangeFeed | None
) -> FeedbackRow:
    """Store what the agent measured running plan `plan_id`; only a `done` plan takes feedback."""
    plan = PlanRepository(session).get(plan_id, project_id)
    if plan is None:
        raise PlanNotFound(f"plan {plan_id} not found")
    if plan.status != PlanStatus.done:
        raise FeedbackNotAccepted(
            f"plan {plan_id} is {plan.status}: feedback is for plans that were applied (done)"
        )
    row = FeedbackRepository(session).add(plan, feedback)
    if feed is not None:
        feed.forget(plan_id)  # before the commit: no poll here answers from the old tag after it
    return row


MANAGED_ALLOCATION_TIME_LIMIT_S = 10.0
"""How long the service spends placing a managed iteration's buffers (a valid placement always comes back)."""


def store_managed_allocation(
    session: Session, project_id: str, plan_id: str, events: AllocationTrace, feed: ChangeFeed | None
) -> PlanRow:
    """Place `events` (one iteration run under plan `plan_id`, recorded by the agent), validate the placement
    and store it as the plan's allocation (`iteration="managed"`); only a `done` plan takes it."""
    plan = PlanRepository(session).get(plan_id, project_id)
    if plan is None:
        raise PlanNotFound(f"plan {plan_id} not found")
    if plan.status != PlanStatus.done:
        raise AllocationNotAccepted(
            f"plan {plan_id} is {plan.status}: a managed allocation is for plans that were applied (done)"
        )

    _check_managed_events(events, plan)
    try:
        allocation = solve_allocation(events, MANAGED_ALLOCATION_TIME_LIMIT_S, iteration="managed")
    except ValueError as exc:  # the validator's or the planner's input checks, naming the event
        raise AllocationNotAccepted(f"allocation_trace: {exc}") from exc
    row = PlanRepository(session).replace_allocation(plan_id, project_id, allocation.model_dump(mode="json"))
    if row is None:
        raise AllocationNotAccepted(f"plan {plan_id} is no longer done")
    if feed is not None:
        feed.forget(plan_id)  # before the commit: no poll here answers from the old tag after it
    return row


def _check_managed_events(events: AllocationTrace, plan: PlanRow) -> None:
    """An iteration run under `plan` allocates something, and only in the plan's blocks; anything else would
    replace the plan's placement with one of no iteration (the stored allocation is kept: nothing is written)."""
    if len(events) == 0:
        raise AllocationInvalid(
            "allocation_trace: has no events (an iteration under the plan allocates at least one buffer); "
            "the plan's allocation is kept"
        )
    n_blocks = len(((plan.result or {}).get("policy") or {}).get("blocks") or ())
    blocks = events.arrays.array("block")
    beyond = (blocks >= n_blocks).nonzero()[0]
    if n_blocks and beyond.size:
        i = int(beyond[0])
        raise AllocationInvalid(
            f"allocation_trace.events[{i}].block: {int(blocks[i])} names no block of the plan "
            f"(it has blocks 0..{n_blocks - 1})"
        )


def start_attempt(session: Session, plan_id: str, max_attempts: int) -> int | None:
    """Count an attempt and mark the plan running; the attempt's number, or None when there is nothing to do
    (final already, gone, or taken by another run). A plan found running was orphaned by a worker that died
    (its job came back through stalled-job recovery or a restart): after its last allowed attempt it fails."""
    plans = PlanRepository(session)
    found = plans.progress(plan_id)
    if found is None or found[0] in FINAL_PLAN_STATUSES:
        return None
    status, attempts = found
    if status == PlanStatus.running and attempts >= max_attempts:
        if plans.fail_if(
            plan_id,
            (PlanStatus.running.value,),
            f"the worker solving it was lost {attempts} times (no heartbeat)",
        ):
            PLAN_OUTCOMES.labels(PlanStatus.failed.value).inc()
        return None
    return attempts + 1 if plans.claim(plan_id, status, attempts) else None


def finish_attempt(
    session: Session,
    plan_id: str,
    attempt: int,
    status: PlanStatus,
    result: dict[str, Any] | None,
    error: str | None,
) -> bool:
    """Record attempt `attempt`'s outcome (`queued`: handed back for another attempt); False when the plan has
    moved on past that attempt (a late worker presumed lost), and nothing was written."""
    if not PlanRepository(session).finish_attempt(plan_id, attempt, status, result, error):
        return False
    if status.final:
        PLAN_OUTCOMES.labels(status.value).inc()
    return True


def give_up(session: Session, plan_id: str, reason: str) -> None:
    """A runner stops running the plan's job: fail the plan, if still pending, rather than leave it queued or
    running forever."""
    if PlanRepository(session).fail_if(plan_id, [s.value for s in PENDING_PLAN_STATUSES], reason):
        PLAN_OUTCOMES.labels(PlanStatus.failed.value).inc()
