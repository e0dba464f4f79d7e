"""`POST /v1/sweeps` / `GET /v1/sweeps/{id}` through the SDK against the real service on a loopback port: a
64-point sweep (4 batches x 4 sequence lengths x 2 GPUs x 2 host limits) of a small Llama fans out into 64
plans on the job engine (the in-process pool on SQLite, procrastinate on PostgreSQL) with 2 workers, reports
progress while they finish, and pages its results; bad sweeps are named."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from threading import Barrier

import httpx
import pytest

from client import Client
from client.contract import SweepPoint, SweepRequest
from tests.planner_service.sweeps import TINY_LLAMA

FINAL = {"done", "infeasible", "failed"}


def test_a_64_point_sweep_finishes_on_2_workers_and_reports_progress(sweep_service: str) -> None:
    req = SweepRequest(
        config=TINY_LLAMA,
        hardware=["l4", "h100-sxm"],
        batch_sizes=[1, 2, 4, 8],
        sequence_lengths=[16, 32, 64, 128],
        host_memory_bytes=[2**30, 64 * 2**30],
        dtype="bf16",
        time_limit_s=1.0,
    )
    assert req.n_points() == 64
    with Client(sweep_service) as c:
        created = c.create_sweep(req)
        assert created.progress.total == 64 and len(created.points) == 64
        seen = [created.progress.finished]
        deadline = time.monotonic() + 120
        while seen[-1] < 64:
            assert time.monotonic() < deadline, f"sweep stuck at {seen[-1]}/64"
            time.sleep(0.2)
            p = c.get_sweep(created.id, limit=1).progress
            assert sum(p.by_status.values()) == 64
            seen.append(p.finished)
        assert seen == sorted(seen)  # progress only grows
        assert seen[0] < 64  # the first reading came before the last point finished

        points: list[SweepPoint] = []
        cursor = None
        while True:
            page = c.get_sweep(created.id, limit=10, cursor=cursor)
            points += page.points
            cursor = page.next_cursor
            if cursor is None:
                break
        assert len(points) == 64 and all(p.status in FINAL for p in points)
        assert [(p.batch_size, p.sequence_length) for p in points[::4]] == [
            (b, s) for b in [1, 2, 4, 8] for s in [16, 32, 64, 128]
        ]
        assert {p.status for p in points} <= {"done", "infeasible"}
        fits = [p for p in points if p.fits]
        assert fits and all(p.tokens_per_s and p.iteration_s and p.peak_device_bytes for p in fits)
        for p in fits:
            assert p.tokens_per_s == pytest.approx(p.batch_size * p.sequence_length / p.iteration_s)
        # a point's plan is an ordinary plan, its trace a stored modelled trace
        plan = c.get_plan(points[-1].plan_id)
        assert plan.status == points[-1].status and plan.trace_id == points[-1].trace_id
        assert c.get_trace(points[-1].trace_id).trace.modelled is not None


def test_bad_sweeps_are_named(sweep_service: str) -> None:
    base = {"config": TINY_LLAMA, "hardware": ["l4"], "batch_sizes": [1], "sequence_lengths": [8]}
    cases = [
        ({**base, "hardware": ["nope"]}, 422, "hardware[0]: 'nope' is not in the catalogue"),
        (
            {**base, "batch_sizes": list(range(1, 65)), "sequence_lengths": list(range(1, 18))},
            422,
            "a sweep of 1088 points: at most 1024",
        ),
        ({**base, "batch_sizes": list(range(1, 66))}, 422, "batch_sizes"),
        ({**base, "config": {"hidden_size": 8}}, 422, "config: model_type: missing"),
        ({**base, "batch_sizes": [0]}, 422, "batch_sizes"),
    ]
    for body, status, says in cases:
        r = httpx.post(f"{sweep_service}/v1/sweeps", json=body, timeout=60)
        assert r.status_code == status, (body, r.text)
        assert says in r.text, (body, r.text)
    assert httpx.get(f"{sweep_service}/v1/sweeps/nope", timeout=10).status_code == 404
    created = httpx.post(f"{sweep_service}/v1/sweeps", json=base, timeout=60).json()
    r = httpx.get(f"{sweep_service}/v1/sweeps/{created['id']}", params={"cursor": "x1"}, timeout=10)
    assert r.status_code == 400 and "cursor" in r.text


def test_memplan_whatif_sweep_shows_progress_and_every_point(sweep_service: str) -> None:
    """The user's path: `memplan whatif --family ... --batch 1,2 --seq 16,32 --hardware l4,h100-sxm --sweep`."""
    import json
    import os
    import subprocess
    import sys

    args = [
        "whatif",
        "--family",
        "llama",
        "--layers",
        "2",
        "--hidden",
        "64",
        "--heads",
        "4",
        "--kv-heads",
        "2",
        "--intermediate",
        "128",
        "--vocab",
        "256",
        "--hardware",
        "l4,h100-sxm",
        "--batch",
        "1,2",
        "--seq",
        "16,32",
        "--time-limit",
        "1",
        "--sweep",
        "--server",
        sweep_service,
    ]
    wide = {**os.environ, "COLUMNS": "200"}  # the table as a wide terminal shows it
    shown = subprocess.run(
        [sys.executable, "-m", "memplan", *args], capture_output=True, text=True, timeout=300, env=wide
    )
    assert shown.returncode == 0, shown.stderr
    assert "8/8" in shown.stderr  # the progress bar's last state: every point finished
    assert "8 points" in shown.stdout and "h100-sxm" in shown.stdout
    out = subprocess.run(
        [sys.executable, "-m", "memplan", *args, "--json"], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    points = json.loads(out.stdout)["points"]
    assert len(points) == 8 and all(p["status"] in FINAL for p in points)
    bad_args = [a if a != "16,32" else "16,x" for a in args]
    bad = subprocess.run(
        [sys.executable, "-m", "memplan", *bad_args], capture_output=True, text=True, timeout=300
    )
    assert bad.returncode == 2 and "--seq: 'x' is not a number" in bad.stderr


def test_identical_sweeps_at_once_share_their_plans(sweep_service: str) -> None:
    """Two identical sweeps posted together (and a sweep naming one device limit twice) make one plan per
    distinct point: each point's request is the same as `POST /v1/plans` with the same trace and limits, and an
    identical request's plan is reused, not solved again."""
    req = SweepRequest(
        config=TINY_LLAMA,
        hardware=["l4"],
        batch_sizes=[1, 2],
        sequence_lengths=[16],
        device_memory_bytes=[2**30, 2**30],
        dtype="bf16",
        time_limit_s=1.0,
    )
    start = Barrier(2)

    def post(_: int) -> list[str]:
        with Client(sweep_service) as c:
            start.wait()
            return [p.plan_id for p in c.create_sweep(req).points]

    with ThreadPoolExecutor(2) as pool:
        first, second = pool.map(post, range(2))
    assert len(first) == 4 and first == second
    assert first[0] == first[1] and first[2] == first[3] and first[0] != first[2]
    with Client(sweep_service) as c:
        assert len(list(c.list_plans())) == 2
