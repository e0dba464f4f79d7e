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

from sqlalchemy import select, update

from client.contract import (
    FINAL_PLAN_STATUSES,
    PENDING_PLAN_STATUSES,
    Constraints,
    Plan,
    PlanRequest,
    PlanStatus,
    SolverStatus,
    Trace,
)
from planner_service.db.base import utcnow
from planner_service.db.models import PlanRow, TraceRow
from planner_service.db.repositories import plan_headline
from planner_service.db.session import Database
from planner_service.observability import PLAN_OUTCOMES, SOLVE_SECONDS
from planner_service.settings import Settings

log = logging.getLogger("memplan.worker")
REASON_MAX_CHARS = 4000
MAX_RUNS = 10  # runs of one plan's job that fail outside the plan (the database gone) before runners give up


class PlanFailed(Exception):
    """The plan was recorded as failed (its reason is on the row): running the job again cannot help."""


class PlanRetry(Exception):
    """The plan was handed back (status queued, reason on the row): run the job again after a backoff."""


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
        _record(db, plan_id, attempt, PlanStatus.failed, None, f"the plan's trace cannot be read: {_describe(exc)}")
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
        reason = f"the solver refused the request: {_describe(exc)}" if refused else f"solve failed: {_describe(exc)}"
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
    # imported here: the solver package pulls in OR-Tools, which the worker loads with its first solve only
    from planner_service.solver.errors import PlanRequestRefused

    return isinstance(exc, PlanRequestRefused)


def give_up(db: Database, plan_id: str, runs: int, exc: BaseException) -> None:
    """A runner stops running the plan's job (it failed `runs` times outside the plan: the database down for
    long): fail the plan with that reason rather than leave it queued or running forever."""
    with db.session() as s:
        res = s.execute(update(PlanRow).where(PlanRow.id == plan_id, PlanRow.status.in_(tuple(PENDING_PLAN_STATUSES)))
                        .values(status=PlanStatus.failed, finished_at=utcnow(),
                                error=f"gave up after {runs} runs of its job: {_describe(exc)}"))
    if res.rowcount == 1:  # type: ignore[attr-defined]
        PLAN_OUTCOMES.labels(PlanStatus.failed).inc()


def _describe(exc: BaseException) -> str:
    return "".join(traceback.format_exception_only(exc)).strip()[:REASON_MAX_CHARS]


def _start(db: Database, plan_id: str, max_attempts: int) -> int | None:
    """Count an attempt and mark the plan running, committed before any input is read; None when there is
    nothing to do (final already, or gone). A plan found running was orphaned by a worker that died (its job
    came back through stalled-job recovery or a restart): after its last allowed attempt it is failed."""
    with db.session() as s:
        row = s.execute(select(PlanRow.status, PlanRow.attempts).where(PlanRow.id == plan_id)).first()
        if row is None or row.status in FINAL_PLAN_STATUSES:
            return None
        if row.status == PlanStatus.running and row.attempts >= max_attempts:
            s.execute(update(PlanRow).where(PlanRow.id == plan_id, PlanRow.status == PlanStatus.running)
                      .values(status=PlanStatus.failed, finished_at=utcnow(),
                              error=f"the worker solving it was lost {row.attempts} times (no heartbeat)"))
            PLAN_OUTCOMES.labels(PlanStatus.failed).inc()
            return None
        attempt = row.attempts + 1
        res = s.execute(update(PlanRow).where(PlanRow.id == plan_id, PlanRow.status == row.status,
                                              PlanRow.attempts == row.attempts)
                        .values(status=PlanStatus.running, attempts=attempt, started_at=utcnow(), finished_at=None))
        return attempt if res.rowcount == 1 else None  # type: ignore[attr-defined]


def _stored_inputs(db: Database, plan_id: str) -> tuple[bytes | None, dict[str, Any]]:
    """The plan's stored trace (gzip bytes; None if gone) and request fields, as stored."""
    with db.session() as s:
        plan = s.get(PlanRow, plan_id)
        assert plan is not None
        payload = s.scalar(select(TraceRow.payload_gzip).where(TraceRow.id == plan.trace_id))
        return payload, {"trace_id": plan.trace_id, "constraints": plan.constraints, "objective": plan.objective,
                         "solver": plan.solver}


def _decode(payload: bytes | None, request: dict[str, Any]) -> tuple[Trace, PlanRequest]:
    if payload is None:
        raise LookupError(f"trace {request['trace_id']} is gone")
    return Trace.model_validate_json(gzip.decompress(payload)), PlanRequest.model_validate(request)


def _record(db: Database, plan_id: str, attempt: int, status: PlanStatus | str, result: dict | None,  # type: ignore[type-arg]
            error: str | None) -> None:
    """Write the outcome of attempt `attempt`, only while the plan is still running that attempt (a worker
    presumed lost that comes back late cannot overwrite the attempt that replaced it)."""
    status = PlanStatus(status)
    with db.session() as s:
        res = s.execute(update(PlanRow).where(PlanRow.id == plan_id, PlanRow.status == PlanStatus.running,
                                              PlanRow.attempts == attempt)
                        .values(status=status, result=result, headline=plan_headline(result), error=error,
                                finished_at=utcnow() if status.final else None))
        if res.rowcount != 1:  # type: ignore[attr-defined]
            log.warning("plan %s moved on past attempt %d; its outcome %s was dropped", plan_id, attempt, status)
            return
    if status.final:
        PLAN_OUTCOMES.labels(status).inc()
