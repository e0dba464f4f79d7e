"""Benchmark: the plan's predicted iteration time and peak memory against what the runtime measures.

For each model (gpt2 and llama from transformers configs as the zoo builds them, and `--library-defaults`
families, default qwen2 and gemma2, built as users load them: KV cache on, SDPA or the family's attention,
tied embeddings where the family ties them; random weights; `--layers`, default 4 12 24)
the job is profiled once (`agent.profile`, the real trace), then for each device limit (`--fractions` of
the trace's measured un-managed peak) the CP-SAT plan is solved in-process, applied with the one-call
path (`agent.wrap(..., plan=...)`: chunk runtime + activation modes + step monitor), and
trained for `--steps` steps on the profiled batch: 2 warm-up steps, 1 step under the device-memory meter
(the profiler's storage tracker on CPU, `max_memory_allocated` on CUDA: the same semantics as the
trace's peak), the rest timed (median; the default `--steps 20` times 17 steps). Errors are measured /
predicted - 1. Before the rows the first configuration is profiled once and thrown away (process warm-up:
without it the first trace carried one-time costs and read ~10% slow).

Fair device peaks (issue 19 defect 7): the reference model stays on the CPU (only the profiled copy, the
plain timing copy and the wrapped copy go to the device, one at a time), `gc.collect()` and
`torch.cuda.empty_cache()` run before each of them, and on CUDA the measured peak has the bytes already
allocated on the device when the row starts (other than its batch) subtracted (`device_bytes_at_start`).
`--device cuda` means `cuda:0`.

Targets (issue 7): peak memory never more than 2% above the prediction and at most 8% below it;
iteration time within 10%.

On a machine shared with other jobs the iteration time swings with their load, between the profile (which
measured the compute times the prediction is built from) and the managed run. So each row also re-times
plain iterations (median of `--plain-steps` after one warm-up) right before the managed run (`plain_now_s`)
and right after it (`plain_after_s`), and reports `load_drift` = plain_now / trace iteration - 1 and
`drift_after` = plain_after / trace iteration - 1; a large drift means the time comparison of that row says
more about the machine than about the model. The errors are not corrected for drift. The load average is
recorded, and the summary names the worst row.

`--trials N` repeats everything N times (each trial builds, profiles, plans and runs every configuration
afresh) and reports each trial's summary and, per configuration, the median iteration error over the trials
and the worst peak error of any trial. On a quiet 2-core VM two plain runs of the same model in one process
differ by up to ~8%; one trial samples that once per row, the median of three samples it three times.

`--world-size N` (N > 1; issue 20): the job runs on N fresh ranks (`benchmarks/_ranks.py`: spawned
processes, gloo on the CPU, NCCL with rank r on `cuda:r`), each trial one launch, the global `--batch` split
evenly over the ranks. Per configuration rank 0 profiles once (`agent.profile`, its own rows of the batch)
for the limit (a fraction of that un-managed peak, broadcast; this profile is also the process's warm-up,
so `--no-warmup` changes nothing here), then per fraction every rank calls `agent.wrap(model, optimizer,
sample_batch=<its rows>, device_memory=limit)` under the group: every rank profiles its own rows at once, rank 0
solves the slowest rank's trace (in-process: MEMPLAN_SERVER is ignored; each row records every rank's
`profiled_iteration_s`) and broadcasts the plan, every rank applies it and trains `--steps` steps under
wrap's own monitor. Each rank's row compares ITS measured peak (the monitor's meter on that rank) and ITS
median iteration with the plan's predictions, which are one rank's: a row per (configuration, rank).
Plain iterations before and after (the drift) run on every rank at once, un-wrapped and without
communication, against the trace's iteration (the slowest rank's, all ranks profiling at once). Whatever
the plan says is run: on a CPU the solver replicates offloaded chunks while the node's host memory has room
(there a replicated chunk is the faster one); `--host-fraction F` limits the node's host memory to F times
what the ranks' replicated chunks would hold, so that it must shard them across the ranks (each row records
`sharded_chunks`, `plan_world_size` and `host_limit_bytes`).
A fraction with no feasible plan is a row with the solver's reason, on every rank.

Usage: .venv/bin/python benchmarks/predict_vs_measure.py [--hidden 128] [--seq 128] [--batch 4]
       [--layers 4 12 24] [--fractions 0.45 0.7 1.0] [--steps 20] [--plain-steps 5] [--kinds gpt2 llama]
       [--library-defaults qwen2 gemma2] [--device cpu|cuda] [--trials N] [--world-size N [--host-fraction F]]
Prints a table and writes benchmarks/results/predict_vs_measure-<UTC timestamp>.json (and the
-latest pointer). Each row records its plan's offloaded
chunks (`offloaded_chunks`, with `chunk_size_bytes`, `n_buffers` and `modes`), so an outlier can be re-run.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import os
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from _ranks import launch
from _results import Run, save

RESULTS = Path(__file__).resolve().parent / "results" / "predict_vs_measure.json"
DEFAULTS_SUFFIX = "-dflt"  # a `--library-defaults` family's rows: "qwen2-dflt"
NO_PLAN_FROM_RANK_0 = "memplan: rank 0 could not obtain the plan"  # what wrap raises on the other ranks


def resolve_device(name: str) -> torch.device:
    """`cuda` -> `cuda:0` (an indexed device: un-indexed, it compares unequal to the runtime's cuda:0)."""
    device = torch.device(name)
    return torch.device("cuda", 0) if device.type == "cuda" and device.index is None else device


def release(device: torch.device) -> None:
    """Free what the last copy left: Python garbage, then (CUDA) the caching allocator's unused blocks."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def foreign_device_bytes(device: torch.device, batch: dict[str, torch.Tensor]) -> int:
    """Bytes allocated on the device now that are not the batch's (0 on CPU): what a peak must not count."""
    if device.type != "cuda":
        return 0
    release(device)
    batch_bytes = sum(t.numel() * t.element_size() for t in batch.values() if t.device.type == "cuda")
    return max(0, int(torch.cuda.memory_allocated(device)) - batch_bytes)


def plain_iteration_s(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], device: torch.device, n: int
) -> float:
    m = copy.deepcopy(model).to(device)  # the reference stays on the CPU
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True)
    times = []
    for i in range(n + 1):
        t0 = time.perf_counter()
        m(**batch).loss.backward()
        opt.step()
        opt.zero_grad()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i:
            times.append(time.perf_counter() - t0)
    del m, opt
    release(device)
    return statistics.median(times)


