"""Faults: a worker killed mid-solve, a service restarted with queued plans, a database restarted under load."""

from __future__ import annotations

import glob
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from planner_service.db.migrate import upgrade
from planner_service.embedded import EmbeddedServer, free_port, wait_until_ready
from planner_service.settings import Settings
from planner_service.solver.testing.synthetic import synthetic_trace

pytestmark = pytest.mark.slow
LIMITS = {"device_memory_bytes": 2**34}


def _cli(*args: str, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "memplan", *args],
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


def _wait_status(url: str, plan_id: str, wanted: set[str], timeout_s: float) -> dict:  # type: ignore[type-arg]
    deadline = time.monotonic() + timeout_s
    while True:
        body = httpx.get(f"{url}/v1/plans/{plan_id}", timeout=10).json()
        if body["status"] in wanted:
            return body  # type: ignore[no-any-return]
        if time.monotonic() > deadline:
            raise AssertionError(f"plan {plan_id} stayed {body['status']}, wanted {wanted}")
        time.sleep(0.1)


def _kill(process: subprocess.Popen[str]) -> None:
    process.send_signal(signal.SIGKILL)
    process.wait(10)


def _stop(process: subprocess.Popen[str]) -> None:
    process.terminate()
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        _kill(process)


@pytest.mark.postgres
def test_plan_of_a_worker_killed_mid_solve_is_finished_by_another(postgres_url: str) -> None:
    """PostgreSQL: `memplan worker` (procrastinate) killed -9 mid-solve; its heartbeat stops, stalled-job
    recovery queues the job again and another worker solves the plan (its second attempt)."""
    env = {**os.environ, "MEMPLAN_DATABASE_URL": postgres_url, "MEMPLAN_STALLED_AFTER_S": "2"}
    settings = Settings(database_url=postgres_url, workers=0, auto_upgrade=False)
    with EmbeddedServer(settings) as url:  # API only: solving happens in the worker processes
        tid = httpx.post(f"{url}/v1/traces", content=synthetic_trace(n_blocks=3).canonical_json()).json()[
            "id"
        ]
        pid = httpx.post(f"{url}/v1/plans", json={"trace_id": tid, "constraints": LIMITS}).json()["id"]
        doomed = _cli("worker", env={**env, "MEMPLAN_FAULT_SOLVE_DELAY_S": "600"})
        try:
            _wait_status(url, pid, {"running"}, 60)
        finally:
            _kill(doomed)
        assert httpx.get(f"{url}/v1/plans/{pid}").json()["status"] == "running"  # orphaned
        rescuer = _cli("worker", env=env)
        try:
            done = _wait_status(url, pid, {"done", "infeasible", "failed"}, 60)
        finally:
            _stop(rescuer)
        assert done["status"] in ("done", "infeasible") and done["attempts"] == 2 and done["plan"] is not None


def test_plan_of_a_service_killed_mid_solve_is_finished_after_its_restart(tmp_path: Path) -> None:
    """SQLite: solving runs inside `memplan serve`; killed -9 mid-solve, the next start finishes the plan."""
    db_url = f"sqlite:///{tmp_path / 'memplan.db'}"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "MEMPLAN_DATABASE_URL": db_url, "MEMPLAN_INGEST_PROCESSES": "0"}
    doomed = _cli("serve", "--port", str(port), env={**env, "MEMPLAN_FAULT_SOLVE_DELAY_S": "600"})
    try:
        wait_until_ready(url, doomed)
        tid = httpx.post(f"{url}/v1/traces", content=synthetic_trace(n_blocks=3).canonical_json()).json()[
            "id"
        ]
        pid = httpx.post(f"{url}/v1/plans", json={"trace_id": tid, "constraints": LIMITS}).json()["id"]
        _wait_status(url, pid, {"running"}, 60)
    finally:
        _kill(doomed)
    restarted = _cli("serve", "--port", str(port), env=env)
    try:
        wait_until_ready(url, restarted)
        done = _wait_status(url, pid, {"done", "infeasible", "failed"}, 60)
    finally:
        _stop(restarted)
    assert done["status"] in ("done", "infeasible") and done["attempts"] == 2 and done["plan"] is not None


