"""Benchmark of the planned allocator: trace-replay speed of the C++ core, and fragmentation vs PyTorch's.

CPU part (default):
* inputs: allocation traces of real training iterations profiled on this machine by `agent.profile`
  (gpt2 and llama configs with random weights, with and without activation checkpointing) and the
  MiniMalloc CSVs under tests/planner_service/solver/allocation/data/minimalloc (plain replay input: lifetimes become allocations
  and frees in logical-time order);
* each trace is planned by the allocation planner (`plan_allocation`, 512-byte alignment), then
  - fragmentation: PyTorch's caching allocator replayed on the trace (`simulate_caching_allocator`,
    3 iterations) next to the planned allocator's C++ core replaying the same 3 iterations (host
    backend, the same code as on CUDA): peak reserved, peak allocated, 1 - allocated/reserved;
  - mismatch: the same replay with every iteration buffer 25% larger (a bigger batch than planned):
    fallbacks, peak reserved, fragmentation;
  - speed: allocations per second of the C++ core replaying the trace in a loop (`mp_replay`, one
    ctypes call, so the figure is the core's, not Python's), on the planned path and the mismatch path.
  PyTorch's `expandable_segments` mode has no simulator here: it appears in the CUDA part only.

CUDA part (`--cuda`, needs a GPU; NOT RUN in the session that wrote it, which had none): the same
training loop per config (gpt2/llama x checkpointing x chunk offload through `agent.wrap`), each mode
in a fresh process because the allocator can only be chosen before CUDA starts: PyTorch's caching
allocator, `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`, and the planned allocator (plan from a
profile of the same loop). Reports peak reserved, fragmentation and median iteration time per mode.

Prints tables and saves benchmarks/results/allocator-<UTC timestamp>.json (pointer: allocator-latest.json). Usage:
    .venv/bin/python benchmarks/allocator.py [--quick] [--skip-csv] [--skip-profiled] [--cuda]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _results import save

REPO = Path(__file__).resolve().parents[1]
DATA = (
    REPO / "tests" / "planner_service" / "solver" / "allocation" / "data" / "minimalloc"
)  # vendored, Apache-2.0
RESULTS = REPO / "benchmarks" / "results" / "allocator.json"
MiB = 1 << 20

# (name, kind, layers, hidden, heads, checkpointing): small enough to profile on a 2-core CPU
CPU_CONFIGS = [
    ("gpt2-6L-256", "gpt2", 6, 256, 4, False),
    ("gpt2-6L-256-ckpt", "gpt2", 6, 256, 4, True),
    ("llama-6L-256", "llama", 6, 256, 4, False),
    ("llama-6L-256-ckpt", "llama", 6, 256, 4, True),
]
CPU_BATCH, CPU_SEQ, VOCAB = 4, 128, 2048


# ------------------------------------------------------------------------------------------ traces
def enable_checkpointing(model: Any) -> None:
    """Hugging Face activation checkpointing (the method's name changed in transformers 5)."""
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()


def profiled_trace(kind: str, layers: int, hidden: int, heads: int, ckpt: bool, device: str = "cpu") -> Any:
    import torch

    import agent
    from agent.testing.model_zoo import build

    model, _ = build(kind, layers=layers, hidden=hidden, heads=heads, vocab=VOCAB, seq=CPU_SEQ, seed=0)
    if ckpt:
        enable_checkpointing(model)
    model.to(device)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, VOCAB, (CPU_BATCH, CPU_SEQ), generator=g).to(device)
    trace = agent.profile(model, {"input_ids": x, "labels": x}, repeats=1, device=device)
    assert trace.allocation_trace is not None
    return trace.allocation_trace


def csv_trace(path: Path) -> Any:
    from client.contract import AllocationCategory, AllocationEvent, AllocationTrace, Phase
    from planner_service.solver.allocation import read_minimalloc_csv

    buffers = read_minimalloc_csv(path)
    events = [
        AllocationEvent(
            id=i,
            size_bytes=b.size,
            alloc_index=b.lower,
            free_index=b.upper,
            category=AllocationCategory.temp,
            phase=Phase.forward,
        )
        for i, b in enumerate(buffers)
    ]
    return AllocationTrace(source="dispatch_tracker", horizon=max(b.upper for b in buffers), events=events)


# ---------------------------------------------------------------------------------------- measuring
def scaled_ops(ops: Any, events: list[Any], factor: float) -> Any:
    from agent.allocator import ReplayOps

    long_lived = [e.free_index is None for e in events]
    sizes = [s if ll else max(1, int(s * factor)) for s, ll in zip(ops.sizes, long_lived, strict=True)]
    return ReplayOps(ops=ops.ops, sizes=sizes, event_ids=ops.event_ids)