def run_row(
    model: torch.nn.Module,
    batch: dict[str, torch.Tensor],
    trace: Any,
    fraction: float,
    steps: int,
    device: torch.device,
    plain_steps: int,
    breakdown: bool = False,
) -> dict[str, Any]:
    from agent.runtime import RuntimeOptions
    from agent.runtime.options import job_trace
    from agent.wrapping import unwrap, wrap
    from client.contract import Constraints
    from planner_service.solver import solve

    limit = int(trace.measurements.peak_device_bytes * fraction)
    options = RuntimeOptions(device=device)  # one set of options: the job planned is the job run
    t0 = time.perf_counter()
    # planned for the job the runtime runs (fp32 master, undo backups), as `agent.wrap` plans
    plan = solve(job_trace(trace, options), Constraints(device_memory_bytes=limit, time_limit_s=10.0))
    solve_s = time.perf_counter() - t0
    row: dict[str, Any] = {
        "fraction": fraction,
        "limit_bytes": limit,
        "solve_s": solve_s,
        "status": plan.solver.status.value,
    }
    if plan.policy is None or plan.predictions is None:
        row["min_device_memory_bytes"] = plan.solver.min_device_memory_bytes
        return row
    row["plain_now_s"] = plain_iteration_s(model, batch, device, plain_steps)
    at_start = foreign_device_bytes(device, batch)
    m = copy.deepcopy(model)  # on the CPU: wrap places it on `device`
    run = wrap(
        m,
        torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True),
        plan=plan,
        feedback_steps=steps,
        options=options,
    )
    try:
        measured_phases = train_steps(run, batch, steps, breakdown)
        rep = run.report()
    finally:
        unwrap(run)
    del run, m
    release(device)
    row["plain_after_s"] = plain_iteration_s(model, batch, device, plain_steps)
    meas = rep.measured
    assert meas is not None
    measured_peak = meas.peak_device_bytes - at_start
    pred = plan.predictions
    p = plan.policy
    row.update(
        {
            "modes": p.mode_strip(),
            "chunks": len(p.chunks),
            "offloaded": sum(c.placement.value == "offloaded" for c in p.chunks),
            # the plan itself, so an outlier can be re-run: which chunks were offloaded, and the chunk size that
            # (with the trace's parameter order) gives every chunk's parameters
            "offloaded_chunks": [c.index for c in p.chunks if c.placement.value == "offloaded"],
            "chunk_size_bytes": p.chunk_size_bytes,
            "n_buffers": p.n_buffers,
            "predicted_iteration_s": pred.iteration_s,
            "measured_iteration_s": meas.iteration_s,
            "iteration_error": meas.iteration_s / pred.iteration_s - 1.0,
            "predicted_peak_device_bytes": pred.peak_device_bytes,
            "measured_peak_device_bytes": measured_peak,
            "device_bytes_at_start": at_start,
            "peak_error": measured_peak / pred.peak_device_bytes - 1.0,
            "predicted_peak_host_bytes": pred.peak_host_bytes,
            "measured_peak_host_bytes": meas.peak_host_bytes,
            "trace_iteration_s": trace.measurements.iteration_s,
            "load_drift": row["plain_now_s"] / trace.measurements.iteration_s - 1.0,
            "drift_after": row["plain_after_s"] / trace.measurements.iteration_s - 1.0,
            "steps_timed": meas.steps_measured,
            "swap_late_fetches": rep.swap.late_fetches if rep.swap else 0,
            "swap_demand_fetches": rep.swap.demand_fetches if rep.swap else 0,
        }
    )
    if measured_phases is not None:
        row["breakdown"] = {
            **measured_phases,
            "predicted_ms": predicted_phases(pred),
            "predicted_uploads": pred.breakdown.get("uploads_per_iteration"),
        }
    return row


