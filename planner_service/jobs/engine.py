"""Solve jobs on PostgreSQL run on procrastinate: one job per plan, deferred in the transaction that creates the
plan row (`defer_plan`), a queueing lock per plan (one waiting job per plan) and a lock per plan (one running),
retries with backoff (`PlanRetryStrategy`), and stalled-job recovery from worker heartbeats (the periodic
`memplan.recover_stalled` task). The plan row stays the record users see; procrastinate's tables are the queue.

Operators can use procrastinate's own CLI on the app below (the database from MEMPLAN_DATABASE_URL):

    procrastinate --app=planner_service.jobs.engine.app worker --queue solve
    procrastinate --app=planner_service.jobs.engine.app shell      # list jobs, retry or cancel one
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import threading
import time
from typing import Any

import procrastinate
from procrastinate import BaseRetryStrategy, JobContext, RetryDecision
from procrastinate.jobs import Job
from procrastinate.worker import Worker
from sqlalchemy import make_url, text
from sqlalchemy.orm import Session

from planner_service.db.session import Database
from planner_service.jobs.tasks import MAX_RUNS, PlanFailed, PlanRetry, give_up, run_plan
from planner_service.settings import Settings

log = logging.getLogger("memplan.worker")

QUEUE = "solve"
SOLVE_TASK = "memplan.solve_plan"
RECOVER_TASK = "memplan.recover_stalled"
RECOVER_CRON = "* * * * * */5"  # every 5 s (croniter's sixth field is seconds)


def libpq_url(database_url: str) -> str:
    """The libpq connection string of a SQLAlchemy PostgreSQL URL (procrastinate speaks psycopg directly)."""
    url = make_url(database_url)
    if url.get_backend_name() != "postgresql":
        raise ValueError(
            f"MEMPLAN_DATABASE_URL: procrastinate needs PostgreSQL, got {url.get_backend_name()!r}"
        )
    return url.set(drivername="postgresql").render_as_string(hide_password=False)


class PlanRetryStrategy(BaseRetryStrategy):
    """A plan recorded as failed is never retried; anything else is, with exponential backoff. The plan's own
    attempt limit (`Settings.max_attempts`) is enforced by the task on the plan row."""

    def __init__(self, base_s: float = 1.0, cap_s: float = 60.0) -> None:
        self.base_s, self.cap_s = base_s, cap_s

    def get_retry_decision(self, *, exception: BaseException, job: Job) -> RetryDecision | None:
        if isinstance(exception, PlanFailed) or job.attempts + 1 >= MAX_RUNS:
            return None
        return RetryDecision(retry_in={"seconds": min(self.cap_s, self.base_s * 2**job.attempts)})


# ------------------------------------------------------------------------------------------ enqueue
_DEFER = text(
    "SELECT procrastinate_defer_jobs_v1(ARRAY[ROW(:queue, :task, 0, :lock, :queueing_lock, "
    "CAST(:args AS jsonb), NULL)::procrastinate_job_to_defer_v1])"
)


def defer_plan(session: Session, plan_id: str) -> None:
    """Queue the plan's solve job inside the caller's transaction: committed with the plan row, or not at all."""
    session.execute(
        _DEFER,
        {
            "queue": QUEUE,
            "task": SOLVE_TASK,
            "lock": f"plan:{plan_id}",
            "queueing_lock": f"plan:{plan_id}",
            "args": json.dumps({"plan_id": plan_id}),
        },
    )


# ------------------------------------------------------------------------------------------ the app
_fallback: tuple[Database, Settings] | None = None
_fallback_lock = threading.Lock()


def _resources(context: JobContext) -> tuple[Database, Settings]:
    """The database and settings the worker was started with; a bare `procrastinate worker` (no context)
    makes its own from the environment, once per process."""
    global _fallback
    extra = context.additional_context
    if "db" in extra:
        return extra["db"], extra["settings"]
    with _fallback_lock:
        if _fallback is None:
            settings = Settings()
            if not settings.database_url.startswith("postgresql"):
                raise RuntimeError(
                    "MEMPLAN_DATABASE_URL must name the service's PostgreSQL database "
                    f"(got {make_url(settings.database_url).render_as_string(hide_password=True)})"
                )
            _fallback = (Database(settings.database_url, pool_size=4), settings)
        return _fallback


def worker_options(settings: Settings) -> dict[str, Any]:
    """Every worker's options, ours and `procrastinate worker`'s alike: operators' workers beat, recover and
    are recovered like the service's."""
    return {
        "queues": [QUEUE],
        "delete_jobs": "successful",
        "update_heartbeat_interval": settings.stalled_after_s / 4,
        "stalled_worker_timeout": settings.stalled_after_s,
        "fetch_job_polling_interval": max(settings.poll_interval_s, 0.05),
    }