def replay_rate(plan: Any, events: list[Any], ops: Any, min_allocs: int) -> tuple[float, Any]:
    """Allocations per second of the C++ core replaying `ops` repeatedly (best of 3 runs)."""
    from agent.allocator import PlannedAllocator

    per_iteration = sum(1 for o in ops.ops if o >= 0)
    iterations = max(3, -(-min_allocs // max(1, per_iteration)))
    best = 0.0
    stats = None
    for _ in range(3):
        with PlannedAllocator(plan, events) as pa:
            pa.replay(1, ops)  # reserve the arena, warm caches
            before = pa.stats().allocs
            t0 = time.perf_counter()
            pa.replay(iterations, ops)
            dt = time.perf_counter() - t0
            stats = pa.stats()
            best = max(best, (stats.allocs - before) / dt)
    return best, stats


def replay_row(name: str, trace: Any, time_limit_s: float, min_allocs: int) -> dict[str, Any]:
    from agent.allocator import PlannedAllocator, iteration_ops
    from planner_service.solver.allocation import plan_allocation, simulate_caching_allocator

    events = list(trace.events)
    t0 = time.perf_counter()
    plan = plan_allocation(trace, time_limit_s=time_limit_s)
    plan_s = time.perf_counter() - t0
    caching = simulate_caching_allocator(trace, iterations=3)
    ops = iteration_ops(events)
    with PlannedAllocator(plan, events, debug=True) as pa:
        pa.replay(3, ops, free_at_end=False)
        pa.check()
        planned = pa.stats()
    big = scaled_ops(ops, events, 1.25)
    with PlannedAllocator(plan, events, debug=True) as pa:
        pa.replay(3, big, free_at_end=False)
        pa.check()
        mism = pa.stats()
    rate, _ = replay_rate(plan, events, ops, min_allocs)
    rate_mismatch, _ = replay_rate(plan, events, big, min_allocs // 4)
    row = {
        "trace": name,
        "events": len(events),
        "iteration_allocs": sum(1 for o in ops.ops if o >= 0),
        "plan_status": plan.status.value,
        "plan_s": round(plan_s, 3),
        "lower_bound_bytes": plan.lower_bound_bytes,
        "caching_peak_reserved_bytes": caching.peak_reserved_bytes,
        "caching_peak_allocated_bytes": caching.peak_allocated_bytes,
        "caching_fragmentation": round(caching.fragmentation_ratio, 4),
        "planned_peak_reserved_bytes": planned.peak_reserved_bytes,
        "planned_peak_allocated_bytes": planned.peak_allocated_bytes,
        "planned_fragmentation": round(planned.fragmentation_ratio, 4),
        "planned_fallbacks": planned.fallbacks,
        "planned_served_at_plan": planned.planned + planned.persistent,
        "planned_allocs": planned.allocs,
        "mismatch_x1.25_fallbacks": mism.fallbacks,
        "mismatch_x1.25_pool_fallbacks": mism.pool_fallbacks,
        "mismatch_x1.25_mismatches": mism.mismatches,
        "mismatch_x1.25_peak_reserved_bytes": mism.peak_reserved_bytes,
        "mismatch_x1.25_fragmentation": round(mism.fragmentation_ratio, 4),
        "replay_allocs_per_s": round(rate),
        "replay_mismatch_allocs_per_s": round(rate_mismatch),
        "target_frag_le_3pct_and_below_caching": planned.fragmentation_ratio <= 0.03
        and planned.fragmentation_ratio <= caching.fragmentation_ratio,
    }
    print(
        f"{name:24s} {len(events):6d} ev  caching {caching.peak_reserved_bytes / MiB:8.2f} MiB "
        f"frag {caching.fragmentation_ratio:6.2%} | planned {planned.peak_reserved_bytes / MiB:8.2f} MiB "
        f"frag {planned.fragmentation_ratio:6.2%} fb {planned.fallbacks:3d} | x1.25: fb {mism.fallbacks:4d} "
        f"frag {mism.fragmentation_ratio:6.2%} | {rate / 1e6:6.2f} M alloc/s ({rate_mismatch / 1e6:5.2f} mismatched)",
        flush=True,
    )
    return row


def cpu_part(args: argparse.Namespace) -> list[dict[str, Any]]:
    from agent.allocator.library import load_library

    t0 = time.perf_counter()
    load_library("host")
    print(f"host library ready in {time.perf_counter() - t0:.1f} s (built on first use, then cached)")
    rows: list[dict[str, Any]] = []
    min_allocs = 200_000 if args.quick else 2_000_000
    if not args.skip_profiled:
        configs = CPU_CONFIGS[:1] if args.quick else CPU_CONFIGS
        for name, kind, layers, hidden, heads, ckpt in configs:
            t1 = time.perf_counter()
            trace = profiled_trace(kind, layers, hidden, heads, ckpt)
            print(f"profiled {name} in {time.perf_counter() - t1:.1f} s", flush=True)
            rows.append(replay_row(f"profiled:{name}", trace, args.time_limit, min_allocs))
    if not args.skip_csv and DATA.is_dir():
        names = sorted(p.name for p in DATA.glob("*.csv"))
        for fname in names[:2] if args.quick else names:
            rows.append(
                replay_row(f"minimalloc:{fname}", csv_trace(DATA / fname), args.time_limit, min_allocs)
            )
    return rows


# ---------------------------------------------------------------------------------------------- CUDA
CUDA_CONFIGS = [
    # (name, kind, layers, hidden, heads, batch, seq, checkpointing, offload)
    ("gpt2-12L-768", "gpt2", 12, 768, 12, 8, 512, False, False),
    ("gpt2-12L-768-ckpt", "gpt2", 12, 768, 12, 8, 512, True, False),
    ("gpt2-12L-768-offload", "gpt2", 12, 768, 12, 8, 512, False, True),
    ("llama-12L-1024", "llama", 12, 1024, 16, 8, 512, False, False),
    ("llama-12L-1024-ckpt", "llama", 12, 1024, 16, 8, 512, True, False),
    ("llama-12L-1024-offload", "llama", 12, 1024, 16, 8, 512, False, True),
]


def _cuda_setup(cfg: tuple[Any, ...]) -> tuple[Any, Any, Any]:
    """Model, optimizer (wrapped by the chunk runtime when offloading) and batch, on cuda:0."""
    import torch

    import agent
    from agent.runtime import manual_plan
    from agent.testing.model_zoo import build
    from client.contract import Placement

    _, kind, layers, hidden, heads, batch, seq, ckpt, offload = cfg
    model, _ = build(kind, layers=layers, hidden=hidden, heads=heads, vocab=32000, seq=seq, seed=0)
    if ckpt:
        enable_checkpointing(model)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 32000, (batch, seq), generator=g).cuda()
    if offload:
        sizes = [p.numel() * p.element_size() for p in model.parameters()]
        chunk = max(max(sizes), -(-sum(sizes) // 16))
        plan = manual_plan(
            model,
            chunk_size_bytes=chunk,
            n_buffers=2,
            offload=lambda i, n: Placement.offloaded if i % 2 else Placement.persistent,
        )
        w = agent.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-4), plan=plan)
        return w.model, w.optimizer, x
    model.cuda()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4), x


def cuda_worker(mode: str, cfg_name: str, plan_file: str | None, out_file: str, iters: int) -> None:
    """One mode of one config in this (fresh) process; writes a JSON row to `out_file`."""
    cfg = next(c for c in CUDA_CONFIGS if c[0] == cfg_name)
    selection = None
    if mode == "planned":
        from agent.allocator import select
        from client.contract import AllocationTrace, Plan

        saved = json.loads(Path(plan_file or "").read_text())
        plan = Plan.model_validate(saved["plan"])
        trace = AllocationTrace.model_validate(saved["trace"])
        selection = select("planned", plan, trace, device="cuda:0")  # before any CUDA allocation
    import torch

    model, optimizer, x = _cuda_setup(cfg)
    if selection is not None:
        selection.attach(model)
    times = []
    for i in range(iters + 3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(time.perf_counter() - t0)
    if selection is not None and selection.allocator is not None:
        s = selection.allocator.stats()
        reserved, allocated = s.peak_reserved_bytes, s.peak_allocated_bytes
        extra = {
            "fallbacks": s.fallbacks,
            "mismatches": s.mismatches,
            "displaced": s.displaced,
            "served_at_plan": s.planned + s.persistent,
            "allocs": s.allocs,
        }
    else:
        reserved, allocated = torch.cuda.max_memory_reserved(), torch.cuda.max_memory_allocated()
        extra = {}
    Path(out_file).write_text(
        json.dumps(
            {
                "config": cfg_name,
                "mode": mode,
                "peak_reserved_bytes": reserved,
                "peak_allocated_bytes": allocated,
                "fragmentation": 1 - allocated / reserved if reserved else 0.0,
                "iteration_s_median": statistics.median(times),
                **extra,
            }
        )
    )


def cuda_profile_worker(cfg_name: str, out_file: str) -> None:
    """Profile the config's loop with the caching allocator and plan its allocations (fresh process)."""
    import agent
    from client.contract import Constraints, Plan, SolverReport, SolverStatus
    from planner_service.solver.allocation import plan_allocation

    cfg = next(c for c in CUDA_CONFIGS if c[0] == cfg_name)
    model, optimizer, x = _cuda_setup(cfg)
    trace = agent.profile(model, {"input_ids": x, "labels": x}, optimizer=optimizer, repeats=1)
    assert trace.allocation_trace is not None
    alloc = plan_allocation(trace.allocation_trace, time_limit_s=30.0)
    plan = Plan(  # only the allocation section matters to the planned allocator
        trace_hash=trace.content_hash(),
        constraints=Constraints(device_memory_bytes=trace.hardware.device_memory_bytes),
        allocation=alloc,
        solver=SolverReport(
            solver="allocation-only", solver_version="0", status=SolverStatus.unknown, solve_s=0.0
        ),
    )
    Path(out_file).write_text(
        json.dumps(
            {"plan": plan.model_dump(mode="json"), "trace": trace.allocation_trace.model_dump(mode="json")}
        )
    )


def cuda_part(args: argparse.Namespace) -> list[dict[str, Any]]:
    import torch

    if not torch.cuda.is_available():
        print("--cuda: no CUDA device here (torch.cuda.is_available() is False); GPU rows not measured")
        return []
    rows: list[dict[str, Any]] = []
    me = [sys.executable, str(Path(__file__).resolve())]
    with tempfile.TemporaryDirectory() as tmp:
        for cfg in CUDA_CONFIGS[:2] if args.quick else CUDA_CONFIGS:
            name = cfg[0]
            plan_file = str(Path(tmp) / f"{name}.plan.json")
            by_mode: dict[str, Any] = {}
            try:
                subprocess.run([*me, "--cuda-profile", name, "--out", plan_file], check=True)
                for mode in ("caching", "expandable", "planned"):
                    out = str(Path(tmp) / f"{name}.{mode}.json")
                    env = dict(os.environ)
                    if mode == "expandable":
                        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
                    subprocess.run(
                        [
                            *me,
                            "--cuda-worker",
                            mode,
                            "--config",
                            name,
                            "--plan",
                            plan_file,
                            "--out",
                            out,
                            "--iters",
                            str(args.iters),
                        ],
                        check=True,
                        env=env,
                    )
                    by_mode[mode] = json.loads(Path(out).read_text())
            except subprocess.CalledProcessError as exc:
                rows.append({"config": name, "error": str(exc)})
                print(f"{name}: failed ({exc})")
                continue
            c, e, p = by_mode["caching"], by_mode["expandable"], by_mode["planned"]
            row = {
                "config": name,
                "caching": c,
                "expandable": e,
                "planned": p,
                "target_frag": p["fragmentation"] <= 0.03
                and p["fragmentation"] < min(c["fragmentation"], e["fragmentation"]),
                "target_time_within_2pct": p["iteration_s_median"] <= 1.02 * c["iteration_s_median"],
            }
            rows.append(row)
            print(
                f"{name:24s} "
                + " | ".join(
                    f"{m} {r['peak_reserved_bytes'] / MiB:8.1f} MiB frag {r['fragmentation']:6.2%} "
                    f"{r['iteration_s_median'] * 1e3:7.1f} ms"
                    for m, r in by_mode.items()
                ),
                flush=True,
            )
    return rows


# ---------------------------------------------------------------------------------------------- main
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one profiled config, two CSVs, fewer replays")
    ap.add_argument("--skip-csv", action="store_true")
    ap.add_argument("--skip-profiled", action="store_true")
    ap.add_argument("--time-limit", type=float, default=10.0, help="allocation planner limit per trace (s)")
    ap.add_argument("--cuda", action="store_true", help="also run the GPU part (needs a CUDA device)")
    ap.add_argument("--iters", type=int, default=20, help="timed iterations per mode in the GPU part")
    ap.add_argument("--cuda-worker", help=argparse.SUPPRESS)
    ap.add_argument("--cuda-profile", help=argparse.SUPPRESS)
    ap.add_argument("--config", help=argparse.SUPPRESS)
    ap.add_argument("--plan", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.cuda_profile:
        cuda_profile_worker(args.cuda_profile, args.out)
        return
    if args.cuda_worker:
        cuda_worker(args.cuda_worker, args.config, args.plan, args.out, args.iters)
        return
    result: dict[str, Any] = {
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "cpus": os.cpu_count(),
        },
        "command": " ".join(["benchmarks/allocator.py", *sys.argv[1:]]),
        "cpu_replay": cpu_part(args),
    }
    if args.cuda:
        result["cuda"] = cuda_part(args)
    else:
        result["cuda"] = "not run (pass --cuda on a machine with a GPU)"
    save(RESULTS, result)


if __name__ == "__main__":
    main()