def _ranges(xs: list[int]) -> str:
    """Chunk indices as ranges: [0, 1, 2, 5] -> "0-2,5" (empty: "-")."""
    out: list[str] = []
    for x in xs:
        if out and out[-1].split("-")[-1] == str(x - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{x}"
        else:
            out.append(str(x))
    return ",".join(out) or "-"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kinds", nargs="+", default=["gpt2", "llama"])
    ap.add_argument(
        "--library-defaults",
        nargs="*",
        default=["qwen2", "gemma2"],
        help="families built at their library defaults (agent.testing.model_zoo.DEFAULTS_FAMILIES); none: skip",
    )
    ap.add_argument("--layers", nargs="+", type=int, default=[4, 12, 24])
    ap.add_argument("--fractions", nargs="+", type=float, default=[0.45, 0.7, 1.0])
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument(
        "--steps",
        type=int,
        default=20,
        help="managed steps per row: 2 warm-up, 1 under the memory meter, the rest timed (median)",
    )
    ap.add_argument(
        "--plain-steps", type=int, default=5, help="plain iterations timed before and after each row"
    )
    ap.add_argument(
        "--no-warmup",
        dest="warmup",
        action="store_false",
        help="skip the throw-away profile of the first configuration before the rows",
    )
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (1: steadier timings on a shared machine; 0: torch's default)",
    )
    ap.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda[:N]"
    )
    ap.add_argument(
        "--trials",
        type=int,
        default=1,
        help="repeat every configuration (fresh build, profile, plan, run) and also report per "
        "configuration the median iteration error and the worst peak error",
    )
    ap.add_argument(
        "--world-size",
        type=int,
        default=1,
        help="ranks (N > 1: each trial launches N ranks that train through agent.wrap under one group; "
        "gloo on the CPU, NCCL with rank r on cuda:r; the global --batch split evenly)",
    )
    ap.add_argument(
        "--breakdown",
        action="store_true",
        help="also time each managed step's phases (forward, backward, step, zero_grad), the runtime's timing "
        "sections and collectives (counters) per iteration, beside the plan's terms: a row's `breakdown`, "
        "printed under it (adds a few microseconds per runtime section)",
    )
    ap.add_argument(
        "--host-fraction",
        type=float,
        default=None,
        help="--world-size N > 1: limit each row's node host memory to this fraction of N times the host bytes a "
        "single-process plan of the same trace and device limit predicts (what N ranks of replicated chunks "
        "hold): below ~1 the solver must shard offloaded chunks across the ranks (on a CPU it replicates them "
        "when the host has room, as they are faster there). Default: the machine's host memory",
    )
    ap.add_argument(
        "--whole-model-probe",
        action="store_true",
        help="run the offloaded whole-model probe (agent/profiler/offload_probe.py) in every CPU profile: sets "
        "MEMPLAN_WHOLE_MODEL_PROBE=1 for this process and its ranks (by default it runs in jobs of several ranks "
        "only, for its profile time)",
    )
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    if args.whole_model_probe:
        from agent.profiler import offload_probe

        os.environ[offload_probe.ENV] = "1"  # before the ranks start: they inherit it
    if args.world_size < 1:
        ap.error(f"--world-size: must be at least 1, got {args.world_size}")
    if args.batch % args.world_size:
        ap.error(f"--batch: {args.batch} rows do not split evenly over --world-size {args.world_size}")
    if args.host_fraction is not None and (args.world_size < 2 or not args.host_fraction > 0):
        ap.error(f"--host-fraction: needs --world-size > 1 and a positive fraction, got {args.host_fraction}")

    from agent.testing.model_zoo import build, sample_batch

    device = resolve_device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.world_size > 1:
        # the parent only launches the ranks and prints: it neither profiles nor touches CUDA
        args.warmup = False
    if args.warmup:
        # one-time costs of a process (first use of the profiler's dispatch tracker, allocator growth, thread
        # pools) would otherwise land in the first configuration's trace: profile it once and throw that away
        model, cfg = build(args.kinds[0], args.layers[0], args.hidden, seq=max(args.seq, 128))
        batch = sample_batch(cfg, args.batch, args.seq, device=device)
        solo_profile(model, batch, device)
        plain_iteration_s(model, batch, device, args.plain_steps)
        del model, batch
        release(device)
    rows: list[dict[str, Any]] = []
    run = Run("predict_vs_measure", args)
    distributed = args.world_size > 1
    header = (
        f"{'model':<16} {'rank ' if distributed else ''}{'lim':>5} {'modes':<26} {'off':>5} {'pred ms':>9} "
        f"{'meas ms':>9} {'err':>7} {'drift':>7} {'after':>7} {'pred MiB':>9} {'meas MiB':>9} {'err':>7}  "
        "offloaded chunks"
    )
    kinds = [*args.kinds, *(f"{f}{DEFAULTS_SUFFIX}" for f in args.library_defaults)]
    for trial in range(args.trials):
        if args.trials > 1:
            print(f"trial {trial + 1} of {args.trials}")
        print(header, flush=True)
        if distributed:
            rows += measure_trial_on_ranks(kinds, args, device, trial)
            continue
        for kind in kinds:
            for layers in args.layers:
                rows += measure_model(kind, layers, args, device, trial)
    trials = [summarize([r for r in rows if r["trial"] == t]) for t in range(args.trials)]
    for t, summary in enumerate(trials):
        print(("" if args.trials == 1 else f"trial {t + 1}: ") + summary_line(summary))
    combined = combine_trials(rows) if args.trials > 1 else None
    if combined is not None:
        print(
            f"over {args.trials} trials (per configuration: median iteration error, worst peak error): "
            + summary_line(combined["summary"])
        )
    print(
        "headline: iteration within 10% per trial "
        + " / ".join(str(t["iteration_within_10pct"]) for t in trials)
        + (
            f", by the median of {args.trials}: {combined['summary']['iteration_within_10pct']}"
            if combined
            else ""
        )
        + f" of {trials[0]['rows'] if trials else 0}"
        + f"; peak more than 2% over the prediction in {sum(t['peak_above_2pct'] for t in trials)} of "
        + f"{sum(t['rows'] for t in trials)} {'rank-rows' if args.world_size > 1 else 'rows'} (every trial)"
    )
    load = os.getloadavg()
    print(
        f"load average (1/5/15 min) before {'/'.join(f'{x:.2f}' for x in run.load_before)}, "
        f"after {'/'.join(f'{x:.2f}' for x in load)}"
    )
    save(
        args.out,
        run.document(
            device,
            summary=trials[0] if args.trials == 1 else combined["summary"],
            headline=headline(trials, combined),
            trials=trials,
            combined=combined,
            rows=rows,
        ),
    )


