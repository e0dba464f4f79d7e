"""Solve jobs on the embedded SQLite default: the same task function (`tasks.run_plan`) on a thread pool inside
`memplan serve`. SQLite serves one process, so there is no queue to share: a plan is handed to the pool when
the transaction that creates it commits, and at start every plan left queued or running (by a process that
died) is handed to it again. Retries wait with the same exponential backoff as on PostgreSQL."""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor

from sqlalchemy import event, select
from sqlalchemy.orm import Session, SessionTransaction

from client.contract import PENDING_PLAN_STATUSES
from planner_service.db.models import PlanRow
from planner_service.db.session import Database
from planner_service.jobs.tasks import MAX_RUNS, PlanFailed, give_up, run_plan
from planner_service.settings import Settings

log = logging.getLogger("memplan.worker")


class LocalSolver:
    """`workers` threads running solve tasks; with 0 workers plans stay queued for the next start."""

    def __init__(self, db: Database, settings: Settings, workers: int) -> None:
        self.db, self.settings, self.workers = db, settings, workers
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="memplan-solve") if workers else None
        self._stop = threading.Event()
        self._timers: set[threading.Timer] = set()
        self._lock = threading.Lock()
        self._pending_key = f"memplan.local_solver.{id(self)}.pending"  # session.info: plans to submit

    def start(self) -> None:
        """Hand the pool every unfinished plan, oldest first (queued, or running when the process died)."""
        if self._pool is None:
            return
        with self.db.session() as s:
            ids = list(
                s.scalars(
                    select(PlanRow.id)
                    .where(PlanRow.status.in_(tuple(PENDING_PLAN_STATUSES)))
                    .order_by(PlanRow.created_at)
                )
            )
        for plan_id in ids:
            self.submit(plan_id)

    def enqueue(self, session: Session, plan_id: str) -> None:
        """Run the plan once `session`'s outermost transaction commits (never for a rolled-back plan row).

        The plan ids wait in `session.info` (SQLAlchemy's per-session dictionary for such state); two session
        events, registered once per session, hand them to the pool at the outermost commit or drop them
        when the outermost transaction ends without one (a rollback)."""
        if self._pool is None:
            return
        session.info.setdefault(self._pending_key, []).append(plan_id)
        if not event.contains(session, "after_commit", self._committed):
            event.listen(session, "after_commit", self._committed)
            event.listen(session, "after_transaction_end", self._ended)

    def _committed(self, session: Session) -> None:
        """SQLAlchemy fires `after_commit` for a released savepoint too (`begin_nested`, e.g. the trace
        repository's insert-or-reuse), while the plan row is still uncommitted and invisible to the worker's
        connection: submitted then, the plan was skipped and stayed queued. So only the outermost commit
        submits (during a savepoint release `in_nested_transaction()` is still true; at the outermost commit
        it is false)."""
        if not session.in_nested_transaction():
            for plan_id in session.info.pop(self._pending_key, []):
                self.submit(plan_id)

    def _ended(self, session: Session, transaction: SessionTransaction) -> None:
        """The outermost transaction ended: committed (its plans were submitted just before, `after_commit`
        comes first) or rolled back (its plan rows are gone): nothing is left to submit."""
        if transaction.parent is None:
            session.info.pop(self._pending_key, None)

    def submit(self, plan_id: str, tries: int = 0) -> None:
        if self._pool is not None and not self._stop.is_set():
            try:
                self._pool.submit(self._run, plan_id, tries)
            except RuntimeError:  # shut down meanwhile
                pass

    def _run(self, plan_id: str, tries: int) -> None:
        if self._stop.is_set():
            return
        try:
            run_plan(self.db, self.settings, plan_id, stop=self._stop)
        except PlanFailed:
            log.exception("plan %s failed", plan_id)
        except Exception as exc:
            if tries + 1 >= MAX_RUNS:
                log.exception("plan %s: giving up after %d runs", plan_id, tries + 1)
                try:
                    give_up(self.db, plan_id, tries + 1, exc)
                except Exception:
                    log.exception(
                        "plan %s could not be marked failed; it runs again at the next start", plan_id
                    )
                return
            delay = min(60.0, self.settings.retry_backoff_s * 2**tries)
            log.warning("plan %s will run again in %.1f s", plan_id, delay, exc_info=True)
            self._later(delay, plan_id, tries + 1)

    def _later(self, delay_s: float, plan_id: str, tries: int) -> None:
        def fire() -> None:
            with self._lock:
                self._timers.discard(timer)
            self.submit(plan_id, tries)

        timer = threading.Timer(delay_s, fire)
        timer.daemon = True
        with self._lock:
            if self._stop.is_set():
                return
            self._timers.add(timer)
        timer.start()

    def stop(self, timeout_s: float = 30.0) -> None:
        self._stop.set()
        with self._lock:
            for timer in self._timers:
                timer.cancel()
            self._timers.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
