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
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from planner_service.db.migrate import upgrade
from planner_service.embedded import EmbeddedServer, free_port
from planner_service.settings import Settings
from planner_service.solver.synthetic import synthetic_trace

pytestmark = pytest.mark.slow
LIMITS = {"device_memory_bytes": 2**34}


def _cli(*args: str, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "memplan", *args], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _wait_status(url: str, plan_id: str, wanted: set[str], timeout_s: float) -> dict:  # type: ignore[type-arg]
    deadline = time.monotonic() + timeout_s
    while True:
        body = httpx.get(f"{url}/v1/plans/{plan_id}", timeout=10).json()
        if body["status"] in wanted:
            return body  # type: ignore[no-any-return]
        if time.monotonic() > deadline:
            raise AssertionError(f"plan {plan_id} stayed {body['status']}, wanted {wanted}")
        time.sleep(0.1)


def test_plan_of_a_worker_killed_mid_solve_is_finished_by_another(db_url: str) -> None:
    env = {**os.environ, "MEMPLAN_DATABASE_URL": db_url, "MEMPLAN_LEASE_S": "2", "MEMPLAN_POLL_INTERVAL_S": "0.1"}
    settings = Settings(database_url=db_url, workers=0, auto_upgrade=False)
    with EmbeddedServer(settings) as url:  # API only: solving happens in the worker processes
        tid = httpx.post(f"{url}/v1/traces", content=synthetic_trace(n_blocks=3).canonical_json()).json()["id"]
        pid = httpx.post(f"{url}/v1/plans", json={"trace_id": tid, "constraints": LIMITS}).json()["id"]
        doomed = _cli("worker", env={**env, "MEMPLAN_FAULT_SOLVE_DELAY_S": "600"})
        try:
            _wait_status(url, pid, {"running"}, 60)
        finally:
            doomed.send_signal(signal.SIGKILL)
            doomed.wait(10)
        assert httpx.get(f"{url}/v1/plans/{pid}").json()["status"] == "running"  # orphaned, lease still valid
        rescuer = _cli("worker", env=env)
        try:
            done = _wait_status(url, pid, {"done", "infeasible", "failed"}, 60)
        finally:
            rescuer.terminate()
            rescuer.wait(30)
        assert done["status"] in ("done", "infeasible") and done["attempts"] == 2 and done["plan"] is not None


def test_queued_plans_resume_after_a_service_restart(db_url: str) -> None:
    api_only = Settings(database_url=db_url, workers=0, auto_upgrade=False)
    with EmbeddedServer(api_only) as url:
        tid = httpx.post(f"{url}/v1/traces", content=synthetic_trace(n_blocks=2).canonical_json()).json()["id"]
        ids = [httpx.post(f"{url}/v1/plans", json={"trace_id": tid, "solver": solver, "constraints": LIMITS}).json()["id"]
               for solver in ("cpsat", "protrain")]
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
            pytest.fail("PostgreSQL server binaries are required in CI (scripts/ensure_postgres.sh installs them)")
        pytest.skip("PostgreSQL server binaries not installed")
    tmp_path = Path(tempfile.mkdtemp(prefix="memplan-pg-"))  # not under pytest's 0700 root-owned tree
    data = tmp_path / "pgdata"
    run_as: list[str] = []
    if os.geteuid() == 0:  # postgres refuses to run as root
        run_as = ["runuser", "-u", "postgres", "--"]
        tmp_path.chmod(0o777)
    subprocess.run([*run_as, f"{bindir}/initdb", "-D", str(data), "-U", "postgres", "-A", "trust"],
                   check=True, capture_output=True)
    port = free_port()
    ctl = {"bindir": bindir, "data": str(data), "port": str(port), "log": str(tmp_path / "pg.log")}

    def pg(action: str) -> None:
        opts = f"-p {port} -k {tmp_path} -c listen_addresses=127.0.0.1"
        subprocess.run([*run_as, f"{bindir}/pg_ctl", "-D", str(data), "-l", ctl["log"], "-o", opts, "-w", action],
                       check=True, capture_output=True)

    ctl_fns = {"start": lambda: pg("start"), "stop": lambda: pg("stop")}
    pg("start")
    try:
        yield f"postgresql+psycopg://postgres@127.0.0.1:{port}/postgres", ctl_fns  # type: ignore[misc]
    finally:
        subprocess.run([*run_as, f"{bindir}/pg_ctl", "-D", str(data), "-m", "immediate", "stop"], capture_output=True)
        shutil.rmtree(tmp_path, ignore_errors=True)


def test_database_restart_under_load_gives_503_loses_nothing_and_recovers(private_postgres) -> None:  # type: ignore[no-untyped-def]
    url_db, pg = private_postgres
    upgrade(url_db)
    # rate limits off: this test is about the database (4 agents on one address exceed the default budget)
    settings = Settings(database_url=url_db, workers=1, poll_interval_s=0.05, auto_upgrade=False,
                        rate_limit_per_s=1e6, rate_limit_burst=1_000_000)
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
