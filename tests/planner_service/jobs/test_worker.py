"""The solve task on each database: every failure ends on its plan (reason, attempt counted, nothing rolled
back), a lost worker's attempt is taken over and cannot overwrite its successor, attempts are bounded; on
PostgreSQL the job is deferred in the plan's transaction, once per plan, and retried with backoff."""

from __future__ import annotations

import gzip

import pytest
from sqlalchemy import text, update

from client.contract import Constraints, Objective
from planner_service.db.models import PlanRow, TraceRow
from planner_service.db.repositories import PlanRepository, TraceRepository
from planner_service.db.session import Database
from planner_service.jobs import tasks
from planner_service.jobs.tasks import PlanFailed, PlanRetry, run_plan
from planner_service.settings import Settings
from planner_service.solver.errors import PlanRequestRefused


def _queue_plan(db: Database, trace, device_memory: int = 2**34) -> str:  # type: ignore[no-untyped-def]
    """A queued plan of `trace` (one pending plan per request: two at once need two limits)."""
    with db.session() as s:
        row, _ = TraceRepository(s).add(trace)
        return (
            PlanRepository(s)
            .create(
                row,
                Constraints(device_memory_bytes=device_memory),
                Objective.min_iteration_time,
                "cpsat",
                "v",
            )
            .id
        )


def _row(db: Database, plan_id: str) -> PlanRow:
    with db.session() as s:
        row = PlanRepository(s).get(plan_id)
        assert row is not None
        _ = row.result  # deferred column: load it before the session closes
        s.expunge(row)
        return row


def poison_trace(db: Database, plan_id: str) -> None:
    """The issue-17 upload as stored before the ingest fix: a valid gzip member, then garbage."""
    with db.session() as s:
        trace_id = s.get(PlanRow, plan_id).trace_id  # type: ignore[union-attr]
        good = s.get(TraceRow, trace_id).payload_gzip  # type: ignore[union-attr]
        s.execute(
            update(TraceRow)
            .where(TraceRow.id == trace_id)
            .values(payload_gzip=good + b"this member is not gzip")
        )


def test_a_plan_is_solved_once_and_a_second_run_changes_nothing(settings: Settings, trace) -> None:  # type: ignore[no-untyped-def]
    db = Database(settings.database_url)
    plan_id = _queue_plan(db, trace)
    assert run_plan(db, settings, plan_id) in ("done", "infeasible")
    assert run_plan(db, settings, plan_id) == "skipped"  # a duplicated job finds the plan final
    row = _row(db, plan_id)
    assert row.status in ("done", "infeasible") and row.result is not None and row.attempts == 1
    assert row.started_at is not None and row.finished_at is not None and row.error is None
    db.dispose()


def test_an_unreadable_trace_fails_its_plan_with_the_reason_and_counts_the_attempt(
    settings: Settings, trace
) -> None:  # type: ignore[no-untyped-def]
    """Issue 17 defect 1: reading the trace failed inside the claim transaction, which rolled back (attempts
    stayed 0, the plan stayed queued and was claimed again forever)."""
    db = Database(settings.database_url)
    plan_id = _queue_plan(db, trace)
    poison_trace(db, plan_id)
    with pytest.raises(PlanFailed) as raised:
        run_plan(db, settings, plan_id)
    assert isinstance(raised.value.__cause__, gzip.BadGzipFile)
    row = _row(db, plan_id)
    assert row.status == "failed" and row.attempts == 1 and row.finished_at is not None
    assert row.error is not None and "trace cannot be read" in row.error and "BadGzipFile" in row.error
    assert run_plan(db, settings, plan_id) == "skipped"
    db.dispose()


