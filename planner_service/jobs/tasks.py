"""The solve task: one plan row -> its outcome on that row. The same function runs under every job runner
(procrastinate on PostgreSQL, the in-process pool on SQLite); runners decide only when it runs again.

Every failure while solving one plan ends on that plan: an unreadable trace or a request the solver refuses
(`PlanRequestRefused`) fails it at once, with its reason; any other error (a ValueError from the solver's own
code included: that is a bug, not a bad request) hands it back for another attempt until
`Settings.max_attempts`, then fails it. The attempt is counted in its own committed transaction before
anything can fail, so no error rolls it back and the exhausted-attempts rule always fires (issue 17,
defect 1). The task never logs the traceback itself: the runner logs it once.
"""

from __future__ import annotations

import gzip
import logging
import threading
import time
import traceback
from typing import Any

from client.contract import Plan, PlanRequest, PlanStatus, SolverStatus, Trace
from planner_service.db.repositories import PlanRepository
from planner_service.db.session import Database
from planner_service.observability import SOLVE_SECONDS
from planner_service.plans import service as plans
from planner_service.settings import Settings
from planner_service.solver.errors import PlanRequestRefused
from planner_service.solver.plan import solve_plan

log = logging.getLogger("memplan.worker")
REASON_MAX_CHARS = 4000
MAX_RUNS = 10  # runs of one plan's job that fail outside the plan (the database gone) before runners give up


class PlanFailed(Exception):
    """The plan was recorded as failed (its reason is on the row): running the job again cannot help."""


class PlanRetry(Exception):
    """The plan was handed back (status queued, reason on the row): run the job again after a backoff."""


def solve_request(trace: Trace, request: PlanRequest, *, seed: int = 0) -> Plan:
    """The plan for one request: `solver.plan.solve_plan`, the one solve the agent's in-process path runs too."""
    return solve_plan(trace, request, seed=seed)


def run_plan(db: Database, settings: Settings, plan_id: str, *, stop: threading.Event | None = None) -> str:
    """Solve plan `plan_id` and record the outcome on its row; returns the status recorded ("skipped" when the
    plan was already final: a duplicate run changes nothing). Raises `PlanFailed` (recorded failed),
    `PlanRetry` (handed back for another attempt) or the database's own error (nothing recorded: retry)."""
    attempt = _start(db, plan_id, settings.max_attempts)
    if attempt is None:
        return "skipped"
    log.info("solving plan", extra={"plan_id": plan_id, "attempt": attempt})
    stored = _stored_inputs(db, plan_id)  # a database error propagates: the runner retries, nothing is lost
    try:
        trace, request = _decode(*stored)
    except Exception as exc:  # a stored trace that cannot be read never becomes readable by retrying
        _record(
            db,
            plan_id,
            attempt,
            PlanStatus.failed,
            None,
            f"the plan's trace cannot be read: {_describe(exc)}",
        )
        raise PlanFailed(f"plan {plan_id}: trace cannot be read") from exc
    started = time.perf_counter()
    try:
        if settings.fault_solve_delay_s:  # FAULT INJECTION (tests): a solve that takes this long
            (stop or threading.Event()).wait(settings.fault_solve_delay_s)
        plan = solve_request(trace, request)
    except Exception as exc:
        # a request the solver refuses fails now; anything else (a bug) gets its remaining attempts, and the
        # runner logs its traceback (chained below)
        refused = _is_refusal(exc)
        final = refused or attempt >= settings.max_attempts
        reason = (
            f"the solver refused the request: {_describe(exc)}"
            if refused
            else f"solve failed: {_describe(exc)}"
        )
        _record(db, plan_id, attempt, PlanStatus.failed if final else PlanStatus.queued, None, reason)
        if final:
            raise PlanFailed(f"plan {plan_id}: solve failed on attempt {attempt}") from exc
        raise PlanRetry(f"plan {plan_id}: solve failed on attempt {attempt}, will retry") from exc
    SOLVE_SECONDS.labels(request.solver).observe(time.perf_counter() - started)
    status = PlanStatus.infeasible if plan.solver.status == SolverStatus.infeasible else PlanStatus.done
    _record(db, plan_id, attempt, status, plan.model_dump(mode="json"), None)
    log.info("plan solved", extra={"plan_id": plan_id, "status": status, "solver": request.solver})
    return status


def _is_refusal(exc: BaseException) -> bool:
    """The solver's own word that the request is wrong; every other exception, ValueError included, is a bug."""
    return isinstance(exc, PlanRequestRefused)


def give_up(db: Database, plan_id: str, runs: int, exc: BaseException) -> None:
    """A runner stops running the plan's job (it failed `runs` times outside the plan: the database down for
    long): fail the plan with that reason rather than leave it queued or running forever."""
    with db.session() as s:
        plans.give_up(s, plan_id, f"gave up after {runs} runs of its job: {_describe(exc)}")


def _describe(exc: BaseException) -> str:
    return "".join(traceback.format_exception_only(exc)).strip()[:REASON_MAX_CHARS]


def _start(db: Database, plan_id: str, max_attempts: int) -> int | None:
    """The attempt counted and committed before any input is read (`plans.start_attempt`); None: nothing to do."""
    with db.session() as s:
        return plans.start_attempt(s, plan_id, max_attempts)


def _stored_inputs(db: Database, plan_id: str) -> tuple[bytes | None, dict[str, Any]]:
    """The plan's stored trace (gzip bytes; None if gone) and request fields, as stored."""
    with db.session() as s:
        return PlanRepository(s).solve_inputs(plan_id)


def _decode(payload: bytes | None, request: dict[str, Any]) -> tuple[Trace, PlanRequest]:
    if payload is None:
        raise LookupError(f"trace {request['trace_id']} is gone")
    return Trace.model_validate_json(gzip.decompress(payload)), PlanRequest.model_validate(request)


def _record(
    db: Database,
    plan_id: str,
    attempt: int,
    status: PlanStatus | str,
    result: dict[str, Any] | None,
    error: str | None,
) -> None:
    """Write the outcome of attempt `attempt`, only while the plan is still running that attempt (a worker
    presumed lost that comes back late cannot overwrite the attempt that replaced it)."""
    status = PlanStatus(status)
    with db.session() as s:
        recorded = plans.finish_attempt(s, plan_id, attempt, status, result, error)
    if not recorded:
        log.warning("plan %s moved on past attempt %d; its outcome %s was dropped", plan_id, attempt, status)