def measure_model(
    kind: str, layers: int, args: argparse.Namespace, device: torch.device, trial: int
) -> list[dict[str, Any]]:
    """Profile one model (a fresh build and trace), then one row per device-memory fraction."""
    from agent.testing.model_zoo import sample_batch

    model, cfg = build_model(kind, layers, args.hidden, args.seq)  # the reference stays on the CPU
    batch = sample_batch(cfg, args.batch, args.seq, device=device)
    release(device)
    trace, profile_s = solo_profile(model, batch, device)
    release(device)
    rows = []
    for fraction in args.fractions:
        row = {
            "trial": trial,
            "kind": kind,
            "layers": layers,
            "profile_s": profile_s,
            **run_row(model, batch, trace, fraction, args.steps, device, args.plain_steps, args.breakdown),
        }
        rows.append(row)
        print_row(row)
    return rows


def _pct(x: float | None, digits: int = 1) -> str:
    return f"{'-':>7}" if x is None else f"{x:>+7.{digits}%}"


def print_row(row: dict[str, Any]) -> None:
    """One row of the table (a rank column when the row is one rank's)."""
    name = f"{row['kind']}-{row['layers']}L"
    rank = f"{row['rank']:>4} " if "rank" in row else ""
    fraction = row["fraction"]
    if "modes" not in row:
        why = row.get("error") or f"fits from {row.get('min_device_memory_bytes')}"
        print(f"{name:<16} {rank}{fraction:>5.2f} {row['status']}: {why}", flush=True)
        return
    mib = 2**20
    print(
        f"{name:<16} {rank}{fraction:>5.2f} {row['modes']:<26} {row['offloaded']:>2}/{row['chunks']:<2} "
        f"{row['predicted_iteration_s'] * 1e3:>9.1f} {row['measured_iteration_s'] * 1e3:>9.1f} "
        f"{row['iteration_error']:>+7.1%} {_pct(row.get('load_drift'))} {_pct(row.get('drift_after'))} "
        f"{row['predicted_peak_device_bytes'] / mib:>9.2f} {row['measured_peak_device_bytes'] / mib:>9.2f} "
        f"{row['peak_error']:>+7.2%}  {_ranges(row['offloaded_chunks'])}"
        + (f" ({row['sharded_chunks']} sharded)" if row.get("sharded_chunks") else ""),
        flush=True,
    )
    if "breakdown" in row:
        print("    " + breakdown_line(row["breakdown"]), flush=True)


# ----------------------------------------------------------------------------------- per-phase breakdown (opt-in)
MOVES = ("upload", "evict", "flush", "swap_out", "swap_in", "swap_prefetch")
"""Runtime sections summed at every depth (a flush runs inside an evict inside a gradient hook); the entry
points (`agent.runtime.timing.ENTRY_POINTS`) are summed where torch called them (depth 0)."""
COUNTER_SECONDS = (
    "host_step_s",
    "grad_reduction_s",
    "grad_fill_s",
    "param_gather_s",
    "compute_barrier_s",
    "control_s",
)


