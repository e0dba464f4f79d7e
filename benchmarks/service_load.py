"""Load benchmark of the planner service: concurrent agents upload ~1 MB gzip traces and poll their plans.

Starts the real service (`memplan serve`, 2 API processes) and a `memplan worker` (`chrt --idle 0`: solves
are batch work that runs on otherwise idle CPU) on a loopback port against PostgreSQL (a fresh database on the local server unless
--database-url is given), then runs N agents for D seconds. Warm-up (not timed): each agent uploads a
distinct trace (gzip, ~1 MB on the wire: a synthetic model plus random allocation events, packed as the
agent sends them; --trace-schema 1 sends them as JSON lists, the older form) and requests a
plan. In the window each agent polls `GET /v1/plans/{id}` at --poll-hz as the SDK does (If-None-Match with
the entity tag it holds), open loop: latency counts from when the poll was due, so a slow answer makes the
next polls late and that counts too. Each agent also uploads a new trace version and requests its plan every
--upload-every seconds, starting at a random phase. The generator is aiohttp on uvloop (~0.2 ms of CPU per
request; httpx's async client took ~3.5 ms with 50 connections, a third of the 2 cores). Prints and saves
(benchmarks/results/service_load-<UTC timestamp>.json (pointer: service_load-latest.json)): errors, GET/s, GET and upload latency percentiles, where the CPU went.

    .venv/bin/python benchmarks/service_load.py --agents 50 --duration 60 [--runs 3] [--auth]

With 50 uploads in a run, a run's upload p99 is its slowest upload; --runs N repeats the whole benchmark
(fresh database and service each) and also reports the percentiles of all runs' requests pooled.

With --auth the service runs as docker-compose.yml runs it (MEMPLAN_AUTH=true) and every request carries a
bearer token (one project's token, created with `memplan tokens create`).
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import os
import random
import re
import resource
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import uvloop

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from _results import machine, save  # noqa: E402

from client.contract import EventArrays  # noqa: E402
from client.contract.trace import CATEGORIES, PHASES  # noqa: E402
from planner_service.embedded import free_port, wait_until_ready  # noqa: E402
from planner_service.solver.testing.synthetic import synthetic_trace  # noqa: E402

RESULTS = REPO / "benchmarks" / "results" / "service_load.json"


def _events(rng: np.random.Generator, n: int, schema: int) -> dict[str, Any]:
    """`n` random allocation events in the wire form of trace schema `schema` (2: packed arrays; 1: lists)."""
    horizon = 4 * n
    alloc = rng.integers(0, horizon - 1, size=n)
    cols = {
        "id": np.arange(n),
        "size_bytes": rng.choice([512, 4096, 65536, 1 << 20, 3 << 20], size=n),
        "alloc_index": alloc,
        "free_index": np.minimum(horizon, alloc + 1 + rng.integers(0, 512, size=n)),
        "category": rng.choice([CATEGORIES.index(c) for c in ("activation", "temp", "grad")], size=n),
        "block": rng.integers(0, 24, size=n),
        "phase": rng.integers(0, 2, size=n),
    }
    if schema == 2:
        events = {"event_arrays": json.loads(EventArrays.from_arrays(**cols).model_dump_json())}
    else:
        events = {"event_columns": {f: v.tolist() for f, v in cols.items()}}
        events["event_columns"]["category"] = [CATEGORIES[c].value for c in cols["category"].tolist()]
        events["event_columns"]["phase"] = [PHASES[p].value for p in cols["phase"].tolist()]
    return {"source": "dispatch_tracker", "horizon": horizon, **events}


def make_trace_gzip(agent: int, version: int, target_gzip_bytes: int, schema: int = 2) -> bytes:
    """A distinct, valid trace whose gzip body is about `target_gzip_bytes`: a synthetic model plus random
    allocation events, as many as fill the target (measured on a first 10^4 events)."""
    base = synthetic_trace(
        n_blocks=24 + agent % 8, hidden=1024, vocab=32000 + version, name=f"load-model-{agent % 10}"
    ).model_dump(mode="json")
    base["schema_version"] = schema
    rng = np.random.default_rng(agent * 1000 + version)

    def body(n: int) -> bytes:
        base["allocation_trace"] = _events(rng, n, schema)
        return gzip.compress(json.dumps(base, separators=(",", ":")).encode(), compresslevel=6)

    probe = 10_000
    fixed = len(body(1))
    per_event = (len(body(probe)) - fixed) / probe
    return body(max(1, round((target_gzip_bytes - fixed) / per_event)))


def cpu_s(usage: resource.struct_rusage) -> float:
    return usage.ru_utime + usage.ru_stime


def machine_busy_s() -> float:
    """Seconds all CPUs were busy since boot (/proc/stat: everything but idle and iowait)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def cpu_by_role(roots: dict[str, int]) -> dict[str, float]:
    """CPU seconds of live processes: each root's process tree by role name, and the local PostgreSQL
    server's processes as "postgres" (read from /proc; backends are pooled, so they live through the run)."""
    table: dict[int, tuple[int, str, float]] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        rest = text[text.rindex(")") + 2 :].split()
        table[int(stat.parent.name)] = (
            int(rest[1]),
            text[text.index("(") + 1 : text.rindex(")")],
            (int(rest[11]) + int(rest[12])) / tick,
        )  # ppid, comm, utime + stime
    out = dict.fromkeys([*roots, "postgres"], 0.0)
    by_pid = {pid: role for role, pid in roots.items()}
    for pid, (_, comm, cpu) in table.items():
        if comm.startswith("postgres"):
            out["postgres"] += cpu
            continue
        p = pid
        while p in table and p not in by_pid and p > 1:
            p = table[p][0]
        if p in by_pid:
            out[by_pid[p]] += cpu
    return out


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q / 100 * len(s)))]


