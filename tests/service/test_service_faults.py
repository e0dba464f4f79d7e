"""Faults of the service process on the real `memplan serve`: a frozen database, a killed API.

(Worker faults, a worker killed mid-solve and a database restarted under load, are in test_faults.py.)
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import httpx
import pytest

from client.cli.embedded import free_port, wait_until_ready
from planner_service.db.migrate import upgrade
from planner_service.solver.synthetic import synthetic_trace
from tests.service.conftest import PrivateCluster

pytestmark = pytest.mark.slow


@contextmanager
def serve(database_url: str, **env: str) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    """`memplan serve` on a free loopback port, as a user starts it; stopped (and reaped) at the end."""
    port = free_port()
    environment = {**os.environ, "MEMPLAN_DATABASE_URL": database_url, **env}
    process = subprocess.Popen([sys.executable, "-m", "client.cli", "serve", "--port", str(port), "--log-level",
                                "warning"], env=environment, text=True, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_ready(url, process)
        yield url, process
    finally:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(10)


def test_a_frozen_database_gives_503_within_a_bound_and_the_service_recovers(
        private_postgres_cluster: PrivateCluster) -> None:
    """PostgreSQL stopped with SIGSTOP (connections open, nothing answers): /readyz and requests answer 503
    with Retry-After within a few seconds instead of hanging, and everything works again once it resumes."""
    pg = private_postgres_cluster
    upgrade(pg.url)
    bounds = {"MEMPLAN_DB_CONNECT_TIMEOUT_S": "2", "MEMPLAN_DB_STATEMENT_TIMEOUT_S": "2",
              "MEMPLAN_DB_POOL_TIMEOUT_S": "2", "MEMPLAN_READINESS_TIMEOUT_S": "2", "MEMPLAN_WORKERS": "1",
              "MEMPLAN_RATE_LIMIT_PER_S": "1000000", "MEMPLAN_RATE_LIMIT_BURST": "1000000"}
    with serve(pg.url, **bounds) as (url, _):
        trace_id = httpx.post(f"{url}/v1/traces", content=synthetic_trace(n_blocks=2).canonical_json()).json()["id"]
        requests = [("GET", "/v1/traces", None), ("GET", f"/v1/traces/{trace_id}", None), ("GET", "/v1/plans", None),
                    ("POST", "/v1/plans", {"trace_id": trace_id, "constraints": {"device_memory_bytes": 2**34}}),
                    ("GET", "/v1/models", None)] * 4  # more requests than the pool keeps warm connections for
        with httpx.Client(base_url=url, timeout=60) as c:
            for method, path, body in requests[:5]:
                assert c.request(method, path, json=body).status_code < 300  # warm: pooled connections exist

            def timed(method: str, path: str, body: object) -> tuple[int, float, str | None]:
                t0 = time.monotonic()
                r = c.request(method, path, json=body)
                return r.status_code, time.monotonic() - t0, r.headers.get("retry-after")

            pg.freeze()
            try:
                status, took, retry = timed("GET", "/readyz", None)
                assert status == 503 and retry is not None and took < 5.0, (status, took)
                with ThreadPoolExecutor(len(requests)) as pool:
                    answers = list(pool.map(lambda r: timed(*r), requests))
                # bound: statement timeout 2 s + 2 s grace, then a reconnect's 2 s timeout, plus queueing
                assert all(s == 503 and r is not None for s, _, r in answers), answers
                assert max(t for _, t, _ in answers) < 15.0, answers
                status, took, _ = timed("GET", "/readyz", None)
                assert status == 503 and took < 5.0, (status, took)
            finally:
                pg.thaw()
            deadline = time.monotonic() + 30
            while c.get("/readyz").status_code != 200:
                assert time.monotonic() < deadline, "the service did not become ready after the database resumed"
                time.sleep(0.2)
            for method, path, body in requests[:5]:
                assert c.request(method, path, json=body).status_code < 300
