"""Where a wrapped iteration's time goes: a torch.profiler timeline of plain and `agent.wrap` training steps.

`predict_vs_measure.py --breakdown` says which phase runs over its prediction; this says why. For one model it
profiles plain PyTorch and then `agent.wrap` under each device-limit fraction (the limit as predict_vs_measure
sets it: the fraction of the profiled peak), records `--steps` steps after `--warmup` with torch.profiler, and
summarises, per phase of the loop (forward, backward, step; each a `record_function` span on the training
thread):

- wall: the span's length on the training thread (CPU time until the call returned; the iteration's end is
  synchronised);
- per GPU activity (kernels, H2D, D2H, other copies), the time the GPU spent on it inside the span (the union
  of its intervals, every stream together), and GPU idle: the span's time with no GPU activity at all. A
  phase whose kernels fill little of its span is bound by the CPU (launches, the runtime's hooks, waits);
- the CPU operations with the most self time over the whole profile (which waits and allocations dominate).

On a CPU device there is no GPU activity: the spans and the CPU table only. The chrome traces (gzip) go to
`--trace-dir` for a closer look (chrome://tracing or ui.perfetto.dev).

    python benchmarks/gpu_timeline.py --device cuda:0 --kind llama --layers 8 --hidden 1024 --seq 512 \
        --batch 4 --fractions 0.45 0.7 [--trace-dir DIR]
"""

from __future__ import annotations

import argparse
import copy
import gzip
import json
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from benchmarks._results import Run, save

PHASES = ("forward", "backward", "step")
SPAN = "memplan.phase."  # record_function names of the loop's phases


def _steps(model: Any, opt: Any, batch: dict[str, torch.Tensor], n: int, device: torch.device) -> None:
    for _ in range(n):
        with record_function(SPAN + "forward"):
            loss = model(**batch).loss
        with record_function(SPAN + "backward"):
            loss.backward()
        with record_function(SPAN + "step"):
            opt.step()
            opt.zero_grad()
        if device.type == "cuda":
            torch.cuda.synchronize(device)


