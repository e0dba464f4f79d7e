"""End to end: the real `memplan serve` process on a loopback port, driven through the `memplan` command as
users run it (`python -m memplan`, the console script's module, in a subprocess)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from client.contract import Constraints, Feedback, Trace
from client.sdk import Client
from planner_service.embedded import free_port, wait_until_ready
from planner_service.solver.testing.synthetic import synthetic_trace


def _memplan(*args: str, env: dict[str, str], check: bool = True) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "memplan", *args]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    if check and res.returncode != 0:
        raise AssertionError(
            f"memplan {' '.join(args)} failed ({res.returncode}):\n{res.stdout}\n{res.stderr}"
        )
    return res


@contextmanager
def _serve(db_url: str) -> Iterator[dict[str, str]]:
    port = free_port()
    env = {
        **os.environ,
        "MEMPLAN_DATABASE_URL": db_url,
        "MEMPLAN_SERVER": f"http://127.0.0.1:{port}",
        "COLUMNS": "200",
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "memplan", "serve", "--port", str(port), "--workers", "1"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        wait_until_ready(f"http://127.0.0.1:{port}", proc)
        yield env
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.fixture
def served(db_url: str) -> Iterator[dict[str, str]]:
    """`memplan serve` on each database backend."""
    with _serve(db_url) as env:
        yield env


@pytest.fixture
def served_sqlite(tmp_path: Path) -> Iterator[dict[str, str]]:
    """`memplan serve` on SQLite, for what the CLI does with the answers (the backends answer alike)."""
    from planner_service.db.migrate import upgrade

    url = f"sqlite:///{tmp_path / 'cli.db'}"
    upgrade(url)
    with _serve(url) as env:
        yield env


def _solved(env: dict[str, str], trace: Path) -> tuple[str, str]:
    """(trace id, plan id) of a trace uploaded and solved under 8 GiB through the SDK (setup, not under test)."""
    with Client(env["MEMPLAN_SERVER"]) as c:
        trace_id = c.upload_trace(Trace.model_validate_json(trace.read_text())).id
        record = c.wait_for_plan(c.request_plan(trace_id, Constraints(device_memory_bytes=8 * 2**30)).id)
    assert record.status == "done", record
    return trace_id, record.id


def _trace_file(tmp_path: Path, name: str, blocks: int = 3) -> Path:
    path = tmp_path / f"{name}.json"
    path.write_text(synthetic_trace(n_blocks=blocks, hidden=128, vocab=500, name=name).model_dump_json())
    return path


def test_upload_request_wait_list_through_the_cli(served: dict[str, str], tmp_path: Path) -> None:
    path = _trace_file(tmp_path, "e2e-model")
    out = _memplan("traces", "upload", str(path), env=served).stdout
    trace_id = out.split()[0]
    assert "new" in out
    assert "already stored" in _memplan("traces", "upload", str(path), env=served).stdout
    # 8 GiB holds this model several times over: the plan must be solved, nothing less passes
    out = _memplan("plans", "request", trace_id, "--device-memory", "8GiB", "--wait", env=served).stdout
    plan_id = out.split()[0]
    assert re.search(rf"plan {plan_id}: done\b", out), out
    assert "device 8.00 GiB" in out
    assert "1 buffers" not in out and "trace's host memory" not in out and "layout statuses" not in out
    listed = _memplan("plans", "list", "--model", "e2e-model", env=served).stdout
    assert plan_id[:12] in listed
    plan_file = tmp_path / "plan.json"
    _memplan("plans", "get", plan_id, "-o", str(plan_file), env=served)
    assert '"trace_hash"' in plan_file.read_text()
    assert "e2e-model" in _memplan("traces", "list", env=served).stdout


def test_short_ids_are_accepted_and_an_ambiguous_prefix_lists_the_candidates(
    served: dict[str, str], tmp_path: Path
) -> None:
    with Client(served["MEMPLAN_SERVER"]) as c:
        # 17 random ids: by pigeonhole two share their first hex digit, so some 1-character prefix is ambiguous
        ids = [
            c.upload_trace(synthetic_trace(n_blocks=2, hidden=64, vocab=100, name=f"m{i}")).id
            for i in range(17)
        ]
        first = ids[0]
        plan_id = c.wait_for_plan(c.request_plan(first, Constraints(device_memory_bytes=8 * 2**30)).id).id
    shown = _memplan("plans", "list", env=served).stdout
    short = plan_id[:12]
    assert short in shown and plan_id not in shown  # lists print the short form ...
    assert (
        f"plan {plan_id}: done" in _memplan("plans", "get", short, env=served).stdout
    )  # ... and take it back
    assert f"{first} m0 on" in _memplan("traces", "get", first[:7], env=served).stdout

    digit = next(d for d in "0123456789abcdef" if sum(i.startswith(d) for i in ids) > 1)
    res = _memplan("traces", "get", digit, env=served, check=False)
    assert res.returncode == 1 and "Traceback" not in res.stderr
    assert f"trace id prefix '{digit}' is ambiguous" in res.stderr
    for i in ids:
        if i.startswith(digit):
            assert i in res.stderr  # every candidate is named, with its model
    res = _memplan("plans", "get", "ffffffffff", env=served, check=False)
    assert res.returncode == 1 and "no plan id starts with 'ffffffffff'" in res.stderr


def test_model_and_hardware_filters_match_by_prefix_or_substring_and_lists_print_json(
    served_sqlite: dict[str, str], tmp_path: Path
) -> None:
    served = served_sqlite
    ids = {
        name: _solved(served, _trace_file(tmp_path, name, blocks))[1]
        for name, blocks in (("llama-6L-128H", 3), ("llama-12L-128H", 4), ("qwen2-4L-128H", 2))
    }

    models = _memplan("models", env=served).stdout
    assert all(name in models for name in ids)
    hardware = json.loads(_memplan("hardware", "--json", env=served).stdout)
    assert [h["key"] for h in hardware] == ["cuda:Synthetic GPU (modelled):80GiB:x1"]

    by_prefix = json.loads(_memplan("plans", "list", "--model", "llama", "--json", env=served).stdout)
    assert {p["id"] for p in by_prefix} == {ids["llama-6L-128H"], ids["llama-12L-128H"]}
    by_substring = json.loads(_memplan("plans", "list", "--model", "12L", "--json", env=served).stdout)
    assert [p["id"] for p in by_substring] == [ids["llama-12L-128H"]]
    both = json.loads(
        _memplan("plans", "list", "--model", "QWEN", "--hardware", "synthetic", "--json", env=served).stdout
    )
    assert [p["id"] for p in both] == [ids["qwen2-4L-128H"]]
    traces = json.loads(_memplan("traces", "list", "--model", "llama", "--json", env=served).stdout)
    assert sorted(t["model_name"] for t in traces) == ["llama-12L-128H", "llama-6L-128H"]
    assert len(json.loads(_memplan("plans", "list", "--json", "--limit", "2", env=served).stdout)) == 2

    res = _memplan("plans", "list", "--model", "gpt", env=served, check=False)
    assert res.returncode == 1 and "no model matches 'gpt'" in res.stderr and "qwen2-4L-128H" in res.stderr


def test_plans_get_shows_the_feedback_measured_against_the_prediction(
    served_sqlite: dict[str, str], tmp_path: Path
) -> None:
    served = served_sqlite
    _, plan_id = _solved(served, _trace_file(tmp_path, "fed"))
    assert "feedback: none yet" in _memplan("plans", "get", plan_id[:12], env=served).stdout
    with Client(served["MEMPLAN_SERVER"]) as c:
        predicted = c.get_plan(plan_id).plan.predictions  # type: ignore[union-attr]
        assert predicted is not None
        c.post_feedback(
            plan_id,
            Feedback(
                iteration_s=predicted.iteration_s * 1.25,
                peak_device_bytes=predicted.peak_device_bytes // 2,
                peak_host_bytes=3 * 2**20,
                steps_measured=7,
                notes="run 1",
            ),
        )
    out = _memplan("plans", "get", plan_id[:12], env=served).stdout
    assert "feedback (1 run measured)" in out
    assert "+25.0%" in out and "-50.0%" in out and "3.00 MiB" in out and "run 1" in out


def test_a_file_of_the_wrong_kind_is_named_in_one_line(tmp_path: Path) -> None:
    served = {**os.environ, "COLUMNS": "200"}  # no service: every one of these stops at the file
    trace = _trace_file(tmp_path, "kinds")
    plan = tmp_path / "plan.json"
    _memplan("plans", "solve", str(trace), "--device-memory", "8GiB", "-o", str(plan), env=served)
    for args in (("plans", "solve", str(plan), "--device-memory", "8GiB"), ("traces", "upload", str(plan))):
        res = _memplan(*args, env=served, check=False)
        assert res.returncode != 0 and res.stdout == ""
        assert res.stderr.strip().count("\n") == 0, res.stderr  # one line, not a validation error per field
        assert f"{plan} is a Plan" in res.stderr and "not a Trace" in res.stderr
    res = _memplan("alloc", "simulate", str(plan), env=served, check=False)
    assert res.returncode == 2 and res.stderr.strip().count("\n") == 0 and "is a Plan" in res.stderr
    res = _memplan("alloc", "solve", str(trace), "-o", str(tmp_path / "out.csv"), env=served, check=False)
    assert res.returncode == 2 and res.stderr.strip().count("\n") == 0
    assert f"{trace} is a Trace" in res.stderr and "not a MiniMalloc CSV" in res.stderr
    assert not (tmp_path / "out.csv").exists()


def test_cli_reports_bad_input_without_a_traceback(served_sqlite: dict[str, str], tmp_path: Path) -> None:
    served = served_sqlite
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema_version": 1}')
    res = _memplan("traces", "upload", str(bad), env=served, check=False)
    assert (
        res.returncode == 1
        and "not a Trace; a Trace has hardware, measurements, model, workload" in res.stderr
    )
    res = _memplan("plans", "request", "x", "--device-memory", "8 parsecs", env=served, check=False)
    assert res.returncode == 2 and "8 parsecs" in res.stdout + res.stderr
    res = _memplan("plans", "get", "missing", env=served, check=False)
    assert res.returncode == 1 and "404" in res.stdout + res.stderr
    # session 19 probe: these printed tracebacks (a value the contract refuses, a file that cannot be written, a
    # malformed server URL)
    for args, env, words in (
        (
            ("plans", "request", "x", "--device-memory", "0"),
            served,
            "device_memory_bytes: Input should be greater",
        ),
        (("plans", "list", "-o", str(tmp_path / "no" / "such" / "dir.json")), served, None),
        (("models",), {**served, "MEMPLAN_SERVER": "http://[::1"}, "InvalidURL"),
    ):
        res = _memplan(*args, env=env, check=False)
        assert res.returncode in (1, 2) and "Traceback" not in res.stdout + res.stderr, res.stderr
        assert words is None or words in res.stderr, res.stderr


def test_a_wrong_or_unreachable_server_url_is_named_with_what_to_fix(served_sqlite: dict[str, str]) -> None:
    """Defect: `MEMPLAN_SERVER=http://host:8000/v1` (the API's paths start with /v1) answered every command
    with "error: 404: Not Found", and an unreachable one with "error: GET /v1/plans: [Errno 111] Connection
    refused": neither named the URL used nor what to change."""
    root = served_sqlite["MEMPLAN_SERVER"]
    for args in (("plans", "list"), ("models",), ("traces", "get", "abc")):
        res = _memplan(*args, env={**served_sqlite, "MEMPLAN_SERVER": root + "/v1"}, check=False)
        assert res.returncode == 1, res.stderr
        assert f"no memplan API at {root}/v1" in res.stderr and f"e.g. {root}" in res.stderr, res.stderr
    down = f"http://127.0.0.1:{free_port()}"
    res = _memplan("plans", "list", env={**served_sqlite, "MEMPLAN_SERVER": down}, check=False)
    assert res.returncode == 1 and f"server {down}" in res.stderr and "MEMPLAN_SERVER" in res.stderr, (
        res.stderr
    )
    res = _memplan("plans", "get", "missing", env=served_sqlite, check=False)
    assert "no memplan API" not in res.stderr  # a plan that is not there is not a wrong URL
