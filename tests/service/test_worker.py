"""Workers claim plans under a lease: expired leases are retried, exhausted ones fail, results are recorded once."""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import update

from client.contract import Constraints, Objective
from planner_service.db.base import utcnow
from planner_service.db.models import PlanRow
from planner_service.db.repositories import PlanRepository, TraceRepository
from planner_service.db.session import Database
from planner_service.jobs.worker import Worker
from planner_service.settings import Settings


def _queue_plan(db: Database, trace) -> str:  # type: ignore[no-untyped-def]
    with db.session() as s:
        row, _ = TraceRepository(s).add(trace)
        return PlanRepository(s).create(row, Constraints(device_memory_bytes=2**34), Objective.min_iteration_time,
                                        "cpsat", "v").id


def _expire(db: Database, plan_id: str) -> None:
    with db.session() as s:
        s.execute(update(PlanRow).where(PlanRow.id == plan_id)
                  .values(lease_expires_at=utcnow() - timedelta(seconds=1)))


def test_worker_solves_a_queued_plan(settings: Settings, trace) -> None:  # type: ignore[no-untyped-def]
    db = Database(settings.database_url)
    plan_id = _queue_plan(db, trace)
    assert Worker(db, settings).run_once() is True
    assert Worker(db, settings).run_once() is False  # nothing left
    with db.session() as s:
        row = PlanRepository(s).get(plan_id)
        assert row is not None and row.status in ("done", "infeasible") and row.result is not None
        assert row.lease_owner is None
    db.dispose()


def test_plan_of_a_dead_worker_is_reclaimed_after_its_lease(settings: Settings, trace) -> None:  # type: ignore[no-untyped-def]
    db = Database(settings.database_url)
    plan_id = _queue_plan(db, trace)
    with db.session() as s:  # a worker claims it, then dies without finishing
        assert PlanRepository(s).claim("dead-worker", 60).id == plan_id  # type: ignore[union-attr]
    assert Worker(db, settings).run_once() is False  # lease still valid: nobody else takes it
    _expire(db, plan_id)
    assert Worker(db, settings).run_once() is True
    with db.session() as s:
        row = PlanRepository(s).get(plan_id)
        assert row is not None and row.status in ("done", "infeasible") and row.attempts == 2
        # the dead worker, if it came back, can no longer overwrite the result
        assert PlanRepository(s).finish(plan_id, "dead-worker", "failed", None, "late") is False
    db.dispose()


def test_plan_is_failed_not_retried_forever(settings: Settings, trace) -> None:  # type: ignore[no-untyped-def]
    db = Database(settings.database_url)
    plan_id = _queue_plan(db, trace)
    for attempt in range(settings.max_attempts):
        with db.session() as s:
            assert PlanRepository(s).claim(f"dying-{attempt}", 60) is not None
        _expire(db, plan_id)
    Worker(db, settings).run_once()
    with db.session() as s:
        row = PlanRepository(s).get(plan_id)
        assert row is not None and row.status == "failed" and "lease expired" in (row.error or "")
    db.dispose()


def test_a_plan_handed_back_for_retry_has_no_finish_time(settings: Settings, trace) -> None:  # type: ignore[no-untyped-def]
    db = Database(settings.database_url)
    plan_id = _queue_plan(db, trace)
    with db.session() as s:
        assert PlanRepository(s).claim("w", 60) is not None
        assert PlanRepository(s).finish(plan_id, "w", "queued", None, "transient") is True
    with db.session() as s:
        row = PlanRepository(s).get(plan_id)
        assert row is not None and row.status == "queued" and row.finished_at is None
    db.dispose()
