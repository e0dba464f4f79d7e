"""Plan workers: claim queued plans from the database under a lease, solve, record; in threads or a process."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import traceback
import uuid

from client.contract import PlanRequest, SolverStatus
from planner_service.db.repositories import PlanRepository, TraceRepository, decompress_trace
from planner_service.db.session import Database
from planner_service.jobs.tasks import solve_request
from planner_service.observability import PLAN_OUTCOMES, SOLVE_SECONDS
from planner_service.settings import Settings

log = logging.getLogger("memplan.worker")


def worker_identity() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class Worker:
    """One solving loop. `run_once` handles at most one plan; `run_forever` loops until stopped."""

    def __init__(self, db: Database, settings: Settings, *, name: str | None = None) -> None:
        self.db = db
        self.settings = settings
        self.id = name or worker_identity()
        self._stop = threading.Event()

    def stop(self) -> None:
        self._stop.set()

    def run_forever(self) -> None:
        log.info("worker started", extra={"worker": self.id})
        while not self._stop.is_set():
            try:
                did = self.run_once()
            except Exception:  # the database may be down: keep the worker alive and retry
                log.exception("worker loop error; retrying")
                did = False
            if not did:
                self._stop.wait(self.settings.poll_interval_s)
        log.info("worker stopped", extra={"worker": self.id})

    def run_once(self) -> bool:
        with self.db.session() as s:
            PlanRepository(s).fail_exhausted(self.settings.max_attempts)
            row = PlanRepository(s).claim(self.id, self.settings.lease_s)
            if row is None:
                return False
            plan_id = row.id
            trace_row = TraceRepository(s).get(row.trace_id)
            assert trace_row is not None
            trace = decompress_trace(trace_row)
            request = PlanRequest(trace_id=row.trace_id, constraints=row.constraints, objective=row.objective,
                                  solver=row.solver)
        log.info("solving plan", extra={"plan_id": plan_id, "worker": self.id})
        heartbeat = _Heartbeat(self.db, plan_id, self.id, self.settings.lease_s)
        heartbeat.start()
        started = time.perf_counter()
        try:
            if self.settings.fault_solve_delay_s:
                self._stop.wait(self.settings.fault_solve_delay_s)
            plan = solve_request(trace, request)
        except Exception as exc:
            heartbeat.stop()
            self._record_error(plan_id, exc)
            return True
        heartbeat.stop()
        SOLVE_SECONDS.labels(request.solver).observe(time.perf_counter() - started)
        status = "infeasible" if plan.solver.status == SolverStatus.infeasible else "done"
        with self.db.session() as s:
            if not PlanRepository(s).finish(plan_id, self.id, status, plan.model_dump(mode="json"), None):
                log.warning("lost the lease of plan %s before finishing; result dropped", plan_id)
                return True
        PLAN_OUTCOMES.labels(status).inc()
        log.info("plan solved", extra={"plan_id": plan_id, "status": status, "solver": request.solver})
        return True

    def _record_error(self, plan_id: str, exc: Exception) -> None:
        detail = "".join(traceback.format_exception_only(exc)).strip()
        with self.db.session() as s:
            repo = PlanRepository(s)
            row = repo.get(plan_id)
            final = row is not None and row.attempts >= self.settings.max_attempts
            if final or isinstance(exc, ValueError):  # bad requests do not get better by retrying
                repo.finish(plan_id, self.id, "failed", None, detail[:4000])
                PLAN_OUTCOMES.labels("failed").inc()
            else:
                repo.finish(plan_id, self.id, "queued", None, detail[:4000])
        log.warning("plan %s failed: %s", plan_id, detail)


class _Heartbeat:
    """Extends a plan's lease while it is being solved, so a live worker never loses it."""

    def __init__(self, db: Database, plan_id: str, worker_id: str, lease_s: float) -> None:
        self._db, self._plan, self._worker, self._lease = db, plan_id, worker_id, lease_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-{plan_id[:8]}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self._lease / 3):
            try:
                with self._db.session() as s:
                    PlanRepository(s).extend_lease(self._plan, self._worker, self._lease)
            except Exception:
                log.exception("heartbeat failed for plan %s", self._plan)


class WorkerPool:
    """`n` workers on daemon threads: the embedded default inside `memplan serve`."""

    def __init__(self, db: Database, settings: Settings, n: int) -> None:
        self.workers = [Worker(db, settings) for _ in range(n)]
        self.threads = [threading.Thread(target=w.run_forever, name=f"memplan-worker-{i}", daemon=True)
                        for i, w in enumerate(self.workers)]

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def stop(self, timeout_s: float = 30.0) -> None:
        for w in self.workers:
            w.stop()
        for t in self.threads:
            t.join(timeout_s)