def timeline(model: Any, opt: Any, batch: dict[str, torch.Tensor], args: Any, device: torch.device) -> Any:
    """`args.warmup` steps, then `args.steps` steps under the profiler; the profiler."""
    _steps(model, opt, batch, args.warmup, device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        _steps(model, opt, batch, args.steps, device)
    return prof


def _union(intervals: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Length of the union of `intervals` clipped to [lo, hi]."""
    total, end = 0.0, lo
    for a, b in sorted(intervals):
        a, b = max(a, end), min(b, hi)
        if b > a:
            total += b - a
            end = b
    return total


def gpu_kind(event: dict[str, Any]) -> str | None:
    """kernel, h2d, d2h, copy (other copies and memsets), or None for a CPU-side event."""
    cat = str(event.get("cat", "")).lower()
    name = str(event.get("name", ""))
    if cat == "kernel":
        return "kernel"
    if cat in ("gpu_memcpy", "gpu_memset"):
        if "HtoD" in name:
            return "h2d"
        if "DtoH" in name:
            return "d2h"
        return "copy"
    return None


def summarise(trace: dict[str, Any], steps: int) -> dict[str, Any]:
    """Per phase, per iteration (mean over the profiled steps): wall ms, GPU-busy ms by activity and in all,
    and GPU-idle ms; from a chrome trace's complete events (microseconds)."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    gpu: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for e in events:
        kind = gpu_kind(e)
        if kind is not None:
            gpu[kind].append((float(e["ts"]), float(e["ts"]) + float(e["dur"])))
    every = [iv for ivs in gpu.values() for iv in ivs]
    out: dict[str, Any] = {}
    for phase in PHASES:
        spans = [
            (float(e["ts"]), float(e["ts"]) + float(e["dur"]))
            for e in events
            if e.get("name") == SPAN + phase and e.get("cat") == "user_annotation"
        ]
        wall = sum(b - a for a, b in spans)
        busy = {k: sum(_union(ivs, a, b) for a, b in spans) for k, ivs in gpu.items()}
        any_busy = sum(_union(every, a, b) for a, b in spans)
        out[phase] = {
            "wall_ms": wall / 1e3 / steps,
            **{f"{k}_ms": v / 1e3 / steps for k, v in sorted(busy.items())},
            "gpu_busy_ms": any_busy / 1e3 / steps,
            "gpu_idle_ms": (wall - any_busy) / 1e3 / steps,
        }
    return out


def top_cpu_ops(prof: Any, n: int) -> list[dict[str, Any]]:
    rows = sorted(prof.key_averages(), key=lambda a: a.self_cpu_time_total, reverse=True)[:n]
    return [{"name": a.key, "calls": a.count, "self_cpu_ms": a.self_cpu_time_total / 1e3} for a in rows]


def record(prof: Any, label: str, args: Any, trace_dir: Path | None) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        text = path.read_text()
    if trace_dir is not None:
        trace_dir.mkdir(parents=True, exist_ok=True)
        with gzip.open(trace_dir / f"{label}.json.gz", "wt") as f:
            f.write(text)
    phases = summarise(json.loads(text), args.steps)
    ops = top_cpu_ops(prof, args.top)
    print(f"== {label}")
    for phase, s in phases.items():
        print(f"  {phase:9s} " + " ".join(f"{k} {v:7.2f}" for k, v in s.items()))
    for o in ops[:12]:
        print(
            f"    {o['self_cpu_ms'] / args.steps:8.2f} ms/it  {o['calls'] // args.steps:6d}x  {o['name'][:70]}"
        )
    return {"label": label, "phases": phases, "top_cpu_ops": ops}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--kind", default="llama")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--fractions", nargs="+", type=float, default=[0.45, 0.7])
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--top", type=int, default=25, help="CPU operations kept, by self time")
    ap.add_argument("--trace-dir", type=Path, default=None, help="write each chrome trace here (gzip)")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "gpu_timeline.json")
    args = ap.parse_args()
    run = Run("gpu_timeline", args)

    import agent
    from agent.runtime import RuntimeOptions
    from agent.testing.model_zoo import sample_batch
    from agent.wrapping import unwrap
    from benchmarks.predict_vs_measure import build_model, release, resolve_device

    device = resolve_device(args.device)
    model, cfg = build_model(args.kind, args.layers, args.hidden, args.seq)
    batch = sample_batch(cfg, args.batch, args.seq, device=device)
    results = []
    plain = copy.deepcopy(model).to(device)
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-3, fused=True)
    trace = agent.profile(plain, batch, optimizer=opt, allocation_trace=False)
    peak = int(trace.measurements.peak_device_bytes)
    results.append(record(timeline(plain, opt, batch, args, device), "plain", args, args.trace_dir))
    del plain, opt
    release(device)
    for fraction in args.fractions:
        m = copy.deepcopy(model)
        t0 = time.perf_counter()
        run_ = agent.wrap(
            m,
            torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True),
            sample_batch=batch,
            device_memory=int(peak * fraction),
            options=RuntimeOptions(device=device),
            feedback_steps=None,
        )
        wrap_s = time.perf_counter() - t0
        try:
            label = f"wrap-{fraction:g}"
            row = record(
                timeline(run_.model, run_.optimizer, batch, args, device), label, args, args.trace_dir
            )
        finally:
            unwrap(run_)
        pol, pred = run_.plan.policy, run_.plan.predictions
        assert pol is not None and pred is not None
        row.update(
            {
                "fraction": fraction,
                "wrap_s": wrap_s,
                "modes": pol.mode_strip(),
                "offloaded_chunks": [c.index for c in pol.chunks if c.placement.value == "offloaded"],
                "predicted_ms": {
                    "iteration": pred.iteration_s * 1e3,
                    "forward": pred.forward_s * 1e3,
                    "backward": pred.backward_s * 1e3,
                    "host_step": pred.host_optimizer_s * 1e3,
                },
            }
        )
        print(
            f"  plan {row['modes']} predicted "
            + " ".join(f"{k} {v:.1f}" for k, v in row["predicted_ms"].items())
        )
        results.append(row)
        del run_, m
        release(device)
    save(args.out, run.document(device, peak_device_bytes=peak, rows=results))


if __name__ == "__main__":
    main()