STATUS_RE = re.compile(rb'"status":"(\w+)"')


class Stats:
    def __init__(self) -> None:
        self.get_s: list[float] = []  # from the poll's scheduled time to the end of the response
        self.upload_s: list[float] = []
        self.upload_timing: list[tuple[float, str]] = []  # (seconds, the response's Server-Timing)
        self.errors: list[str] = []
        self.full_gets = 0  # 200s: the record's body sent; the other GETs are 304s (the copy held is current)
        self.full_get_bytes = 0
        self.final_seen = 0  # plans an agent saw reach a final status during the window


class Agent:
    """One training job's traffic: uploads a trace, requests a plan, polls it at a fixed rate (as the SDK does,
    with If-None-Match), and uploads a new trace version every `upload_every` seconds."""

    UPLOAD_HEADERS = {"content-type": "application/json", "content-encoding": "gzip"}

    def __init__(self, i: int, http: aiohttp.ClientSession, bodies: list[bytes], stats: Stats) -> None:
        self.i, self.http, self.bodies, self.stats = i, http, bodies, stats
        self.version = 0
        self.plan_id: str | None = None
        self.etag: str | None = None
        self.final = False

    async def upload(self, timed: bool) -> None:
        t0 = time.perf_counter()
        async with self.http.post(
            "/v1/traces", data=self.bodies[self.version], headers=self.UPLOAD_HEADERS
        ) as r:
            body = await r.read()
            if r.status not in (200, 201):
                self.stats.errors.append(f"upload {r.status}: {body[:200]!r}")
                return
            trace_id = json.loads(body)["id"]
            server_timing = r.headers.get("server-timing", "")
        if timed:
            self.stats.upload_s.append(time.perf_counter() - t0)
            self.stats.upload_timing.append((self.stats.upload_s[-1], server_timing))
        limits = {"device_memory_bytes": (8 + self.i % 8) * 2**30, "time_limit_s": 5}
        async with self.http.post("/v1/plans", json={"trace_id": trace_id, "constraints": limits}) as r:
            body = await r.read()
            if r.status not in (200, 202):
                self.stats.errors.append(f"plan request {r.status}: {body[:200]!r}")
                return
            self.plan_id, self.etag, self.final = json.loads(body)["id"], None, False
        self.version += 1

    async def poll(self, scheduled: float, timed: bool = True) -> None:
        assert self.plan_id is not None
        headers = {"if-none-match": self.etag} if self.etag else None
        async with self.http.get(f"/v1/plans/{self.plan_id}", headers=headers) as r:
            body = await r.read()
            if not timed:
                self.etag = r.headers.get("etag")
                return
            self.stats.get_s.append(time.monotonic() - scheduled)
            if r.status == 200:
                self.etag = r.headers.get("etag")
                self.stats.full_gets += 1
                self.stats.full_get_bytes += len(body)
                # The status from the record's head (the Plan follows it): parsing a 3 MB body here would
                # stall the generator's event loop and be counted as the server's latency.
                status = STATUS_RE.search(body, 0, 4096)
                if not self.final and status and status.group(1) in (b"done", b"failed", b"infeasible"):
                    self.final = True
                    self.stats.final_seen += 1
            elif r.status != 304:
                self.stats.errors.append(f"get {r.status}: {body[:200]!r}")

    async def run(self, start: float, duration: float, poll_hz: float, upload_every: float) -> None:
        """Open loop: polls are due every 1/poll_hz s, and a slow answer makes the next ones late, which counts
        (latency runs from the due time: no coordinated omission). Uploads start at a random phase."""
        rng = random.Random(self.i)
        period = 1.0 / poll_hz
        due = start + rng.uniform(0, period)
        next_upload = start + rng.uniform(0, upload_every)
        while True:
            try:
                now = time.monotonic()
                if now >= next_upload and self.version < len(self.bodies):
                    await self.upload(timed=True)
                    next_upload += upload_every
                    due = max(due, time.monotonic())  # polls the agent skipped while uploading are not late
                    continue
                if due - start >= duration:
                    return
                if due > now:
                    await asyncio.sleep(due - now)
                await self.poll(due)
                due += period
            except (TimeoutError, aiohttp.ClientError) as exc:
                self.stats.errors.append(f"{type(exc).__name__}: {exc}")
                due = max(due + period, time.monotonic())