def train_steps(
    run: Any, batch: dict[str, torch.Tensor], steps: int, breakdown: bool
) -> dict[str, Any] | None:
    """`steps` managed training steps; with `breakdown`, per iteration over the steps after the first third (at
    least 1 warm-up): the median wall time of each phase, the runtime's sections (mean ms) and the seconds and
    counts of its counters (mean), as measured on this rank."""
    if not breakdown:
        for _ in range(steps):
            run.model(**batch).loss.backward()
            run.optimizer.step()
            run.optimizer.zero_grad()
        return None
    warm = max(1, steps // 3)
    by_phase: dict[str, defaultdict[str, float]] = {
        p: defaultdict(float) for p in ("forward", "backward", "step", "zero_grad")
    }
    phase = ["forward"]  # the phase the loop is in (a section is charged to the phase it ends in)

    def listen(name: str, seconds: float, depth: int) -> None:
        if depth == 0 or name in MOVES:
            by_phase[phase[0]][name] += seconds

    phases: dict[str, list[float]] = {
        "forward": [],
        "backward": [],
        "step": [],
        "zero_grad": [],
        "iteration": [],
    }
    counters = run.runtime.counters
    before = dataclasses.replace(counters)
    handle = None
    try:
        for i in range(steps):
            if i == warm:
                handle = run.runtime.timing.add_listener(listen)
                before = dataclasses.replace(counters)
            phase[0] = "forward"
            t0 = time.perf_counter()
            loss = run.model(**batch).loss
            t1 = time.perf_counter()
            phase[0] = "backward"
            loss.backward()
            t2 = time.perf_counter()
            phase[0] = "step"
            run.optimizer.step()
            t3 = time.perf_counter()
            phase[0] = "zero_grad"
            run.optimizer.zero_grad()
            t4 = time.perf_counter()
            if i >= warm:
                for k, v in zip(phases, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0), strict=True):
                    phases[k].append(v)
    finally:
        if handle is not None:
            handle.remove()
    n = steps - warm
    sections: defaultdict[str, float] = defaultdict(float)  # every phase's together
    for secs in by_phase.values():
        for k, v in secs.items():
            sections[k] += v
    delta = {
        f.name: getattr(counters, f.name) - getattr(before, f.name) for f in dataclasses.fields(counters)
    }
    return {
        "iterations": n,
        "measured_ms": {k: statistics.median(v) * 1e3 for k, v in phases.items()},
        "sections_ms": {k: v / n * 1e3 for k, v in sorted(sections.items())},
        # the same sections by the phase of the loop they ended in (host-worker sections: the phase they ended in)
        "sections_by_phase_ms": {
            p: {k: v / n * 1e3 for k, v in sorted(secs.items())} for p, secs in by_phase.items() if secs
        },
        "counters_ms": {k.removesuffix("_s"): delta[k] / n * 1e3 for k in COUNTER_SECONDS},
        "counters": {k: v / n for k, v in delta.items() if k not in COUNTER_SECONDS and v},
    }


def predicted_phases(pred: Any) -> dict[str, float]:
    """The plan's terms in ms, named as the measured ones (multi-rank terms where the plan has them).
    `backward`: backward and the host work that ends after it (on a CPU the host worker runs inline, inside
    `loss.backward()`: `.grad` all-gathers, host steps); `step`: the device steps and what optimizer.step()
    adds (private compute-copy all-gathers or the node-shared copies' barrier: `host_collective_s`, measured as
    `param_gather` + `compute_barrier`; steps redone for clipping)."""
    b = pred.breakdown
    ms = lambda s: s * 1e3  # noqa: E731
    return {
        "iteration": ms(pred.iteration_s),
        "forward": ms(pred.forward_s),
        # the control checks run at backward's start and end (inside it)
        "backward": ms(
            max(pred.backward_s, b["host_optimizer_end_s"] - pred.device_optimizer_s)
            + b.get("control_collective_s", 0.0)
        ),
        # plus (policy-1.11) what optimizer.step()'s checks of the exposed `.grad` add after backward and the host
        # steps: the agent's feedback's `step_s` as the plan predicts it
        "step": ms(pred.phases()["step_s"]),
        "host_step": ms(pred.host_optimizer_s),
        "grad_reduction": ms(b.get("backward_collective_s", 0.0)),
        "grad_fill": ms(b.get("grad_fill_collective_s", 0.0)),
        "param_gather": ms(b.get("host_collective_s", 0.0)),
        "control": ms(b.get("control_collective_s", 0.0)),
    }


def _count(x: float | None) -> str:
    return "-" if x is None else f"{x:g}"  # a plan from before policy-1.9 does not say


def breakdown_line(bd: dict[str, Any]) -> str:
    """measured / predicted ms per iteration, phase by phase (see `predicted_phases`)."""
    m, p, c, sec = bd["measured_ms"], bd["predicted_ms"], bd["counters_ms"], bd["sections_ms"]
    return (
        f"ms measured/predicted: iteration {m['iteration']:.1f}/{p['iteration']:.1f}; forward "
        f"{m['forward']:.1f}/{p['forward']:.1f}; backward with host work {m['backward']:.1f}/{p['backward']:.1f} "
        f"(gradient reductions {c['grad_reduction']:.1f}/{p['grad_reduction']:.1f}, .grad all-gathers "
        f"{c['grad_fill']:.1f}/{p['grad_fill']:.1f}, host steps {c['host_step']:.1f}/{p['host_step']:.1f}, "
        f"control checks {c.get('control', 0.0):.1f}/{p.get('control', 0.0):.1f}; "
        f"flush sections {sec.get('flush', 0.0):.1f}, uploads {sec.get('upload', 0.0):.1f}; chunk uploads per "
        f"iteration {bd['counters'].get('uploads', 0.0):g}/{_count(bd.get('predicted_uploads'))}); step "
        f"{m['step']:.1f}/{p['step']:.1f} (compute-copy all-gathers or barrier "
        f"{c['param_gather'] + c['compute_barrier']:.1f}/{p['param_gather']:.1f}); zero_grad {m['zero_grad']:.1f}"
    )


