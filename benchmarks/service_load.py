"""Load benchmark of the planner service: concurrent agents upload ~1 MB gzip traces and poll their plans.

Starts the real service (`memplan serve`) on a loopback port against PostgreSQL (a fresh database on the
local server unless --database-url is given), then runs N agents for D seconds. Each agent uploads a
distinct trace (gzip, ~1 MB on the wire: a synthetic model plus a columnar allocation trace), requests a
plan, then polls `GET /v1/plans/{id}` back to back, uploading a new trace version every
--upload-every seconds. Prints and saves (benchmarks/results/service_load.json): errors, GET and upload
latency percentiles, GET/s.

    .venv/bin/python benchmarks/service_load.py --agents 50 --duration 60
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import os
import random
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from _results import machine, save  # noqa: E402

from client.cli.embedded import free_port  # noqa: E402
from planner_service.solver.synthetic import synthetic_trace  # noqa: E402

RESULTS = REPO / "benchmarks" / "results" / "service_load.json"


def make_trace_gzip(agent: int, version: int, target_gzip_bytes: int) -> bytes:
    """A distinct, valid trace whose gzip body is about `target_gzip_bytes` (columnar events: JSON built directly)."""
    base = synthetic_trace(n_blocks=24 + agent % 8, hidden=1024, vocab=32000 + version,
                           name=f"load-model-{agent % 10}").model_dump(mode="json")
    rng = random.Random(agent * 1000 + version)
    n = max(1, target_gzip_bytes // 13)  # ~13 gzip bytes per random event, measured
    horizon = 4 * n
    alloc = [rng.randrange(0, horizon - 1) for _ in range(n)]
    base["allocation_trace"] = {
        "source": "dispatch_tracker", "horizon": horizon,
        "event_columns": {
            "id": list(range(n)),
            "size_bytes": [rng.choice((512, 4096, 65536, 1 << 20, 3 << 20)) for _ in range(n)],
            "alloc_index": alloc,
            "free_index": [min(horizon, a + 1 + rng.randrange(0, 512)) for a in alloc],
            "category": [rng.choice(("activation", "temp", "grad")) for _ in range(n)],
            "block": [rng.randrange(0, 24) for _ in range(n)],
            "phase": [rng.choice(("forward", "backward")) for _ in range(n)],
        },
    }
    return gzip.compress(json.dumps(base, separators=(",", ":")).encode(), compresslevel=6)


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q / 100 * len(s)))]


class Stats:
    def __init__(self) -> None:
        self.get_s: list[float] = []
        self.upload_s: list[float] = []
        self.errors: list[str] = []
        self.gets_in_window = 0


async def agent(i: int, client: httpx.AsyncClient, bodies: list[bytes], stats: Stats, start: float,
                duration: float, upload_every: float) -> None:
    headers = {"content-type": "application/json", "content-encoding": "gzip"}
    version = 0
    plan_id: str | None = None
    next_upload = time.monotonic()
    await asyncio.sleep(random.Random(i).uniform(0, min(5.0, upload_every)))  # agents do not start in lockstep
    while time.monotonic() - start < duration:
        try:
            if time.monotonic() >= next_upload and version < len(bodies):
                t0 = time.perf_counter()
                r = await client.post("/v1/traces", content=bodies[version], headers=headers)
                stats.upload_s.append(time.perf_counter() - t0)
                if r.status_code not in (200, 201):
                    stats.errors.append(f"upload {r.status_code}: {r.text[:200]}")
                    continue
                limits = {"device_memory_bytes": (8 + i % 8) * 2**30, "time_limit_s": 5}
                r = await client.post("/v1/plans", json={"trace_id": r.json()["id"], "constraints": limits})
                if r.status_code not in (200, 202):
                    stats.errors.append(f"plan request {r.status_code}: {r.text[:200]}")
                    continue
                plan_id = r.json()["id"]
                version += 1
                next_upload += upload_every
            if plan_id is None:
                continue
            t0 = time.perf_counter()
            r = await client.get(f"/v1/plans/{plan_id}")
            stats.get_s.append(time.perf_counter() - t0)
            if r.status_code != 200:
                stats.errors.append(f"get {r.status_code}: {r.text[:200]}")
        except httpx.HTTPError as exc:
            stats.errors.append(f"{type(exc).__name__}: {exc}")


async def run_load(url: str, agents: int, duration: float, upload_every: float,
                   bodies: list[list[bytes]]) -> Stats:
    stats = Stats()
    limits = httpx.Limits(max_connections=agents, max_keepalive_connections=agents)
    async with httpx.AsyncClient(base_url=url, timeout=30, limits=limits) as client:
        start = time.monotonic()
        await asyncio.gather(*(agent(i, client, bodies[i], stats, start, duration, upload_every)
                               for i in range(agents)))
    return stats


def fresh_postgres_db(admin_url: str) -> tuple[str, str]:
    import psycopg

    name = f"memplan_load_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(admin_url.replace("postgresql+psycopg://", "postgresql://"), autocommit=True) as c:
        c.execute(f'CREATE DATABASE "{name}"')
    return admin_url.rsplit("/", 1)[0] + f"/{name}", name


def drop_db(admin_url: str, name: str) -> None:
    import psycopg

    with psycopg.connect(admin_url.replace("postgresql+psycopg://", "postgresql://"), autocommit=True) as c:
        c.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--agents", type=int, default=50)
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of load")
    ap.add_argument("--upload-every", type=float, default=20.0, help="seconds between an agent's uploads")
    ap.add_argument("--trace-gzip-bytes", type=int, default=1_000_000)
    ap.add_argument("--processes", type=int, default=2, help="API processes")
    ap.add_argument("--admin-url", default="postgresql+psycopg://postgres@127.0.0.1:5432/postgres")
    ap.add_argument("--database-url", default=None, help="use this database instead of a fresh one")
    ap.add_argument("--no-worker", action="store_true", help="no solve worker (isolates the API's own cost)")
    args = ap.parse_args()

    versions = max(1, int(args.duration // args.upload_every) + 1)
    print(f"building {args.agents} x {versions} distinct traces of ~{args.trace_gzip_bytes / 1e6:.1f} MB gzip ...")
    bodies = [[make_trace_gzip(i, v, args.trace_gzip_bytes) for v in range(versions)] for i in range(args.agents)]
    sizes = [len(b) for row in bodies for b in row]
    print(f"  gzip sizes {min(sizes) / 1e6:.2f}..{max(sizes) / 1e6:.2f} MB")

    created = None
    db_url = args.database_url
    if db_url is None:
        db_url, created = fresh_postgres_db(args.admin_url)
    port = free_port()
    env = {**os.environ, "MEMPLAN_DATABASE_URL": db_url, "MEMPLAN_RATE_LIMIT_PER_S": "100000",
           "MEMPLAN_RATE_LIMIT_BURST": "100000"}
    subprocess.run([sys.executable, "-m", "client.cli", "db", "upgrade"], env=env, check=True, capture_output=True)
    # The production layout (docker-compose.yml): API processes without solvers, a separate worker process
    # (niced, as an operator would on a shared box) so solves never take CPU or the GIL from requests.
    server = subprocess.Popen([sys.executable, "-m", "client.cli", "serve", "--port", str(port), "--workers", "0",
                               "--processes", str(args.processes), "--log-level", "warning"],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    worker_cmd = ["true"] if args.no_worker else ["nice", "-n", "10", sys.executable, "-m", "client.cli", "worker"]
    worker = subprocess.Popen(worker_cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"server did not start: {server.stderr.read() if server.stderr else ''}")
            time.sleep(0.2)
        print(f"load: {args.agents} agents for {args.duration:.0f} s against {url} ({args.processes} API processes)")
        t0 = time.monotonic()
        stats = asyncio.run(run_load(url, args.agents, args.duration, args.upload_every, bodies))
        wall = time.monotonic() - t0
        done = httpx.get(f"{url}/v1/plans", params={"status": "done", "limit": 1}, timeout=10).json()
    finally:
        for proc in (server, worker):
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:  # a worker deep in a long solve: its plan row survives
                proc.kill()
                proc.wait(30)
        if created:
            drop_db(args.admin_url, created)

    result: dict[str, Any] = {
        "command": " ".join(["python", *sys.argv]),
        "machine": machine(),
        "load_avg_1m_after": os.getloadavg()[0],
        "agents": args.agents, "duration_s": round(wall, 1), "api_processes": args.processes,
        "trace_gzip_mb_median": round(statistics.median(sizes) / 1e6, 3),
        "errors": len(stats.errors), "error_samples": stats.errors[:5],
        "gets": len(stats.get_s), "get_per_s": round(len(stats.get_s) / wall, 1),
        "get_p50_ms": round(pct(stats.get_s, 50) * 1e3, 2), "get_p99_ms": round(pct(stats.get_s, 99) * 1e3, 2),
        "uploads": len(stats.upload_s),
        "upload_p50_ms": round(pct(stats.upload_s, 50) * 1e3, 1),
        "upload_p99_ms": round(pct(stats.upload_s, 99) * 1e3, 1),
        "plans_done_seen": bool(done.get("items")),
        "layout": f"{args.processes} API processes (--workers 0)"
                  + ("" if args.no_worker else " + 1 `memplan worker` (nice 10)"),
        "targets": {"errors": 0, "get_p99_ms": 20, "get_per_s": 500, "upload_p99_ms": 300},
    }
    print(json.dumps(result, indent=1))
    save(RESULTS, result)


if __name__ == "__main__":
    main()
