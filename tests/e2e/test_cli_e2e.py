"""End to end: the real `memplan serve` process on a loopback port, driven only through the `memplan` CLI."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from planner_service.embedded import free_port, wait_until_ready
from planner_service.solver.synthetic import synthetic_trace


def _memplan(*args: str, env: dict[str, str], check: bool = True) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "memplan", *args]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    if check and res.returncode != 0:
        raise AssertionError(f"memplan {' '.join(args)} failed ({res.returncode}):\n{res.stdout}\n{res.stderr}")
    return res


@pytest.fixture
def served(db_url: str, tmp_path: Path) -> Iterator[dict[str, str]]:
    port = free_port()
    env = {**os.environ, "MEMPLAN_DATABASE_URL": db_url, "MEMPLAN_SERVER": f"http://127.0.0.1:{port}",
           "COLUMNS": "200"}
    proc = subprocess.Popen([sys.executable, "-m", "memplan", "serve", "--port", str(port), "--workers", "1"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_until_ready(f"http://127.0.0.1:{port}", proc)
        yield env
    finally:
        proc.terminate()
        proc.wait(30)


def test_upload_request_wait_list_through_the_cli(served: dict[str, str], tmp_path: Path) -> None:
    path = tmp_path / "trace.json"
    path.write_text(synthetic_trace(n_blocks=3, hidden=128, vocab=500, name="e2e-model").model_dump_json())
    out = _memplan("traces", "upload", str(path), env=served).stdout
    trace_id = out.split()[0]
    assert "new" in out
    assert "already stored" in _memplan("traces", "upload", str(path), env=served).stdout
    out = _memplan("plans", "request", trace_id, "--device-memory", "8GiB", "--wait", env=served).stdout
    plan_id = out.split()[0]
    assert re.search(r"plan \w+: (done|infeasible)", out), out
    assert "device 8.00 GiB" in out
    listed = _memplan("plans", "list", "--model", "e2e-model", env=served).stdout
    assert plan_id[:12] in listed
    plan_file = tmp_path / "plan.json"
    _memplan("plans", "get", plan_id, "-o", str(plan_file), env=served)
    assert '"trace_hash"' in plan_file.read_text()
    assert "e2e-model" in _memplan("traces", "list", env=served).stdout


def test_cli_reports_bad_input_without_a_traceback(served: dict[str, str], tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema_version": 1}')
    res = _memplan("traces", "upload", str(bad), env=served, check=False)
    assert res.returncode == 1 and "not a valid trace" in res.stdout + res.stderr
    res = _memplan("plans", "request", "x", "--device-memory", "8 parsecs", env=served, check=False)
    assert res.returncode == 2 and "8 parsecs" in res.stdout + res.stderr
    res = _memplan("plans", "get", "missing", env=served, check=False)
    assert res.returncode == 1 and "404" in res.stdout + res.stderr