async def run_load(
    url: str,
    agents: int,
    duration: float,
    poll_hz: float,
    upload_every: float,
    bodies: list[list[bytes]],
    roots: dict[str, int],
    headers: dict[str, str],
) -> tuple[Stats, float, dict[str, float]]:
    """Warm-up (not timed): every agent uploads its first trace and gets a plan to poll. Then the window."""
    stats = Stats()
    connector = aiohttp.TCPConnector(limit=agents * 2)
    async with aiohttp.ClientSession(
        url, connector=connector, timeout=aiohttp.ClientTimeout(total=60), headers=headers
    ) as http:
        fleet = [Agent(i, http, bodies[i], stats) for i in range(agents)]
        gate = asyncio.Semaphore(
            4
        )  # a few at a time: every API process sees uploads (its first ones are cold)

        async def first_upload(a: Agent) -> None:
            async with gate:
                await a.upload(timed=False)

        await asyncio.gather(*(first_upload(a) for a in fleet))
        # Each agent holds its plan's state and a kept-alive connection (polled concurrently, so the client's
        # pool opens one per agent) before timing starts.
        await asyncio.gather(*(a.poll(time.monotonic(), timed=False) for a in fleet))
        await asyncio.sleep(2.0)  # let the warm-up's work (ingest, plan rows) settle before the window
        start = time.monotonic()
        busy0, self0, roles0 = machine_busy_s(), resource.getrusage(resource.RUSAGE_SELF), cpu_by_role(roots)
        await asyncio.gather(*(a.run(start, duration, poll_hz, upload_every) for a in fleet))
        wall = time.monotonic() - start
        busy1, self1, roles1 = machine_busy_s(), resource.getrusage(resource.RUSAGE_SELF), cpu_by_role(roots)
        cpu = {
            "load_generator_s": round(cpu_s(self1) - cpu_s(self0), 1),
            **{f"{role}_s": round(roles1[role] - roles0[role], 1) for role in roles1},
            "machine_busy_fraction": round((busy1 - busy0) / (wall * (os.cpu_count() or 1)), 3),
        }
        # Busy time none of the above account for: other work on the machine (a run with much of it is noisy).
        cpu["other_s"] = round(busy1 - busy0 - sum(v for k, v in cpu.items() if k.endswith("_s")), 1)
        return stats, wall, cpu


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
    ap.add_argument("--upload-every", type=float, default=60.0, help="seconds between an agent's uploads")
    ap.add_argument(
        "--poll-hz",
        type=float,
        default=11.0,
        help="plan polls per second per agent (50 x 11 = 550/s offered, above the 500/s target)",
    )
    ap.add_argument("--trace-gzip-bytes", type=int, default=1_000_000)
    ap.add_argument(
        "--trace-schema",
        type=int,
        choices=(1, 2),
        default=2,
        help="wire form of the allocation events: 2 packed arrays (what the agent sends), 1 JSON lists",
    )
    ap.add_argument("--processes", type=int, default=2, help="API processes")
    ap.add_argument("--admin-url", default="postgresql+psycopg://postgres@127.0.0.1:5432/postgres")
    ap.add_argument("--database-url", default=None, help="use this database instead of a fresh one")
    ap.add_argument("--no-worker", action="store_true", help="no solve worker (isolates the API's own cost)")
    ap.add_argument(
        "--runs",
        type=int,
        default=1,
        help="independent runs (fresh database and service each); "
        "the result has each run's figures and the percentiles of all runs' requests pooled",
    )
    ap.add_argument("--out", type=Path, default=RESULTS, help="where to save the result")
    ap.add_argument(
        "--auth",
        action="store_true",
        help="production mode (as docker-compose.yml): MEMPLAN_AUTH=true, every request with a bearer token",
    )
    args = ap.parse_args()

    versions = 2 + int(args.duration // args.upload_every)  # the warm-up upload, then one per period
    print(
        f"building {args.agents} x {versions} distinct traces of ~{args.trace_gzip_bytes / 1e6:.1f} MB gzip ..."
    )
    bodies = [
        [make_trace_gzip(i, v, args.trace_gzip_bytes, args.trace_schema) for v in range(versions)]
        for i in range(args.agents)
    ]
    sizes = [len(b) for row in bodies for b in row]
    print(f"  gzip sizes {min(sizes) / 1e6:.2f}..{max(sizes) / 1e6:.2f} MB")

    runs = []
    for n in range(args.runs):
        if args.runs > 1:
            print(f"run {n + 1} of {args.runs}")
        stats, wall, cpu = one_run(args, bodies)
        runs.append((stats, wall, cpu))
        print(json.dumps(run_figures(stats, wall, cpu), indent=1))
    pooled = Stats()
    for stats, _, _ in runs:
        pooled.get_s += stats.get_s
        pooled.upload_s += stats.upload_s
        pooled.errors += stats.errors
    result: dict[str, Any] = {
        "command": " ".join(["python", *sys.argv]),
        "machine": machine(),
        "load_avg_1m_after": os.getloadavg()[0],
        "agents": args.agents,
        "api_processes": args.processes,
        "trace_gzip_mb_median": round(statistics.median(sizes) / 1e6, 3),
        "trace_schema": args.trace_schema,
        "poll_hz_per_agent": args.poll_hz,
        "upload_every_s": args.upload_every,
        "ingest_niceness": os.environ.get("MEMPLAN_INGEST_NICENESS", "default"),
        "auth": args.auth,
        "layout": f"{args.processes} API processes (--workers 0)"
        + ("" if args.no_worker else " + 1 `memplan worker` (SCHED_IDLE: `chrt --idle 0`)"),
        "runs": [run_figures(*run) for run in runs],
        # Every run's requests together: with 50 uploads a run, one run's upload p99 is its slowest upload.
        "pooled": {
            "runs": len(runs),
            "errors": len(pooled.errors),
            "gets": len(pooled.get_s),
            "get_p99_ms": round(pct(pooled.get_s, 99) * 1e3, 2),
            "uploads": len(pooled.upload_s),
            "upload_p50_ms": round(pct(pooled.upload_s, 50) * 1e3, 1),
            "upload_p99_ms": round(pct(pooled.upload_s, 99) * 1e3, 1),
            "upload_max_ms": round(max(pooled.upload_s, default=float("nan")) * 1e3, 1),
        },
        "targets": {"errors": 0, "get_p99_ms": 20, "get_per_s": 500, "upload_p99_ms": 300},
    }
    print(json.dumps(result["pooled"], indent=1))
    save(args.out, result)


def one_run(args: argparse.Namespace, bodies: list[list[bytes]]) -> tuple[Stats, float, dict[str, float]]:
    """A fresh database (unless --database-url), a started service and worker, warm-up, the timed window."""
    created = None
    db_url = args.database_url
    if db_url is None:
        db_url, created = fresh_postgres_db(args.admin_url)
    port = free_port()
    env = {
        **os.environ,
        "MEMPLAN_DATABASE_URL": db_url,
        "MEMPLAN_RATE_LIMIT_PER_S": "100000",
        "MEMPLAN_RATE_LIMIT_BURST": "100000",
    }
    subprocess.run(
        [sys.executable, "-m", "memplan", "db", "upgrade"], env=env, check=True, capture_output=True
    )
    headers: dict[str, str] = {}
    if args.auth:
        env["MEMPLAN_AUTH"] = "true"
        made = subprocess.run(
            [sys.executable, "-m", "memplan", "tokens", "create", "--project", "load"],
            env=env,
            check=True,
            capture_output=True,
            text=True,
        )
        headers["authorization"] = f"Bearer {made.stdout.strip().splitlines()[-1]}"
    # The production layout (docker-compose.yml): API processes without solvers, a separate worker process
    # (SCHED_IDLE, as an operator would run batch work on a shared box: a CPU running only idle-class work
    # counts as idle when a request wakes up) so solves never take CPU or the GIL from requests.
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "memplan",
            "serve",
            "--port",
            str(port),
            "--workers",
            "0",
            "--processes",
            str(args.processes),
            "--log-level",
            "warning",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    worker_cmd = (
        ["true"] if args.no_worker else ["chrt", "--idle", "0", sys.executable, "-m", "memplan", "worker"]
    )
    worker = subprocess.Popen(worker_cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_ready(url, server)
        print(
            f"load: {args.agents} agents for {args.duration:.0f} s against {url} ({args.processes} API processes)"
        )
        # uvloop (installed with uvicorn[standard]): the generator shares the 2 cores with the service, and its
        # own cost per request is not what is measured.
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(
                run_load(
                    url,
                    args.agents,
                    args.duration,
                    args.poll_hz,
                    args.upload_every,
                    bodies,
                    {"api": server.pid, "worker": worker.pid},
                    headers,
                )
            )
    finally:
        for proc in (worker, server):
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:  # a worker deep in a long solve: its plan row survives
                proc.kill()
                proc.wait(30)
        if created:
            drop_db(args.admin_url, created)


def run_figures(stats: Stats, wall: float, cpu: dict[str, float]) -> dict[str, Any]:
    return {
        "duration_s": round(wall, 1),
        "errors": len(stats.errors),
        "error_samples": stats.errors[:5],
        "gets": len(stats.get_s),
        "get_per_s": round(len(stats.get_s) / wall, 1),
        "get_p50_ms": round(pct(stats.get_s, 50) * 1e3, 2),
        "get_p99_ms": round(pct(stats.get_s, 99) * 1e3, 2),
        "uploads": len(stats.upload_s),
        "upload_p50_ms": round(pct(stats.upload_s, 50) * 1e3, 1),
        "upload_p99_ms": round(pct(stats.upload_s, 99) * 1e3, 1),
        # The slowest uploads with the server's own account (Server-Timing, ms): read the body; ingest (hand-over
        # to an ingest process and back) of which validate (wall and CPU there); store.
        "upload_slowest": [f"{s * 1e3:.0f} ms: {timing}" for s, timing in sorted(stats.upload_timing)[-5:]],
        "full_gets": stats.full_gets,
        "full_get_mb_mean": round(stats.full_get_bytes / max(1, stats.full_gets) / 1e6, 2),
        "plans_final_seen_in_window": stats.final_seen,
        # Where the cores went during the window (CPU seconds; the window is `duration_s` x cores).
        "cpu": cpu,
    }


if __name__ == "__main__":
    main()