def build_app(
    database_url: str, settings: Settings | None = None, *, concurrency: int = 1
) -> procrastinate.App:
    """A procrastinate app on `database_url` with the solve and recovery tasks. One app per runner: apps on
    different databases (tests, several services in one process) share nothing. Its pool holds a connection
    for LISTEN, one for heartbeats and fetches, and one per job finishing at once."""
    settings = settings or Settings()
    app = procrastinate.App(
        connector=procrastinate.PsycopgConnector(
            conninfo=libpq_url(database_url) if database_url else "",
            min_size=1,
            max_size=max(4, concurrency + 2),
        ),
        worker_defaults=worker_options(settings),  # type: ignore[arg-type]  # `procrastinate worker` uses them
    )

    @app.task(
        name=SOLVE_TASK, queue=QUEUE, pass_context=True, retry=PlanRetryStrategy(settings.retry_backoff_s)
    )
    def solve_plan(context: JobContext, plan_id: str) -> str:
        db, task_settings = _resources(context)
        try:
            return run_plan(db, task_settings, plan_id, stop=context.additional_context.get("stop"))
        except (PlanFailed, PlanRetry):
            raise
        except Exception as exc:  # outside the plan (the database): retried, up to the last run
            runs = (context.job.attempts if context.job else 0) + 1
            if runs >= MAX_RUNS:
                give_up(db, plan_id, runs, exc)
                raise PlanFailed(f"plan {plan_id}: gave up after {runs} runs") from exc
            raise

    @app.periodic(cron=RECOVER_CRON, periodic_id="recover")
    @app.task(name=RECOVER_TASK, queue=QUEUE, queueing_lock=RECOVER_TASK, pass_context=True)
    async def recover_stalled(context: JobContext, timestamp: int) -> int:
        """Jobs left running by a worker whose heartbeat stopped (killed, frozen, its host gone) go back to the
        queue; the next run of the solve task counts the attempt on the plan row."""
        _, task_settings = _resources(context)
        manager = context.app.job_manager
        stalled = list(
            await manager.get_stalled_jobs(
                task_name=SOLVE_TASK, seconds_since_heartbeat=task_settings.stalled_after_s
            )
        )
        for job in stalled:
            try:
                await manager.retry_job(job)
            except Exception:  # it finished (or another worker recovered it) since it was listed
                log.warning("stalled job %s could not be queued again", job.id, exc_info=True)
                continue
            log.warning("job %s (%s) lost its worker; queued again", job.id, job.task_kwargs)
        return len(stalled)

    return app


def _env_app() -> procrastinate.App:
    url = os.environ.get("MEMPLAN_DATABASE_URL", "")
    return build_app(url if url.startswith("postgresql") else "")


app = _env_app()  # for `procrastinate --app=planner_service.jobs.engine.app ...`


# ------------------------------------------------------------------------------------------ runner
class EngineWorker:
    """A procrastinate worker solving `concurrency` plans at once, in the foreground (`memplan worker`) or on
    a thread of the API process (`memplan serve --workers N` on PostgreSQL)."""

    def __init__(self, db: Database, settings: Settings, concurrency: int, *, name: str = "memplan") -> None:
        self.db, self.settings, self.concurrency, self.name = db, settings, concurrency, name
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[Any] | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._ready = threading.Event()

    async def run_async(self, *, wait: bool = True, install_signal_handlers: bool = False) -> None:
        app = build_app(self.db.url, self.settings, concurrency=self.concurrency)
        async with app.open_async():
            worker = Worker(
                app,
                concurrency=self.concurrency,
                name=self.name,
                wait=wait,
                install_signal_handlers=install_signal_handlers,
                additional_context={"db": self.db, "settings": self.settings, "stop": self._stop},
                **worker_options(self.settings),
            )
            self._loop, self._task = asyncio.get_running_loop(), asyncio.current_task()
            self._ready.set()
            if self._stop.is_set():
                return
            try:
                await worker.run()
            except asyncio.CancelledError:
                pass

    def run(self, *, wait: bool = True) -> None:
        """In the foreground until SIGINT/SIGTERM (running solves finish first); `wait=False`: until the queue
        is empty."""
        if not wait:
            asyncio.run(self.run_async(wait=False))
            return
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: self._request_stop())
        self._serve()

    def start(self) -> None:
        """On a thread of this process."""
        self._thread = threading.Thread(target=self._serve, name="memplan-solve-worker", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        """Run the worker until asked to stop. Procrastinate stops a worker whose database connection fails
        (it leaves restarting to a supervisor): this is that supervisor, with backoff."""
        delay = 1.0
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                asyncio.run(self.run_async())
            except Exception:
                log.exception("solve worker stopped on an error; starting it again in %.0f s", delay)
            else:
                if self._stop.is_set():
                    break
                log.warning(
                    "solve worker stopped (its database connection failed); starting it again in %.0f s",
                    delay,
                )
            self._ready.set()
            if time.monotonic() - started > 60:
                delay = 1.0
            self._stop.wait(delay)
            delay = min(30.0, delay * 2)
        self._ready.set()

    def _request_stop(self) -> None:
        self._stop.set()
        loop, task = self._loop, self._task
        if loop is not None and task is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(task.cancel)
            except RuntimeError:  # the loop finished meanwhile
                pass

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop fetching; running solves get `timeout_s` to finish (a fault-injected delay is cut short)."""
        self._stop.set()
        self._ready.wait(timeout_s)
        self._request_stop()
        if self._thread is not None:
            self._thread.join(timeout_s)
