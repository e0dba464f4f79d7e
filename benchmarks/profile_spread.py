"""How steady are the profile's figures? One configuration wrapped K times in one launch of N ranks.

`predict_vs_measure.py --world-size 2` judges predictions against measurements; when a row misses, the
question is whether the prediction or the measurement moved. This benchmark answers the first half: per
launch it wraps the same model under the same limit `--wraps` times (a plain timing before each, as the
benchmark's rows do) and keeps, from rank 0, every wrap's trace (the job's, as the planner saw it) and its
plan's predicted phases. It prints the predicted iteration of each wrap and the trace fields whose values
spread the most between wraps, weighted by what they can move the prediction (a block's seconds, a probe's
seconds, a collective rate), so the noisiest inputs of the prediction are named.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/profile_spread.py --world-size 2 --kind gpt2 --fraction 0.45

Figures are written to benchmarks/results/profile_spread-<UTC time>.json.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from _ranks import launch
from _results import Run, save
from predict_vs_measure import DEFAULTS_SUFFIX, build_model, plain_iteration_s, resolve_device, solo_profile


def flatten(value: Any, prefix: str = "") -> dict[str, float]:
    """Every numeric leaf of a JSON value, keyed by its path (`blocks.3.forward_s`)."""
    out: dict[str, float] = {}
    if isinstance(value, dict):
        for k, v in value.items():
            out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out.update(flatten(v, f"{prefix}.{i}"))
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        out[prefix] = float(value)
    return out


def spread_rank(rank: int, world: int, device: torch.device, spec: dict[str, Any]) -> dict[str, Any]:
    """On every rank: the benchmark's first-row sequence (rank 0's solo profile for the limit; with
    `--peak-bytes` none, as a user's job wraps cold), then `wraps` wraps of the same model under that limit,
    each unwrapped at once (no training: only the plan is kept)."""
    import torch.distributed as dist

    import agent
    from agent.runtime import RuntimeOptions
    from agent.testing.model_zoo import sample_batch
    from agent.wrapping import unwrap

    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    os.environ.pop("MEMPLAN_SERVER", None)
    model, cfg = build_model(spec["kind"], spec["layers"], spec["hidden"], spec["seq"])
    full = sample_batch(cfg, spec["batch"], spec["seq"], device=device)
    b = spec["batch"] // world
    batch = {k: v[rank * b : (rank + 1) * b] for k, v in full.items()}
    logs: list[str] = []
    if spec.get("debug"):
        import logging

        class Keep(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                logs.append(f"{record.created:.3f} {record.name}: {record.getMessage()}")

        lg = logging.getLogger("agent")
        lg.setLevel(logging.DEBUG)
        lg.addHandler(Keep())
    box: list[Any] = [spec.get("limit_peak")]
    if rank == 0 and box[0] is None:
        box = [int(solo_profile(model, batch, device)[0].measurements.peak_device_bytes)]
    dist.broadcast_object_list(box, src=0, device=device if device.type == "cuda" else None)
    limit = int(box[0] * spec["fraction"])
    wraps: list[dict[str, Any]] = []
    for _ in range(spec["wraps"]):
        plain_s = plain_iteration_s(model, batch, device, spec["plain_steps"])
        m = copy.deepcopy(model)
        if spec.get("debug"):
            logs.append(f"{time.time():.3f} wrap starts")
        t0 = time.perf_counter()
        run = agent.wrap(
            m,
            torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True),
            sample_batch=batch,
            device_memory=limit,
            options=RuntimeOptions(device=device),
            feedback_steps=None,  # no monitor: the wrap is undone before any step
        )
        wrap_s = time.perf_counter() - t0
        unwrap(run)
        source, plan = run.source, run.plan
        assert source is not None and plan.predictions is not None and plan.policy is not None
        entry: dict[str, Any] = {
            "plain_s": plain_s,
            "wrap_s": wrap_s,
            "profiled_iteration_s": list(source.profiled_iteration_s),
            "predicted_iteration_s": plan.predictions.iteration_s,
            "modes": plan.policy.mode_strip(),
            "offloaded": [c.index for c in plan.policy.chunks if c.placement.value == "offloaded"],
            "breakdown": dict(plan.predictions.breakdown),
        }
        if rank == 0 and source.trace is not None:
            entry["trace"] = source.trace.model_dump(mode="json")
        wraps.append(entry)
        del run, m
    return {"rank": rank, "limit_bytes": limit, "wraps": wraps, "logs": logs}


def noisiest(traces: list[dict[str, Any]], top: int) -> list[dict[str, Any]]:
    """The numeric trace fields that differ between the wraps, largest relative spread first (seconds and
    rates only: sizes and counts of one configuration do not move)."""
    flat = [flatten(t) for t in traces]
    keys = set(flat[0]).intersection(*flat[1:])
    out = []
    for k in keys:
        xs = [f[k] for f in flat]
        if min(xs) == max(xs):
            continue
        mid = statistics.median(xs)
        if mid == 0:
            continue
        out.append(
            {
                "field": k,
                "min": min(xs),
                "median": mid,
                "max": max(xs),
                "spread": (max(xs) - min(xs)) / abs(mid),
            }
        )
    out.sort(key=lambda r: -r["spread"])
    return out[:top]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument(
        "--kind", default="gpt2", help=f"a zoo model, or a family at its defaults ('llama{DEFAULTS_SUFFIX}')"
    )
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--fraction", type=float, default=0.45)
    ap.add_argument("--wraps", type=int, default=4)
    ap.add_argument("--launches", type=int, default=1)
    ap.add_argument("--plain-steps", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--device", default="cpu")
    ap.add_argument(
        "--peak-bytes",
        type=int,
        default=None,
        help="the full model's peak (bytes): no solo profile of rank 0 before the wraps (a user's cold path)",
    )
    ap.add_argument("--debug", action="store_true", help="keep the profiler's debug log per rank")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "profile_spread.json")
    args = ap.parse_args()
    run = Run("profile_spread", args)
    device = resolve_device(args.device)
    spec = {
        k: getattr(args, k)
        for k in ("kind", "layers", "hidden", "seq", "batch", "fraction", "wraps", "threads")
    }
    spec["plain_steps"] = args.plain_steps
    spec["limit_peak"] = args.peak_bytes
    spec["debug"] = args.debug

    launches = []
    for n in range(args.launches):
        results = launch(spread_rank, args.world_size, {**spec, "device_type": device.type})
        rank0 = next(r for r in results if r["rank"] == 0)
        print(f"launch {n + 1}: limit {rank0['limit_bytes']} bytes")
        for i, w in enumerate(rank0["wraps"]):
            prof = ", ".join(f"{x * 1e3:.1f}" for x in w["profiled_iteration_s"])
            print(
                f"  wrap {i + 1}: plain {w['plain_s'] * 1e3:.1f} ms, profiled [{prof}] ms, predicted "
                f"{w['predicted_iteration_s'] * 1e3:.1f} ms ({w['modes']}, offloaded {w['offloaded']}), "
                f"wrap {w['wrap_s']:.1f} s"
            )
        launches.append(results)
    traces = [w["trace"] for res in launches for r in res if r["rank"] == 0 for w in r["wraps"]]
    top = noisiest(traces, args.top)
    print(f"trace fields by spread over {len(traces)} wraps ((max - min) / median):")
    for r in top:
        print(
            f"  {r['field']:<60} {r['min']:.4g} .. {r['max']:.4g} (median {r['median']:.4g}): {r['spread']:.0%}"
        )
    predicted = [
        w["predicted_iteration_s"] for res in launches for r in res if r["rank"] == 0 for w in r["wraps"]
    ]
    print(
        f"predicted iteration over {len(predicted)} wraps: {min(predicted) * 1e3:.1f} .. {max(predicted) * 1e3:.1f} ms "
        f"(median {statistics.median(predicted) * 1e3:.1f}, standard deviation "
        f"{(statistics.stdev(predicted) if len(predicted) > 1 else 0.0) * 1e3:.1f})"
    )
    if args.wraps > 1:
        first = [r["wraps"][0]["predicted_iteration_s"] for res in launches for r in res if r["rank"] == 0]
        later = [
            w["predicted_iteration_s"]
            for res in launches
            for r in res
            if r["rank"] == 0
            for w in r["wraps"][1:]
        ]
        print(
            f"first wrap of each launch: median {statistics.median(first) * 1e3:.1f} ms; later wraps: median "
            f"{statistics.median(later) * 1e3:.1f} ms"
        )
    save(args.out, run.document(device, launches=launches, noisiest=top))


if __name__ == "__main__":
    main()