def test_a_plan_whose_trace_cannot_be_read_fails_alone_and_the_queue_goes_on(
    db_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 17 defect 1: a plan on a stored trace that cannot be read (a valid gzip member, then garbage)
    failed inside the worker's claim, which rolled back: the same plan was claimed again ~5 times a second
    and every later plan of every project stayed queued. Now it fails, with its reason, once; the others
    behind it are solved."""
    from sqlalchemy import update

    from planner_service.auth import create_token
    from planner_service.db.models import TraceRow
    from planner_service.db.session import Database

    db = Database(db_url)
    with db.session() as s:
        tokens = {p: create_token(s, p)[0] for p in ("alpha", "beta", "gamma")}
    auth = {p: {"authorization": f"Bearer {t}"} for p, t in tokens.items()}
    api_only = Settings(database_url=db_url, workers=0, auto_upgrade=False, auth=True, ingest_prestart=False)
    with EmbeddedServer(api_only) as url:  # plans queue up: alpha's poisoned one first, then the others
        bad_trace = httpx.post(
            f"{url}/v1/traces", content=synthetic_trace(n_blocks=2).canonical_json(), headers=auth["alpha"]
        ).json()["id"]
        with db.session() as s:  # what the multi-member upload stored before the ingest side refused it
            good = s.get(TraceRow, bad_trace).payload_gzip  # type: ignore[union-attr]
            s.execute(
                update(TraceRow)
                .where(TraceRow.id == bad_trace)
                .values(payload_gzip=good + b"this member is not gzip")
            )
        bad = httpx.post(
            f"{url}/v1/plans", json={"trace_id": bad_trace, "constraints": LIMITS}, headers=auth["alpha"]
        ).json()["id"]
        others = []
        for i, project in enumerate(("beta", "gamma", "beta", "gamma")):
            tid = httpx.post(
                f"{url}/v1/traces",
                content=synthetic_trace(n_blocks=1 + i).canonical_json(),
                headers=auth[project],
            ).json()["id"]
            others.append(
                (
                    project,
                    httpx.post(
                        f"{url}/v1/plans",
                        json={"trace_id": tid, "constraints": LIMITS},
                        headers=auth[project],
                    ).json()["id"],
                )
            )
    with EmbeddedServer(api_only.model_copy(update={"workers": 1, "poll_interval_s": 0.05})) as url:
        for project, pid in others:
            body = httpx.get(
                f"{url}/v1/plans/{pid}", params={"wait": 60}, headers=auth[project], timeout=70
            ).json()
            assert body["status"] in ("done", "infeasible") and body["plan"] is not None, body
        failed = httpx.get(
            f"{url}/v1/plans/{bad}", params={"wait": 30}, headers=auth["alpha"], timeout=40
        ).json()
        history = httpx.get(f"{url}/v1/plans", params={"status": "failed"}, headers=auth["alpha"]).json()[
            "items"
        ]
    assert failed["status"] == "failed" and failed["attempts"] == 1
    assert "trace cannot be read" in failed["error"] and "BadGzipFile" in failed["error"]
    assert [(p["id"], p["status"], p["error"]) for p in history] == [(bad, "failed", failed["error"])]
    logged = ["".join(traceback.format_exception(*r.exc_info)) for r in caplog.records if r.exc_info]
    assert sum("BadGzipFile" in t for t in logged) == 1  # one traceback, not one per claim
    db.dispose()


def test_queued_plans_resume_after_a_service_restart(db_url: str) -> None:
    api_only = Settings(database_url=db_url, workers=0, auto_upgrade=False)
    with EmbeddedServer(api_only) as url:
        tid = httpx.post(f"{url}/v1/traces", content=synthetic_trace(n_blocks=2).canonical_json()).json()[
            "id"
        ]
        ids = [
            httpx.post(
                f"{url}/v1/plans", json={"trace_id": tid, "solver": solver, "constraints": LIMITS}
            ).json()["id"]
            for solver in ("cpsat", "protrain")
        ]
    # the service went down with both plans queued; it comes back with its worker pool
    with EmbeddedServer(api_only.model_copy(update={"workers": 1, "poll_interval_s": 0.05})) as url:
        for pid in ids:
            assert _wait_status(url, pid, {"done", "infeasible"}, 60)["plan"] is not None


# ------------------------------------------------------------------------------ database restart
def _pg_bin() -> str | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"))
    return str(Path(found[-1]).parent) if found else None


@pytest.fixture
def private_postgres() -> Iterator[tuple[str, dict[str, str]]]:
    """A throw-away PostgreSQL cluster on its own port, so restarting it disturbs nobody else."""
    bindir = _pg_bin()
    if bindir is None:
        if os.environ.get("CI"):
            pytest.fail(
                "PostgreSQL server binaries are required in CI (scripts/ensure_postgres.sh installs them)"
            )
        pytest.skip("PostgreSQL server binaries not installed")
    tmp_path = Path(tempfile.mkdtemp(prefix="memplan-pg-"))  # not under pytest's 0700 root-owned tree
    data = tmp_path / "pgdata"
    run_as: list[str] = []
    if os.geteuid() == 0:  # postgres refuses to run as root
        run_as = ["runuser", "-u", "postgres", "--"]
        tmp_path.chmod(0o777)
    subprocess.run(
        [*run_as, f"{bindir}/initdb", "-D", str(data), "-U", "postgres", "-A", "trust"],
        check=True,
        capture_output=True,
    )
    port = free_port()
    ctl = {"bindir": bindir, "data": str(data), "port": str(port), "log": str(tmp_path / "pg.log")}

    def pg(action: str) -> None:
        opts = f"-p {port} -k {tmp_path} -c listen_addresses=127.0.0.1"
        subprocess.run(
            [*run_as, f"{bindir}/pg_ctl", "-D", str(data), "-l", ctl["log"], "-o", opts, "-w", action],
            check=True,
            capture_output=True,
        )

    ctl_fns = {"start": lambda: pg("start"), "stop": lambda: pg("stop")}
    pg("start")
    try:
        yield f"postgresql+psycopg://postgres@127.0.0.1:{port}/postgres", ctl_fns  # type: ignore[misc]
    finally:
        subprocess.run(
            [*run_as, f"{bindir}/pg_ctl", "-D", str(data), "-m", "immediate", "stop"], capture_output=True
        )
        shutil.rmtree(tmp_path, ignore_errors=True)


def test_database_restart_under_load_gives_503_loses_nothing_and_recovers(private_postgres) -> None:  # type: ignore[no-untyped-def]
    url_db, pg = private_postgres
    upgrade(url_db)
    # rate limits off: this test is about the database (4 agents on one address exceed the default budget)
    settings = Settings(
        database_url=url_db,
        workers=1,
        poll_interval_s=0.05,
        auto_upgrade=False,
        rate_limit_per_s=1e6,
        rate_limit_burst=1_000_000,
    )
    acknowledged: list[str] = []
    statuses: list[int] = []
    stop = threading.Event()
    with EmbeddedServer(settings) as url:

        def agent(seed: int) -> None:
            i = 0
            with httpx.Client(base_url=url, timeout=10) as c:
                while not stop.is_set():
                    i += 1
                    t = synthetic_trace(n_blocks=1 + (i % 5), hidden=64 * (1 + seed), vocab=100 + i)
                    try:
                        r = c.post("/v1/traces", content=t.canonical_json())
                    except httpx.TransportError:
                        continue
                    statuses.append(r.status_code)
                    if r.status_code == 201:
                        acknowledged.append(r.json()["id"])
                    time.sleep(0.01)

        threads = [threading.Thread(target=agent, args=(k,)) for k in range(4)]
        for th in threads:
            th.start()
        time.sleep(1.0)
        pg["stop"]()
        time.sleep(1.5)
        during = len(statuses)
        pg["start"]()
        time.sleep(2.0)
        stop.set()
        for th in threads:
            th.join(30)
        assert 503 in statuses, "requests while the database was down should get 503"
        assert 500 not in statuses
        assert statuses[-1] == 201 and len(statuses) > during, "the service should recover after the restart"
        for trace_id in acknowledged:  # nothing acknowledged was lost
            assert httpx.get(f"{url}/v1/traces/{trace_id}", timeout=10).status_code == 200
        assert httpx.get(f"{url}/readyz", timeout=10).status_code == 200
        # the in-process solve worker lived through the outage (or was started again): plans still get solved
        pid = httpx.post(
            f"{url}/v1/plans", json={"trace_id": acknowledged[-1], "constraints": LIMITS}, timeout=10
        ).json()["id"]
        assert _wait_status(url, pid, {"done", "infeasible", "failed"}, 60)["status"] in (
            "done",
            "infeasible",
        )
