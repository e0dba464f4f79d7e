"""Benchmark of the allocation planner: MiniMalloc's challenging instances and profiled LLM iterations.

Part 1: every challenging instance A-F (tests/planner_service/solver/allocation/data/minimalloc, vendored) placed under
capacity 1048576 with a 60 s limit (the time to the first fitting placement; MiniMalloc's question),
next to the best-fit heuristic alone.
Part 2: allocation traces of real training iterations (gpt2 and llama, 24 layers, random weights,
profiled on this machine by `agent.profile`), planned with a 10 s limit: arena vs. the live-bytes lower
bound, next to PyTorch's caching allocator replayed on the same trace (`simulate_caching_allocator`).

Part 3 (`--scale`, alone): the planner at 10^5 and 10^6 events. A llama iteration profiled on this
machine (`--scale-layers`, default 8 layers, hidden 128) is replicated (`scaled_traces.replicate_trace`:
"sequential" copies one after another, and "deep", a model that many times deeper) and random traces
are drawn (`random_trace`); each is planned with the service's limits (10 s at 10^5 events, 60 s at
10^6), validated over two iterations, and replayed through the caching-allocator simulator, each step
timed. The constructive heuristics are compared on the profiled trace and a deep copy of it, and the
time limit is checked with a 1 s limit on the largest traces.

Prints a table and saves benchmarks/results/allocation-<UTC timestamp>.json (pointer: allocation-latest.json). Usage:
    .venv/bin/python benchmarks/allocation.py [--skip-traces] [--skip-instances] [--cpsat-baseline] [--ablation CF]
        [--layers 24]
    .venv/bin/python benchmarks/allocation.py --scale [--scale-sizes 100000,1000000] [--scale-layers 8]
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from pathlib import Path
from typing import Any

from _results import save

REPO = Path(__file__).resolve().parents[1]
DATA = (
    REPO / "tests" / "planner_service" / "solver" / "allocation" / "data" / "minimalloc"
)  # vendored, Apache-2.0
RESULTS = REPO / "benchmarks" / "results" / "allocation.json"
CAPACITY = 1048576


def warm_up() -> float:
    """Load (or compile, on a fresh machine) the numba search once, so timings below exclude it."""
    from planner_service.solver.allocation import search_placement

    t0 = time.perf_counter()
    search_placement([0, 1], [2, 3], [1, 1], 2)
    return time.perf_counter() - t0


def challenging(cpsat_baseline: bool) -> list[dict[str, Any]]:
    from planner_service.solver.allocation import (
        lower_bound,
        plan_buffers,
        read_minimalloc_csv,
        validate_placement,
    )
    from planner_service.solver.allocation.greedy import ORDERS, best_fit

    rows = []
    for name in "ABCDEF":
        path = DATA / f"{name}.1048576.csv"
        if not path.exists():
            print(f"{path} absent: skipped")
            continue
        buffers = read_minimalloc_csv(path)
        lows, ups, sizes = [b.lower for b in buffers], [b.upper for b in buffers], [b.size for b in buffers]
        greedy = min(
            max(o + s for o, s in zip(best_fit(lows, ups, sizes, k) or [], sizes, strict=True))
            for k in ORDERS
        )  # no deadline given: best_fit always returns offsets
        plan = plan_buffers(buffers, capacity_bytes=CAPACITY, time_limit_s=60.0, minimize=False)
        ok = plan.status.value in ("optimal", "feasible")
        if ok:
            validate_placement(buffers, plan.offsets, capacity=CAPACITY)
        row = {
            "instance": name,
            "buffers": len(buffers),
            "lower_bound": lower_bound(buffers),
            "best_fit_arena": greedy,
            "arena": plan.arena_bytes if ok else None,
            "status": plan.status.value,
            "fits": ok and plan.arena_bytes <= CAPACITY,
            "solve_s": round(plan.solve_s, 3),
            "search_nodes": plan.search_nodes,
            "method": plan.method,
        }
        if ok and plan.arena_bytes > plan.lower_bound_bytes:
            # Capacity above the bound: how far below the capacity does minimising get in 30 s?
            tight = plan_buffers(buffers, capacity_bytes=CAPACITY, time_limit_s=30.0)
            validate_placement(buffers, tight.offsets, capacity=CAPACITY)
            row["minimised_arena_30s"] = tight.arena_bytes
            row["minimised_status"] = tight.status.value
            row["minimised_proven_bound"] = tight.proven_bound_bytes
        if cpsat_baseline:
            from planner_service.solver.allocation.cpsat_baseline import cpsat_placement

            base = cpsat_placement(lows, ups, sizes, CAPACITY, time_limit_s=30.0, workers=2)
            row["cpsat_nooverlap2d_30s"] = base.status.value
            row["cpsat_s"] = round(base.elapsed_s, 2)
        rows.append(row)
        print(
            f"{name}: {row['buffers']} buffers, lower bound {row['lower_bound']}, best fit {greedy}, "
            f"planned {row['arena']} ({row['status']}), {row['solve_s']} s, {row['search_nodes']} nodes"
            + (
                f"; minimised in 30 s: {row['minimised_arena_30s']} ({row['minimised_status']})"
                if "minimised_arena_30s" in row
                else ""
            )
            + (f"; plain CP-SAT NoOverlap2D, 30 s: {row['cpsat_nooverlap2d_30s']}" if cpsat_baseline else "")
        )
    return rows


def ablation(names: str, limit_s: float) -> list[dict[str, Any]]:
    """Each pruning rule of the search switched off alone (and one preorder only), fit-at-capacity runs."""
    import dataclasses

    from planner_service.solver.allocation import SearchRules, read_minimalloc_csv, search_placement

    variants: list[tuple[str, SearchRules]] = [("all rules", SearchRules())]
    for f in dataclasses.fields(SearchRules):
        if f.name != "preorders":
            switched_off: dict[str, Any] = {f.name: False}
            variants.append((f"no {f.name}", dataclasses.replace(SearchRules(), **switched_off)))
    variants.append(("one preorder (WAT)", SearchRules(preorders=("WAT",))))
    rows = []
    for name in names:
        path = DATA / f"{name}.1048576.csv"
        if not path.exists():
            continue
        buffers = read_minimalloc_csv(path)
        args = ([b.lower for b in buffers], [b.upper for b in buffers], [b.size for b in buffers])
        for label, rules in variants:
            res = search_placement(*args, CAPACITY, time_limit_s=limit_s, rules=rules)
            rows.append(
                {
                    "instance": name,
                    "variant": label,
                    "status": res.status.value,
                    "s": round(res.elapsed_s, 2),
                    "nodes": res.nodes,
                }
            )
            print(f"ablation {name} {label}: {res.status.value}, {res.elapsed_s:.2f} s, {res.nodes} nodes")
    return rows


def traces(layers: int, hidden: int, batch: int, seq: int) -> list[dict[str, Any]]:
    import agent
    from agent.testing import model_zoo
    from planner_service.solver.allocation import (
        plan_allocation,
        simulate_caching_allocator,
        validate_allocation,
    )

    rows = []
    for kind in ("gpt2", "llama"):
        model, config = model_zoo.build(kind, layers, hidden, seq=seq)
        sample = model_zoo.sample_batch(config, batch, seq)
        t0 = time.perf_counter()
        tr = agent.profile(model, sample, repeats=1, name=f"{kind}-{layers}L-{hidden}H")
        profile_s = time.perf_counter() - t0
        at = tr.allocation_trace
        assert at is not None
        plan = plan_allocation(at, time_limit_s=10.0)
        validate_allocation(at, plan)
        sim = simulate_caching_allocator(at, iterations=2)
        row = {
            "model": f"{kind} {layers} layers, hidden {hidden}, batch {batch}, seq {seq}",
            "trace_source": at.source,
            "device": tr.hardware.device_type.value,
            "events": len(at.events),
            "long_lived": sum(e.free_index is None for e in at.events),
            "horizon": at.horizon,
            "lower_bound": plan.lower_bound_bytes,
            "arena": plan.arena_bytes,
            "gap": round(plan.gap, 6),
            "status": plan.status.value,
            "solve_s": round(plan.solve_s, 3),
            "profile_s": round(profile_s, 1),
            "caching_peak_reserved": sim.peak_reserved_bytes,
            "caching_peak_allocated": sim.peak_allocated_bytes,
            "caching_fragmentation": round(sim.fragmentation_ratio, 4),
            "caching_over_lower_bound": round(sim.peak_reserved_bytes / plan.lower_bound_bytes - 1, 4),
            "caching_segments": sim.segments_allocated,
            "caching_small_large": [sim.small_segments_allocated, sim.large_segments_allocated],
        }
        rows.append(row)
        print(
            f"{kind}: {row['events']} buffers ({row['long_lived']} long-lived), lower bound {row['lower_bound']}, "
            f"arena {row['arena']} (gap {row['gap']:.4%}, {row['status']}, {row['solve_s']} s); caching allocator "
            f"reserved {row['caching_peak_reserved']} (fragmentation {row['caching_fragmentation']:.2%}, "
            f"{row['caching_over_lower_bound']:.2%} over the bound, {row['caching_segments']} segments)"
        )
    return rows


def heuristics(trace: Any, label: str) -> list[dict[str, Any]]:
    """Gap of each constructive placement alone (no search) on one trace's iteration buffers."""
    import numpy as np

    from planner_service.solver.allocation.greedy import ORDERS, best_fit
    from planner_service.solver.allocation.intervals import peak_live, trace_arrays
    from planner_service.solver.allocation.sweep_fit import sweep_best_fit

    arr = trace_arrays(trace)
    it = ~arr.long_lived
    lo, up = arr.alloc[it], arr.free[it]
    units = -(-arr.sizes[it] // 512)
    lb = peak_live(lo, up, units)
    runs: list[tuple[str, Any]] = [
        ("sweep best fit, forward (O(n log n))", lambda: sweep_best_fit(lo, up, units)),
        ("sweep best fit, backward (O(n log n))", lambda: sweep_best_fit(lo, up, units, reverse=True)),
    ]
    for order in ORDERS:
        runs.append(
            (
                f"best fit by {order} (quadratic)",
                lambda order=order: np.asarray(best_fit(lo.tolist(), up.tolist(), units.tolist(), order)),
            )
        )
    rows = []
    for name, fn in runs:
        t0 = time.perf_counter()
        offsets = fn()
        elapsed = time.perf_counter() - t0
        gap = int((offsets + units).max()) / lb - 1
        rows.append(
            {
                "trace": label,
                "buffers": int(it.sum()),
                "heuristic": name,
                "gap_padded": round(gap, 6),
                "s": round(elapsed, 3),
            }
        )
        print(f"{label}: {name}: gap {gap:.4%} over the padded bound, {elapsed:.2f} s")
    return rows


def scale(sizes: list[int], layers: int, hidden: int, batch: int, seq: int) -> dict[str, Any]:
    import agent
    from agent.testing import model_zoo
    from planner_service.solver.allocation import (
        plan_allocation,
        simulate_caching_allocator,
        validate_allocation,
    )
    from planner_service.solver.allocation.scaled_traces import random_trace, replicate_trace

    model, config = model_zoo.build("llama", layers, hidden, seq=seq)
    tr = agent.profile(model, model_zoo.sample_batch(config, batch, seq), repeats=1)
    base = tr.allocation_trace
    assert base is not None
    out: dict[str, Any] = {
        "base": f"llama {layers} layers, hidden {hidden}, batch {batch}, seq {seq}: "
        f"{len(base)} events, horizon {base.horizon}, source {base.source}"
    }
    print(out["base"])
    out["heuristics"] = heuristics(base, "profiled llama")
    deep_k = max(1, 15_000 // len(base))
    out["heuristics"] += heuristics(
        replicate_trace(base, deep_k, layout="deep"), f"profiled llama, deep x{deep_k}"
    )
    out["heuristics"] += heuristics(random_trace(15_000, seed=1), "random 15k")
    rows = []
    for n in sizes:
        limit = 10.0 if n <= 100_000 else 60.0
        for kind in ("sequential", "deep", "random"):
            t0 = time.perf_counter()
            trace = (
                random_trace(n, seed=0)
                if kind == "random"
                else replicate_trace(base, max(1, round(n / len(base))), layout=kind)
            )  # type: ignore[arg-type]
            build_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            plan = plan_allocation(trace, time_limit_s=limit)
            plan_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            validate_allocation(trace, plan)
            validate_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            sim = simulate_caching_allocator(trace, iterations=2)
            sim_s = time.perf_counter() - t0
            row = {
                "trace": f"{kind} {len(trace)}",
                "events": len(trace),
                "time_limit_s": limit,
                "plan_wall_s": round(plan_s, 2),
                "status": plan.status.value,
                "gap": round(plan.gap, 6),
                "validate_s": round(validate_s, 2),
                "simulate_s": round(sim_s, 2),
                "build_s": round(build_s, 2),
                "caching_fragmentation": round(sim.fragmentation_ratio, 4),
                "caching_over_lower_bound": round(sim.peak_reserved_bytes / plan.lower_bound_bytes - 1, 4),
            }
            rows.append(row)
            print(
                f"{row['trace']}: plan {plan_s:.2f} s (limit {limit:g}), {plan.status.value}, gap {plan.gap:.4%}; "
                f"validate {validate_s:.2f} s; caching allocator replay {sim_s:.2f} s "
                f"(fragmentation {sim.fragmentation_ratio:.2%}, {row['caching_over_lower_bound']:.2%} over the bound)"
            )
            if n == max(sizes) and kind != "sequential":
                t0 = time.perf_counter()
                short = plan_allocation(trace, time_limit_s=1.0)
                short_s = time.perf_counter() - t0
                row["one_second_limit"] = {
                    "plan_wall_s": round(short_s, 2),
                    "status": short.status.value,
                    "gap": round(short.gap, 6),
                }
                print(f"  with a 1 s limit: {short_s:.2f} s, {short.status.value}, gap {short.gap:.4%}")
            del trace, plan
    out["runs"] = rows
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-traces", action="store_true")
    parser.add_argument("--skip-instances", action="store_true")
    parser.add_argument("--cpsat-baseline", action="store_true", help="also run plain CP-SAT, 30 s each")
    parser.add_argument("--ablation", default="", help="instances for the rule ablation, e.g. CF (20 s each)")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--scale", action="store_true", help="run only the scale part (10^5, 10^6 events)")
    parser.add_argument("--scale-sizes", default="100000,1000000")
    parser.add_argument("--scale-layers", type=int, default=8)
    parser.add_argument("--scale-hidden", type=int, default=128)
    args = parser.parse_args()
    # One file per run, holding the parts this run ran (earlier runs keep their own files).
    out: dict[str, Any] = {"benchmark": "allocation", "args": vars(args)}
    out["machine"] = (
        f"{platform.processor() or platform.machine()}, {platform.system()}, {os.cpu_count()} cores"
    )
    out["numba_load_s"] = round(warm_up(), 2)
    print(f"numba search load/compile: {out['numba_load_s']} s")
    if args.scale:
        out["scale"] = scale(
            [int(v) for v in args.scale_sizes.split(",")], args.scale_layers, args.scale_hidden, 4, 128
        )
        out["scale"]["machine_load_1min"] = os.getloadavg()[0]
        save(RESULTS, out)
        return
    if not args.skip_instances:
        out["challenging"] = challenging(args.cpsat_baseline)
    if args.ablation:
        out["ablation"] = ablation(args.ablation, 20.0)
    if not args.skip_traces:
        out["traces"] = traces(args.layers, args.hidden, args.batch, args.seq)
    save(RESULTS, out)


if __name__ == "__main__":
    main()
