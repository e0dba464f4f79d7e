"""Faults of the service process on the real `memplan serve`: a frozen database, a killed API.

(Worker faults, a worker killed mid-solve and a database restarted under load, are in test_faults.py.)
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from planner_service.db.migrate import upgrade
from planner_service.embedded import free_port, wait_until_ready
from planner_service.solver.testing.synthetic import synthetic_trace
from tests.planner_service.conftest import PrivateCluster

pytestmark = pytest.mark.slow


@contextmanager
def serve(database_url: str, *args: str, **env: str) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    """`memplan serve ARGS` on a free loopback port, as a user starts it; stopped (and reaped) at the end."""
    port = free_port()
    environment = {**os.environ, "MEMPLAN_DATABASE_URL": database_url, **env}
    process = subprocess.Popen(
        [sys.executable, "-m", "memplan", "serve", "--port", str(port), "--log-level", "warning", *args],
        env=environment,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
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
    private_postgres_cluster: PrivateCluster,
) -> None:
    """PostgreSQL stopped with SIGSTOP (connections open, nothing answers): /readyz and requests answer 503
    with Retry-After within a few seconds instead of hanging, and everything works again once it resumes."""
    pg = private_postgres_cluster
    upgrade(pg.url)
    bounds = {
        "MEMPLAN_DB_CONNECT_TIMEOUT_S": "2",
        "MEMPLAN_DB_STATEMENT_TIMEOUT_S": "2",
        "MEMPLAN_DB_POOL_TIMEOUT_S": "2",
        "MEMPLAN_READINESS_TIMEOUT_S": "2",
        "MEMPLAN_WORKERS": "1",
        "MEMPLAN_RATE_LIMIT_PER_S": "1000000",
        "MEMPLAN_RATE_LIMIT_BURST": "1000000",
    }
    with serve(pg.url, **bounds) as (url, _):
        trace_id = httpx.post(
            f"{url}/v1/traces", content=synthetic_trace(n_blocks=2).canonical_json()
        ).json()["id"]
        requests = [
            ("GET", "/v1/traces", None),
            ("GET", f"/v1/traces/{trace_id}", None),
            ("GET", "/v1/plans", None),
            ("POST", "/v1/plans", {"trace_id": trace_id, "constraints": {"device_memory_bytes": 2**34}}),
            ("GET", "/v1/models", None),
        ] * 4  # more requests than the pool keeps warm connections for
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
                status, took_again, _ = timed("GET", "/readyz", None)
                assert status == 503 and took_again < 5.0, (status, took_again)
                print(
                    f"frozen: /readyz 503 in {took:.1f} s; {len(answers)} requests 503 in "
                    f"{min(t for _, t, _ in answers):.1f}-{max(t for _, t, _ in answers):.1f} s"
                )
            finally:
                pg.thaw()
            deadline = time.monotonic() + 30
            while c.get("/readyz").status_code != 200:
                assert time.monotonic() < deadline, (
                    "the service did not become ready after the database resumed"
                )
                time.sleep(0.2)
            for method, path, body in requests[:5]:
                assert c.request(method, path, json=body).status_code < 300


# ------------------------------------------------------------------------------ killed API
def _descendants(root: int) -> list[int]:
    """Every living process below `root`, from /proc."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found[1:]


def _alive(pids: list[int]) -> list[str]:
    out = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            if state != "Z":  # a zombie is dead (its parent is gone; init reaps it)
                command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")[:120]
                out.append(f"{pid}: {command!r}")
        except OSError:
            pass
    return out


def _kill_and_expect_no_survivors(process: subprocess.Popen[str], expected_at_least: int) -> None:
    family = _descendants(process.pid)
    assert len(family) >= expected_at_least, f"expected child processes to exist first: {_alive(family)}"
    process.send_signal(signal.SIGKILL)
    process.wait(10)
    deadline = time.monotonic() + 5.0
    while _alive(family) and time.monotonic() < deadline:
        time.sleep(0.1)
    survivors = _alive(family)
    print(
        f"killed API: {len(family)} descendants, {len(survivors)} alive after {time.monotonic() - deadline + 5:.1f} s"
    )
    for pid in family:  # leave nothing behind whatever the outcome
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    assert not survivors, f"processes outlived the killed API by 5 s: {survivors}"


def _upload(url: str) -> None:
    """An upload, validated in an ingest process (the servers here send every body there), so the pool's
    processes exist and have worked."""
    r = httpx.post(f"{url}/v1/traces", content=synthetic_trace(n_blocks=8).canonical_json(), timeout=60)
    assert r.status_code in (200, 201)


@pytest.mark.parametrize("processes", [1, pytest.param(2, marks=pytest.mark.postgres)])
def test_no_process_outlives_a_killed_api(
    processes: int, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """kill -9 of `memplan serve` (one API process, or uvicorn's supervisor of two): its forkserver, resource
    tracker, ingest processes (and API worker processes) are gone within seconds, not left under PID 1."""
    url_db = f"sqlite:///{tmp_path / 'm.db'}" if processes == 1 else request.getfixturevalue("postgres_url")
    with serve(
        url_db,
        "--processes",
        str(processes),
        MEMPLAN_INGEST_PROCESSES="2",
        MEMPLAN_INGEST_INLINE_MAX_BYTES="0",
    ) as (url, process):
        # per API process: a forkserver and 2 ingest processes (and the API process itself, under uvicorn's
        # supervisor); one resource tracker
        expected = 4 if processes == 1 else 9
        # each API process starts its pool in the background as it starts, and the kernel decides which one
        # accepts a connection (CI once saw one API process's pool and none of the other's after two uploads):
        # upload until every pool is there
        deadline = time.monotonic() + 60
        _upload(url)
        while len(_descendants(process.pid)) < expected and time.monotonic() < deadline:
            time.sleep(0.2)
            _upload(url)
        _kill_and_expect_no_survivors(process, expected_at_least=expected)


def test_no_process_outlives_a_killed_embedded_server(tmp_path: Path) -> None:
    """`memplan demo` runs the service in a thread of its own process (planner_service.embedded): killed, that
    process leaves no ingest processes behind either."""
    code = (
        "import sys, time; from planner_service.embedded import EmbeddedServer; "
        "from planner_service.settings import Settings; "
        f"s = EmbeddedServer(Settings(database_url='sqlite:///{tmp_path / 'e.db'}', workers=1, "
        "ingest_inline_max_bytes=0)); "
        "url = s.__enter__(); print(url, flush=True); time.sleep(600)"
    )
    process = subprocess.Popen([sys.executable, "-c", code], text=True, stdout=subprocess.PIPE)
    try:
        assert process.stdout is not None
        url = process.stdout.readline().strip()
        _upload(url)
        _kill_and_expect_no_survivors(process, expected_at_least=4)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)