# ------------------------------------------------------------------------------------------ N ranks (issue 20)
def measure_trial_on_ranks(
    kinds: list[str], args: argparse.Namespace, device: torch.device, trial: int
) -> list[dict[str, Any]]:
    """One trial on `--world-size` fresh ranks: every configuration, every fraction, a row per rank."""
    spec = {
        "device_type": device.type,
        "kinds": kinds,
        "layers": args.layers,
        "fractions": args.fractions,
        "hidden": args.hidden,
        "seq": args.seq,
        "batch": args.batch,
        "steps": args.steps,
        "plain_steps": args.plain_steps,
        "threads": args.threads,
        "breakdown": args.breakdown,
        "host_fraction": args.host_fraction,
    }
    results = launch(measure_rank, args.world_size, spec)
    failed = [r for r in results if "skipped" in r]
    if failed:
        print(f"trial {trial + 1}: " + "; ".join(r["skipped"] for r in failed), flush=True)
        return [{"trial": trial, "failed": r["skipped"]} for r in failed]
    rows = []
    # rank-major from the ranks; printed and kept configuration-major, ranks side by side
    for i in range(len(results[0]["rows"])):
        for res in results:
            row = {"trial": trial, **res["rows"][i]}
            rows.append(row)
            print_row(row)
    return rows


def build_model(kind: str, layers: int, hidden: int, seq: int) -> tuple[torch.nn.Module, Any]:
    """A zoo model, or a family at its library defaults (`qwen2-dflt`); random weights, the same on every rank."""
    from agent.testing.model_zoo import build, build_with_library_defaults

    if kind.endswith(DEFAULTS_SUFFIX):
        return build_with_library_defaults(
            kind.removesuffix(DEFAULTS_SUFFIX), layers, hidden, vocab=1000, seq=max(seq, 128)
        )
    return build(kind, layers, hidden, seq=max(seq, 128))


def measure_rank(rank: int, world: int, device: torch.device, spec: dict[str, Any]) -> dict[str, Any]:
    """Every configuration of one trial on this rank (`_ranks.launch`); every rank runs the same sequence of
    collectives (the limit's broadcast, then wrap's plan broadcast and the runtime's gradient averaging)."""
    import torch.distributed as dist

    from agent.testing.model_zoo import sample_batch

    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    os.environ.pop("MEMPLAN_SERVER", None)  # rank 0 solves in-process, as the single-process rows are
    rows: list[dict[str, Any]] = []
    for kind in spec["kinds"]:
        for layers in spec["layers"]:
            model, cfg = build_model(kind, layers, spec["hidden"], spec["seq"])  # stays on the CPU
            full = sample_batch(cfg, spec["batch"], spec["seq"], device=device)
            b = spec["batch"] // world
            batch = {k: v[rank * b : (rank + 1) * b] for k, v in full.items()}
            release(device)
            box: list[Any] = [None]
            if rank == 0:
                trace, _ = solo_profile(model, batch, device)
                peak = int(trace.measurements.peak_device_bytes)
                box = [(peak, host_limits(trace, peak, spec["fractions"], world, spec.get("host_fraction")))]
                release(device)
            dist.broadcast_object_list(box, src=0, device=device if device.type == "cuda" else None)
            peak, hosts = box[0]
            for fraction in spec["fractions"]:
                row = {
                    "kind": kind,
                    "layers": layers,
                    "rank": rank,
                    **wrapped_row(
                        model, batch, int(peak * fraction), fraction, spec, device, rank == 0, hosts[fraction]
                    ),
                }
                rows.append(row)
    return {"rank": rank, "rows": rows}


def solo_profile(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], device: torch.device
) -> tuple[Any, float]:
    """This process's own profile of a copy of `model` on `device`, no group and no limit (the un-managed peak
    the rows' limits are fractions of), and the seconds `agent.profile` took (the copy's placement not counted)."""
    import agent

    probe = copy.deepcopy(model).to(device)
    t0 = time.perf_counter()
    trace = agent.profile(
        probe,
        batch,
        optimizer=torch.optim.AdamW(probe.parameters(), lr=1e-3, fused=True),
        allocation_trace=False,
    )
    return trace, time.perf_counter() - t0


