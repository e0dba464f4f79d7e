"""Where solve jobs go: procrastinate on PostgreSQL, the in-process pool on SQLite. Both run `tasks.run_plan`."""

from __future__ import annotations

from typing import Protocol

from sqlalchemy.orm import Session

from planner_service.db.session import Database
from planner_service.jobs.engine import EngineWorker, defer_plan
from planner_service.jobs.local import LocalSolver
from planner_service.settings import Settings


class SolveQueue(Protocol):
    def enqueue(self, session: Session, plan_id: str) -> None:
        """Queue the plan's solve job as part of `session`'s transaction (with the plan row, or not at all)."""

    def start(self) -> None:
        """Start this process's solve workers (if any)."""

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop them; running solves get `timeout_s` to finish."""


class EngineQueue:
    """PostgreSQL: jobs in procrastinate's tables; `workers` > 0 also runs a procrastinate worker here."""

    def __init__(self, db: Database, settings: Settings, workers: int) -> None:
        self._worker = EngineWorker(db, settings, workers) if workers else None

    def enqueue(self, session: Session, plan_id: str) -> None:
        defer_plan(session, plan_id)

    def start(self) -> None:
        if self._worker is not None:
            self._worker.start()

    def stop(self, timeout_s: float = 30.0) -> None:
        if self._worker is not None:
            self._worker.stop(timeout_s)


def solve_queue(db: Database, settings: Settings, workers: int) -> SolveQueue:
    if settings.is_sqlite:
        return LocalSolver(db, settings, workers)
    return EngineQueue(db, settings, workers)