def test_a_solver_bug_is_retried_then_fails_the_plan_after_its_last_attempt(
    settings: Settings, trace, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    db = Database(settings.database_url)
    plan_id = _queue_plan(db, trace)

    def broken_solver(*_a, **_k):  # type: ignore[no-untyped-def]  # FAULT INJECTION: a bug in the solver
        raise ZeroDivisionError("a solver bug")

    monkeypatch.setattr(tasks, "solve_request", broken_solver)
    for attempt in range(1, settings.max_attempts):
        with pytest.raises(PlanRetry):
            run_plan(db, settings, plan_id)
        row = _row(db, plan_id)  # handed back with its reason, no finish time
        assert (row.status, row.attempts, row.finished_at) == ("queued", attempt, None)
        assert "ZeroDivisionError: a solver bug" in (row.error or "")
    with pytest.raises(PlanFailed):
        run_plan(db, settings, plan_id)
    row = _row(db, plan_id)
    assert (row.status, row.attempts) == ("failed", settings.max_attempts) and "a solver bug" in (
        row.error or ""
    )
    db.dispose()


def test_a_request_the_solver_refuses_fails_at_once(
    settings: Settings, trace, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    db = Database(settings.database_url)
    plan_id = _queue_plan(db, trace)

    def refuse(*_a, **_k):  # type: ignore[no-untyped-def]
        raise PlanRequestRefused("constraints.device_memory_bytes: below the model's parameters")

    monkeypatch.setattr(tasks, "solve_request", refuse)
    with pytest.raises(PlanFailed):
        run_plan(db, settings, plan_id)
    row = _row(db, plan_id)
    assert (row.status, row.attempts) == ("failed", 1) and "device_memory_bytes" in (row.error or "")
    assert "the solver refused the request" in (row.error or "")
    db.dispose()


def test_a_value_error_from_the_solvers_own_code_is_a_bug_not_a_bad_request(
    settings: Settings, trace, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    """Issue 18: the worker labelled every ValueError a bad request and failed the plan at once. A ValueError
    raised inside the solver (here a real one: numpy asked for the max of nothing) is a bug: it gets its
    remaining attempts, its reason does not blame the request, and the exception chain keeps its traceback for
    the runner's log."""
    import numpy as np

    db = Database(settings.database_url)
    plan_id = _queue_plan(db, trace)

    def buggy_solver(*_a, **_k):  # type: ignore[no-untyped-def]  # FAULT INJECTION: a bug in the solver
        return np.max(np.array([]))  # ValueError: zero-size array to reduction operation maximum

    monkeypatch.setattr(tasks, "solve_request", buggy_solver)
    with pytest.raises(PlanRetry) as raised:
        run_plan(db, settings, plan_id)
    assert isinstance(raised.value.__cause__, ValueError) and raised.value.__cause__.__traceback__ is not None
    row = _row(db, plan_id)
    assert (row.status, row.attempts, row.finished_at) == ("queued", 1, None)
    assert "zero-size array" in (row.error or "") and "refused" not in (row.error or "")
    db.dispose()


def test_the_runner_logs_the_traceback_of_a_value_error_from_the_solver(
    settings: Settings, trace, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:  # type: ignore[no-untyped-def]
    """The in-process pool's log line for a solver bug carries the traceback down to the line that raised."""
    import logging

    import numpy as np

    from planner_service.jobs.local import LocalSolver

    db = Database(settings.database_url)
    plan_id = _queue_plan(db, trace)

    def buggy_solver(*_a, **_k):  # type: ignore[no-untyped-def]  # FAULT INJECTION: a bug in the solver
        return np.max(np.array([]))

    monkeypatch.setattr(tasks, "solve_request", buggy_solver)
    pool = LocalSolver(db, settings, workers=0)  # no pool: the retry it schedules never runs
    with caplog.at_level(logging.WARNING, logger="memplan.worker"):
        pool._run(plan_id, 0)
    pool.stop()
    logged = [r for r in caplog.records if r.exc_info]
    assert logged, [r.getMessage() for r in caplog.records]
    text = logging.Formatter().formatException(logged[0].exc_info)  # type: ignore[arg-type]
    assert "zero-size array" in text and "buggy_solver" in text and "PlanRetry" in text
    db.dispose()


def test_the_solver_refuses_an_unknown_solver_with_its_own_error(trace) -> None:  # type: ignore[no-untyped-def]
    from planner_service.solver import PlanRequestRefused as Refused
    from planner_service.solver import solve

    with pytest.raises(Refused, match="solver: unknown 'simplex'"):
        solve(trace, Constraints(device_memory_bytes=2**34), solver="simplex")


def test_the_plan_of_a_lost_worker_is_taken_over_and_the_late_worker_cannot_overwrite_it(
    settings: Settings, trace
) -> None:  # type: ignore[no-untyped-def]
    db = Database(settings.database_url)
    plan_id = _queue_plan(db, trace)
    assert tasks._start(db, plan_id, settings.max_attempts) == 1  # a worker starts it, then is lost
    assert run_plan(db, settings, plan_id) in ("done", "infeasible")  # its job came back: attempt 2
    row = _row(db, plan_id)
    assert row.attempts == 2 and row.result is not None
    tasks._record(db, plan_id, 1, "failed", None, "late")  # the lost worker comes back: dropped
    assert _row(db, plan_id).status in ("done", "infeasible")
    db.dispose()


def test_a_plan_whose_worker_was_lost_on_its_last_attempt_is_failed(settings: Settings, trace) -> None:  # type: ignore[no-untyped-def]
    db = Database(settings.database_url)
    plan_id = _queue_plan(db, trace)
    for _ in range(settings.max_attempts):
        assert tasks._start(db, plan_id, settings.max_attempts) is not None  # started, worker lost each time
    assert run_plan(db, settings, plan_id) == "skipped"
    row = _row(db, plan_id)
    assert row.status == "failed" and "lost 3 times" in (row.error or "") and row.finished_at is not None
    db.dispose()


# ------------------------------------------------------------------------------- procrastinate (PostgreSQL)
@pytest.mark.postgres
def test_the_job_is_deferred_in_the_plans_transaction_once_per_plan(postgres_url: str, trace) -> None:  # type: ignore[no-untyped-def]
    from sqlalchemy.exc import IntegrityError

    from planner_service.jobs.engine import QUEUE, SOLVE_TASK, defer_plan

    db = Database(postgres_url)
    jobs = text(
        "SELECT task_name, queue_name, queueing_lock, lock, args->>'plan_id', status FROM procrastinate_jobs"
    )
    with pytest.raises(RuntimeError), db.session() as s:  # the request fails after deferring: neither stays
        row, _ = TraceRepository(s).add(trace)
        plan = PlanRepository(s).create(
            row, Constraints(device_memory_bytes=2**34), Objective.min_iteration_time, "cpsat", "v"
        )
        defer_plan(s, plan.id)
        raise RuntimeError("the request failed later")
    with db.session() as s:
        assert s.execute(jobs).all() == [] and s.scalar(text("SELECT count(*) FROM plan")) == 0
    plan_id = _queue_plan(db, trace)
    with db.session() as s:
        defer_plan(s, plan_id)
    with db.session() as s:
        assert s.execute(jobs).all() == [
            (SOLVE_TASK, QUEUE, f"plan:{plan_id}", f"plan:{plan_id}", plan_id, "todo")
        ]
    with pytest.raises(IntegrityError), db.session() as s:  # the queueing lock: one waiting job per plan
        defer_plan(s, plan_id)
    db.dispose()


def test_retry_strategy_never_retries_a_failed_plan_and_backs_off_otherwise() -> None:
    from procrastinate.jobs import Job

    from planner_service.jobs.engine import PlanRetryStrategy
    from planner_service.jobs.tasks import MAX_RUNS

    strategy = PlanRetryStrategy(base_s=1.0, cap_s=60.0)

    def job(attempts: int) -> Job:
        return Job(id=1, queue="solve", lock=None, queueing_lock=None, task_name="t", attempts=attempts)

    assert strategy.get_retry_decision(exception=PlanFailed("x"), job=job(0)) is None
    waits = []
    for attempts in range(4):
        decision = strategy.get_retry_decision(exception=PlanRetry("x"), job=job(attempts))
        assert decision is not None and decision.retry_at is not None
        waits.append(decision.retry_at)
    assert waits[0] < waits[1] < waits[2] < waits[3]  # 1, 2, 4, 8 s from now
    assert strategy.get_retry_decision(exception=OSError("db down"), job=job(MAX_RUNS - 1)) is None


@pytest.mark.postgres
def test_procrastinates_schema_is_applied_and_removed_by_alembic(postgres_url: str) -> None:
    from planner_service.db.migrate import downgrade, upgrade

    objects = text(
        "SELECT (SELECT count(*) FROM pg_class WHERE relname LIKE 'procrastinate%'), "
        "(SELECT count(*) FROM pg_proc WHERE proname LIKE 'procrastinate%'), "
        "(SELECT count(*) FROM pg_type WHERE typname LIKE 'procrastinate%')"
    )
    db = Database(postgres_url)
    with db.session() as s:
        tables, functions, types = s.execute(objects).one()
        assert tables >= 4 and functions >= 10 and types >= 3
        level = s.scalar(text("SELECT obj_description('procrastinate_jobs'::regclass, 'pg_class')"))
        assert (
            level == "memplan: procrastinate schema level 03.04.00_50_post_add_retry_failed_job_procedure.sql"
        )
    downgrade(postgres_url, "0004")
    with db.session() as s:
        assert tuple(s.execute(objects).one()) == (0, 0, 0)
    upgrade(postgres_url)
    with db.session() as s:
        assert tuple(s.execute(objects).one()) == (tables, functions, types)
    db.dispose()


@pytest.mark.postgres
def test_procrastinates_own_cli_runs_the_solve_jobs(postgres_url: str, trace) -> None:  # type: ignore[no-untyped-def]
    """Operators' tool: `procrastinate --app=planner_service.jobs.engine.app worker` on MEMPLAN_DATABASE_URL."""
    import os
    import subprocess
    import sys

    from fastapi.testclient import TestClient

    from planner_service.app import create_app

    settings = Settings(database_url=postgres_url, workers=0, auto_upgrade=False, ingest_prestart=False)
    with TestClient(create_app(settings)) as api:  # API only: the plan and its job are queued
        trace_id = api.post("/v1/traces", content=trace.canonical_json()).json()["id"]
        plan_id = api.post(
            "/v1/plans", json={"trace_id": trace_id, "constraints": {"device_memory_bytes": 2**34}}
        ).json()["id"]
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "procrastinate",
            "--app=planner_service.jobs.engine.app",
            "worker",
            "--one-shot",
        ],
        env={**os.environ, "MEMPLAN_DATABASE_URL": postgres_url},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    db = Database(postgres_url)
    row = _row(db, plan_id)
    assert row.status in ("done", "infeasible") and row.attempts == 1 and row.result is not None
    db.dispose()


def test_a_failed_attempt_is_run_again_by_the_real_worker_after_a_backoff(
    settings: Settings, trace, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    """Through the service's own runner (procrastinate's retry on PostgreSQL, the pool's timer on SQLite)."""
    from fastapi.testclient import TestClient

    from planner_service.app import create_app

    real = tasks.solve_request
    calls: list[int] = []

    def flaky(*args, **kwargs):  # type: ignore[no-untyped-def]  # FAULT INJECTION: fails its first call
        calls.append(1)
        if len(calls) == 1:
            raise ConnectionResetError("a transient fault")
        return real(*args, **kwargs)

    monkeypatch.setattr(tasks, "solve_request", flaky)
    with TestClient(create_app(settings.model_copy(update={"retry_backoff_s": 0.2}))) as api:
        trace_id = api.post("/v1/traces", content=trace.canonical_json()).json()["id"]
        plan_id = api.post(
            "/v1/plans", json={"trace_id": trace_id, "constraints": {"device_memory_bytes": 2**34}}
        ).json()["id"]
        body = api.get(f"/v1/plans/{plan_id}", params={"wait": 30}).json()
    assert body["status"] in ("done", "infeasible") and body["attempts"] == 2 and len(calls) == 2


def test_memplan_worker_on_sqlite_says_solving_runs_in_serve(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import os
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "memplan", "worker"],
        capture_output=True,
        text=True,
        env={**os.environ, "MEMPLAN_DATABASE_URL": f"sqlite:///{tmp_path / 'm.db'}"},
        timeout=60,
    )
    assert done.returncode == 2 and "needs PostgreSQL" in done.stderr and "memplan serve" in done.stderr


def test_a_database_error_while_reading_the_inputs_is_retried_not_recorded_as_the_plans_fault(
    settings: Settings, trace, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    from sqlalchemy.exc import OperationalError

    db = Database(settings.database_url)
    plan_id = _queue_plan(db, trace)
    real = tasks._stored_inputs

    def database_gone(*_a, **_k):  # type: ignore[no-untyped-def]  # FAULT INJECTION: the database drops out
        raise OperationalError("SELECT ...", {}, ConnectionResetError("server closed the connection"))

    monkeypatch.setattr(tasks, "_stored_inputs", database_gone)
    with pytest.raises(OperationalError):
        run_plan(db, settings, plan_id)
    assert (_row(db, plan_id).status, _row(db, plan_id).attempts) == ("running", 1)  # the runner retries it
    monkeypatch.setattr(tasks, "_stored_inputs", real)
    assert run_plan(db, settings, plan_id) in ("done", "infeasible")
    assert _row(db, plan_id).attempts == 2
    db.dispose()


def test_a_plan_whose_job_a_runner_gives_up_on_is_failed_with_the_reason(settings: Settings, trace) -> None:  # type: ignore[no-untyped-def]
    db = Database(settings.database_url)
    plan_id, solved_id = _queue_plan(db, trace), _queue_plan(db, trace, device_memory=2**35)
    run_plan(db, settings, solved_id)
    for pid in (plan_id, solved_id):
        tasks.give_up(db, pid, 10, ConnectionRefusedError("database unreachable"))
    row = _row(db, plan_id)
    assert row.status == "failed" and row.finished_at is not None
    assert row.error == "gave up after 10 runs of its job: ConnectionRefusedError: database unreachable"
    assert _row(db, solved_id).status in ("done", "infeasible")  # a finished plan is left as it is
    db.dispose()


def test_a_plan_enqueued_before_a_savepoint_is_solved_after_its_transaction_commits(
    tmp_path,
    trace,  # type: ignore[no-untyped-def]
) -> None:
    """SQLAlchemy fires `after_commit` when a savepoint is released too: the embedded pool used to get the plan
    then, before its row was committed, skip it, and leave it queued for ever (a sweep stuck at 1 of 64)."""
    import time

    from planner_service.db.migrate import upgrade
    from planner_service.jobs.local import LocalSolver
    from planner_service.solver.testing.synthetic import synthetic_trace

    url = f"sqlite:///{tmp_path / 'memplan.db'}"  # the in-process pool serves the embedded SQLite database
    upgrade(url)
    settings = Settings(database_url=url, workers=1, auto_upgrade=False, ingest_prestart=False)
    db = Database(url)
    pool = LocalSolver(db, settings, workers=1)
    try:
        with db.session() as s:
            row, _ = TraceRepository(s).add(trace)
            plan = PlanRepository(s).create(
                row, Constraints(device_memory_bytes=2**34), Objective.min_iteration_time, "cpsat", "v"
            )
            plan_id = plan.id
            pool.enqueue(s, plan_id)
            TraceRepository(s).add(synthetic_trace(n_blocks=3))  # a savepoint released before the commit
            time.sleep(0.5)  # with the defect the pool has already run (and skipped) the invisible plan
        deadline = time.monotonic() + 60
        while _row(db, plan_id).status not in ("done", "infeasible", "failed"):
            assert time.monotonic() < deadline, "the plan was never solved: it stayed queued"
            time.sleep(0.1)
        assert _row(db, plan_id).status in ("done", "infeasible")
    finally:
        pool.stop()
        db.dispose()


def test_the_embedded_pool_gets_each_committed_plan_once_and_never_a_rolled_back_one(
    tmp_path,
    trace,  # type: ignore[no-untyped-def]
) -> None:
    """One session, several transactions (`LocalSolver.enqueue` keeps the plans in `session.info` until the
    outermost transaction ends): a committed plan is handed to the pool once, after its commit and not at a
    savepoint's release; a rolled-back one never."""
    from planner_service.db.migrate import upgrade
    from planner_service.jobs.local import LocalSolver

    url = f"sqlite:///{tmp_path / 'memplan.db'}"
    upgrade(url)
    settings = Settings(database_url=url, workers=1, auto_upgrade=False, ingest_prestart=False)
    db = Database(url)
    pool = LocalSolver(db, settings, workers=1)
    handed: list[str] = []
    pool.submit = lambda plan_id, tries=0: handed.append(plan_id)  # type: ignore[method-assign]

    made = [0]

    def new_plan(s) -> str:  # type: ignore[no-untyped-def]
        made[0] += 1  # another limit each: one pending plan per request
        row, _ = TraceRepository(s).add(trace)
        plan = PlanRepository(s).create(
            row, Constraints(device_memory_bytes=2**34 + made[0]), Objective.min_iteration_time, "cpsat", "v"
        )
        pool.enqueue(s, plan.id)
        return plan.id

    s = db._factory()
    try:
        first = new_plan(s)
        with s.begin_nested():  # a savepoint released before the outermost commit
            s.execute(text("SELECT 1"))
        assert handed == []
        s.commit()
        assert handed == [first]
        new_plan(s)
        s.rollback()
        assert handed == [first]
        second, third = new_plan(s), new_plan(s)
        s.commit()
        assert handed == [first, second, third]
        s.commit()  # nothing new: nothing handed again
        assert handed == [first, second, third]
    finally:
        s.close()
        pool.stop()
        db.dispose()