def host_limits(
    trace: Any, peak: int, fractions: list[float], world: int, host_fraction: float | None
) -> dict[float, int | None]:
    """Per device fraction, the node host limit of `--host-fraction` (None: none set, no single-process plan
    fits that device limit, or its plan holds nothing on the host): `host_fraction` x `world` x the host bytes the single-process plan of `trace` (one
    rank's, profiled alone) predicts under the same device limit, i.e. what `world` ranks of replicated chunks
    would hold on the node."""
    from agent.planning import solve_embedded
    from client.contract import Constraints

    out: dict[float, int | None] = {}
    for fraction in fractions:
        out[fraction] = None
        if host_fraction is None:
            continue
        plan = solve_embedded(trace, Constraints(device_memory_bytes=int(peak * fraction)))
        # (no host bytes: every chunk persistent, nothing to shard; the machine's host memory)
        if plan.predictions is not None and plan.predictions.peak_host_bytes > 0:
            out[fraction] = int(host_fraction * world * plan.predictions.peak_host_bytes)
    return out


def wrapped_row(
    model: torch.nn.Module,
    batch: dict[str, torch.Tensor],
    limit: int,
    fraction: float,
    spec: dict[str, Any],
    device: torch.device,
    keep_plan: bool = False,
    host_limit: int | None = None,
) -> dict[str, Any]:
    """One fraction on this rank: plain timing, `agent.wrap` under the group with the limit, `--steps` steps
    under wrap's monitor, plain timing; this rank's measured figures against the plan's (one rank's).
    `keep_plan` (rank 0): the row also holds the whole plan (`plan`, the contract's JSON), so an outlier can
    be replayed exactly with `agent.wrap(plan=Plan.model_validate(row["plan"]))`."""
    import agent
    from agent.planning import PlanInfeasibleError
    from agent.runtime import RuntimeOptions
    from agent.wrapping import unwrap

    steps = spec["steps"]
    row: dict[str, Any] = {"fraction": fraction, "limit_bytes": limit, "host_limit_bytes": host_limit}
    plain_now = plain_iteration_s(model, batch, device, spec["plain_steps"])
    at_start = foreign_device_bytes(device, batch)
    m = copy.deepcopy(model)  # on the CPU: wrap places it on `device`
    with tempfile.TemporaryDirectory(prefix="memplan-bench-") as tmp:
        t0 = time.perf_counter()
        try:
            run = agent.wrap(
                m,
                torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True),
                sample_batch=batch,
                device_memory=limit,
                host_memory=host_limit,
                options=RuntimeOptions(device=device),
                feedback_steps=steps,
                feedback_path=Path(tmp) / "feedback.jsonl",
            )
        except RuntimeError as exc:
            # no plan (rank 0: PlanInfeasibleError; the others: rank 0's reason, broadcast): every rank
            # raises here, before any other collective, so the ranks stay in step. Anything else is a failure.
            if not (isinstance(exc, PlanInfeasibleError) or str(exc).startswith(NO_PLAN_FROM_RANK_0)):
                raise
            return {**row, "status": "no plan", "error": f"{type(exc).__name__}: {exc}"[:300]}
        wrap_s = time.perf_counter() - t0
        try:
            measured_phases = train_steps(run, batch, steps, spec.get("breakdown", False))
            assert run.monitor is not None
            measured = run.monitor.measured  # this rank's own figures (the report's are the job's maxima)
            rep = run.report()
        finally:
            unwrap(run)
    plan, source = run.plan, run.source
    del run, m
    release(device)
    plain_after = plain_iteration_s(model, batch, device, spec["plain_steps"])
    p, pred = plan.policy, plan.predictions
    assert p is not None and pred is not None and measured.peak_device_bytes is not None
    measured_iteration = statistics.median(measured.iteration_s)
    measured_peak = measured.peak_device_bytes - at_start
    trace = source.trace if source is not None else None
    trace_iteration = trace.measurements.iteration_s if trace is not None else None
    row.update(
        {
            "status": plan.solver.status.value,
            "wrap_s": wrap_s,
            "plan_origin": source.origin if source is not None else None,
            "plan_world_size": p.world_size,
            "trace_world_size": trace.hardware.world_size if trace is not None else None,
            "sharded_chunks": len(p.sharded_chunks),
            "modes": p.mode_strip(),
            "chunks": len(p.chunks),
            "offloaded": sum(c.placement.value == "offloaded" for c in p.chunks),
            "offloaded_chunks": [c.index for c in p.chunks if c.placement.value == "offloaded"],
            "chunk_size_bytes": p.chunk_size_bytes,
            "n_buffers": p.n_buffers,
            "predicted_iteration_s": pred.iteration_s,
            "measured_iteration_s": measured_iteration,
            "iteration_error": measured_iteration / pred.iteration_s - 1.0,
            "job_iteration_s": rep.measured.iteration_s if rep.measured is not None else None,
            "predicted_peak_device_bytes": pred.peak_device_bytes,
            "measured_peak_device_bytes": measured_peak,
            "device_bytes_at_start": at_start,
            "peak_error": measured_peak / pred.peak_device_bytes - 1.0,
            "predicted_peak_host_bytes": pred.peak_host_bytes,
            "measured_peak_host_bytes": measured.peak_host_bytes,
            "plain_now_s": plain_now,
            "plain_after_s": plain_after,
            "trace_iteration_s": trace_iteration,
            "profiled_iteration_s": list(source.profiled_iteration_s) if source is not None else [],
            "steps_timed": len(measured.iteration_s),
        }
    )
    if trace_iteration:
        row["load_drift"] = plain_now / trace_iteration - 1.0
        row["drift_after"] = plain_after / trace_iteration - 1.0
    if measured_phases is not None:
        row["breakdown"] = {
            **measured_phases,
            "predicted_ms": predicted_phases(pred),
            "predicted_uploads": pred.breakdown.get("uploads_per_iteration"),
        }
    if keep_plan:
        row["plan"] = plan.model_dump(mode="json")
    return row


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    done = [r for r in rows if "peak_error" in r]
    return {
        "rows": len(done),
        "peak_within_target": sum(-0.08 <= r["peak_error"] <= 0.02 for r in done),
        "peak_above_2pct": sum(r["peak_error"] > 0.02 for r in done),
        "peak_error_max": max((r["peak_error"] for r in done), default=None),
        "peak_error_min": min((r["peak_error"] for r in done), default=None),
        "iteration_within_10pct": sum(abs(r["iteration_error"]) <= 0.10 for r in done),
        "iteration_error_median_abs": statistics.median(abs(r["iteration_error"]) for r in done)
        if done
        else None,
        "iteration_error_max_abs": max((abs(r["iteration_error"]) for r in done), default=None),
        "worst_iteration_row": (
            lambda r: (
                f"{r['kind']}-{r['layers']}L at {r['fraction']}"
                + (f" rank {r['rank']}" if "rank" in r else "")
                + f": {r['iteration_error']:+.1%}"
            )
        )(max(done, key=lambda r: abs(r["iteration_error"])))
        if done
        else None,
        # rows without drift (the per-configuration medians of combine_trials) report None, not 0.0
        "load_drift_max_abs": max(
            (
                max(abs(r["load_drift"]), abs(r["drift_after"]))
                for r in done
                if "load_drift" in r and "drift_after" in r
            ),
            default=None,
        ),
    }


def summary_line(summary: dict[str, Any]) -> str:
    if not summary["rows"]:
        return "no row had a feasible plan (every fraction below what the model needs)"
    return (
        f"peak within [-8%, +2%]: {summary['peak_within_target']}/{summary['rows']} "
        f"(min {summary['peak_error_min']:+.2%}, max {summary['peak_error_max']:+.2%}); "
        f"iteration within 10%: {summary['iteration_within_10pct']}/{summary['rows']} "
        f"(median |error| {summary['iteration_error_median_abs']:.1%}, worst {summary['worst_iteration_row']})"
        + (f"; largest |drift| {summary['load_drift_max_abs']:.1%}" if summary["load_drift_max_abs"] else "")
    )


def combine_trials(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One row per configuration over the trials: the median iteration error (each trial a fresh build,
    profile, plan and run, so the machine's speed between a profile and its run is sampled `trials` times)
    and the worst peak error (the OOM-safety target is held to every trial). A multi-rank run's rows are
    per rank: each rank is a configuration of its own (its peak is held to the target on its own)."""
    by_config: dict[tuple[str, int, float, int | None], list[dict[str, Any]]] = {}
    for r in rows:
        if "peak_error" in r:
            by_config.setdefault((r["kind"], r["layers"], r["fraction"], r.get("rank")), []).append(r)
    combined = []
    for (kind, layers, fraction, rank), rs in by_config.items():
        worst_peak = max((r["peak_error"] for r in rs), key=abs)
        combined.append(
            {
                "kind": kind,
                "layers": layers,
                "fraction": fraction,
                **({} if rank is None else {"rank": rank}),
                "trials": len(rs),
                "iteration_error": statistics.median(r["iteration_error"] for r in rs),
                "iteration_errors": [r["iteration_error"] for r in rs],
                "peak_error": worst_peak,
                "peak_errors": [r["peak_error"] for r in rs],
            }
        )
    summary = summarize(combined)
    # the drift is the machine's, measured per trial: the largest over every trial's rows
    summary["load_drift_max_abs"] = summarize(rows)["load_drift_max_abs"]
    return {"summary": summary, "rows": combined}


def headline(trials: list[dict[str, Any]], combined: dict[str, Any] | None) -> dict[str, Any]:
    """Both ways of counting, side by side: rows within 10% in each single trial, and by the median of the
    trials (a single run is what one job sees; the median is the model's accuracy with the noise damped)."""
    out: dict[str, Any] = {
        "rows": trials[0]["rows"] if trials else 0,
        "iteration_within_10pct_per_trial": [t["iteration_within_10pct"] for t in trials],
        "iteration_error_max_abs_per_trial": [t["iteration_error_max_abs"] for t in trials],
        "peak_within_target_per_trial": [t["peak_within_target"] for t in trials],
        "load_drift_max_abs_per_trial": [t["load_drift_max_abs"] for t in trials],
    }
    if combined is not None:
        out["iteration_within_10pct_median_of_trials"] = combined["summary"]["iteration_within_10pct"]
        out["iteration_error_max_abs_median_of_trials"] = combined["summary"]["iteration_error_max_abs"]
    return out


if __name__ == "__main__":
    main()
