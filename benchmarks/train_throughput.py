"""Benchmark: training throughput of memory strategies on one model, batch and sequence length, in one run.

Strategies (same model, same batches, AdamW):
- plain: plain PyTorch, everything on the device (reported even when it exceeds the limit: on CPU nothing
  stops it, so `fits` says whether its measured peak is within the limit);
- ckpt_all: plain PyTorch with every repeated block checkpointed (memplan's activation manager, mode
  `checkpoint` everywhere, no offload);
- fsdp2_offload: FSDP2 (`fully_shard` per block and at the root) with `CPUOffloadPolicy` on one GPU
  (single-process group) and a fused AdamW (foreach where fused is unavailable) stepping on the host;
- fsdp2_offload_ckpt: the same with every block checkpointed (Hugging Face's
  `gradient_checkpointing_enable`, non-reentrant). FSDP2 rows are CUDA only: on CPU they say "not run";
- protrain: the ProTrain baseline plan (`solve(..., solver="protrain")`) applied by memplan's runtime;
- cpsat: the CP-SAT plan applied by memplan's runtime.
Both plans are solved from one real trace of the model under the device limit (default: `--fraction`
of plain's measured peak, or `--device-memory` bytes). For each strategy: tokens/s (batch x seq / median
iteration seconds over `--steps` timed steps after 2 warm-up steps), peak device bytes and whether it fits.

Fairness (issue 19 defects 1 and 7). Every strategy, and the profile the plans come from, runs in a fresh
Python process (`--worker`), so no strategy inherits another's allocator cache, CUDA context or leftovers.
The model is built on the CPU in each process (the reference copy stays there) and only the strategy's
own copy goes to the device, an indexed one (`cuda` means `cuda:0`: an un-indexed device compares unequal
to `cuda:0`). On CUDA each process (except plain when it sets the limit) calls
`torch.cuda.set_per_process_memory_fraction(limit / total)`, so the limit binds every strategy alike, and
the peak is `max_memory_allocated` minus the bytes allocated when the window starts (after `gc.collect()`
and `empty_cache()`); on CPU it is the profiler's storage tracker (plain) or the runtime's report (plans).
Ratios are printed only when both sides fit. The parent process never touches CUDA.

`--sweep L1 L2 ...` repeats the comparison for several depths and reports, per strategy, the largest
model that fits the limit (plain/ckpt_all: measured peak within the limit; plans: solver feasible and
measured peak within the limit; FSDP2: ran without running out of memory).

Targets (issue 7, one GPU): cpsat >= 1.4x fsdp2_offload tokens/s on a model that needs offload, and
cpsat >= protrain. On CPU this runs at small scale to exercise every path; CPU figures do not speak to
the GPU targets (copies and compute share the same cores and memory).

On a GPU use a model that needs offload at a realistic size, e.g. a 1-3B llama at seq >= 1024 in bf16:
  benchmarks/train_throughput.py --device cuda --kind llama --layers 24 --hidden 2048 --seq 1024 --batch 4 --dtype bf16

Usage: .venv/bin/python benchmarks/train_throughput.py [--kind llama] [--layers 8] [--hidden 128] [--seq 128]
       [--batch 4] [--steps 6] [--fraction 0.45] [--device-memory BYTES] [--sweep 4 8 16] [--device cpu|cuda[:N]]
       [--dtype fp32|bf16] [--threads N]
Prints a table and writes benchmarks/results/train_throughput-<UTC timestamp>.json (pointer: train_throughput-latest.json).
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _results import Run, save
from torch import nn

RESULTS = Path(__file__).resolve().parent / "results" / "train_throughput.json"
STRATEGIES = ("plain", "ckpt_all", "fsdp2_offload", "fsdp2_offload_ckpt", "protrain", "cpsat")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def resolve_device(name: str) -> torch.device:
    """`cuda` -> `cuda:0` (an indexed device: `torch.cuda.set_device` and device comparisons need the index)."""
    device = torch.device(name)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", 0)
    return device


def host_adamw(params: Any) -> torch.optim.Optimizer:
    """AdamW for parameters stepped on the host (FSDP2 CPU offload): fused where this torch has it, else foreach."""
    params = list(params)
    try:
        return torch.optim.AdamW(params, lr=1e-3, fused=True)
    except (RuntimeError, ValueError):
        return torch.optim.AdamW(params, lr=1e-3, foreach=True)


def _timed_loop(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    batch: dict[str, torch.Tensor],
    steps: int,
    device: torch.device,
    meter_state: Callable[[], list[Any]] | None,
) -> tuple[float, int | None]:
    """Median iteration seconds of `steps` timed steps (after 2 warm-up) and the peak of one metered step."""
    from agent.measure import DevicePeakMeter

    meter = DevicePeakMeter(device)
    times: list[float] = []
    peak: int | None = None
    for i in range(steps + 3):
        metered = i == 2 and meter_state is not None
        if metered:
            assert meter_state is not None
            meter.start(meter_state(), batch)
        t0 = time.perf_counter()
        model(**batch).loss.backward()
        opt.step()
        opt.zero_grad()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dt = time.perf_counter() - t0
        if metered:
            peak = meter.stop()
        elif i > 2:
            times.append(dt)
    return statistics.median(times), peak


def _plain_state(model: nn.Module, opt: torch.optim.Optimizer) -> Callable[[], list[Any]]:
    from agent.profiler.optimizer_probe import state_tensors
    from client.contract import AllocationCategory

    def state() -> list[Any]:
        out: list[tuple[torch.Tensor, AllocationCategory]] = [
            (p, AllocationCategory.param) for p in model.parameters()
        ]
        out += [(b, AllocationCategory.param) for b in model.buffers()]
        out += [(v, AllocationCategory.optimizer) for _, v in state_tensors(opt)]
        return out

    return state


def run_plain(
    model: nn.Module, batch: Any, steps: int, device: torch.device, ckpt_all: bool
) -> dict[str, Any]:
    from agent.profiler.block_detection import detect_blocks
    from agent.runtime.activations import ActivationManager, BlockTarget
    from client.contract import ActivationMode

    m = copy.deepcopy(model).to(device)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True)
    mgr = None
    if ckpt_all:
        blocks = detect_blocks(m)
        targets = [
            BlockTarget(i + 1, n, mod, ActivationMode.checkpoint)
            for i, (n, mod) in enumerate(zip(blocks.names, blocks.modules, strict=True))
        ]
        mgr = ActivationManager(m, targets, device)
    try:
        it, peak = _timed_loop(m, opt, batch, steps, device, _plain_state(m, opt))
    finally:
        if mgr is not None:
            mgr.remove()
    return {"iteration_s": it, "peak_device_bytes": peak}


def run_fsdp2_offload(
    model: nn.Module, batch: Any, steps: int, device: torch.device, ckpt_all: bool = False
) -> dict[str, Any]:
    """FSDP2 with CPUOffloadPolicy on one GPU (optionally every block checkpointed). Written for CUDA; not
    run in the CPU-only sessions that wrote it."""
    if device.type != "cuda":
        return {"skipped": "FSDP2 CPUOffloadPolicy needs a CUDA device; no GPU here"}
    import torch.distributed as dist
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    from agent.profiler.block_detection import detect_blocks

    created = False
    torch.cuda.set_device(device)
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=device)
        created = True
    try:
        # fully_shard moves the module to the mesh's device; CPUOffloadPolicy then keeps the sharded parameters,
        # gradients and optimizer step in pinned host memory and copies them in for each block's compute
        m = copy.deepcopy(model).to(device)
        if ckpt_all:
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})  # type: ignore[operator]
        for block in detect_blocks(m).modules:
            fully_shard(block, offload_policy=CPUOffloadPolicy())
        fully_shard(m, offload_policy=CPUOffloadPolicy())
        opt = host_adamw(m.parameters())
        it, _ = _timed_loop(m, opt, batch, steps, device, None)
        return {"iteration_s": it}
    finally:
        if created:
            dist.destroy_process_group()


def run_plan(model: nn.Module, batch: Any, steps: int, device: torch.device, plan: Any) -> dict[str, Any]:
    from agent.runtime import RuntimeOptions
    from agent.wrapping import unwrap, wrap

    if plan.policy is None:
        return {"skipped": f"infeasible: fits from {plan.solver.min_device_memory_bytes} bytes"}
    m = copy.deepcopy(model)  # on the CPU: wrap places it (the runtime's device is RuntimeOptions' or CUDA's)
    run = wrap(
        m,
        torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True),
        plan=plan,
        feedback_steps=steps + 3,
        options=RuntimeOptions(device=device),
    )
    try:
        times = []
        for i in range(steps + 3):
            t0 = time.perf_counter()
            run.model(**batch).loss.backward()
            run.optimizer.step()
            run.optimizer.zero_grad()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if i > 2:
                times.append(time.perf_counter() - t0)
        rep = run.report()
    finally:
        unwrap(run)
    assert plan.predictions is not None and rep.measured is not None
    return {
        "iteration_s": statistics.median(times),
        "peak_device_bytes": rep.measured.peak_device_bytes,
        "predicted_peak_device_bytes": plan.predictions.peak_device_bytes,
        "predicted_iteration_s": plan.predictions.iteration_s,
        "modes": plan.policy.mode_strip(),
        "offloaded_chunks": sum(c.placement.value == "offloaded" for c in plan.policy.chunks),
        "chunks": len(plan.policy.chunks),
        "n_buffers": plan.policy.n_buffers,
    }


# ------------------------------------------------------------------------------------------ one process each
def _load_plan(path: str) -> Any:
    from client.contract import Plan

    return Plan.model_validate_json(Path(path).read_text())


def run_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """One strategy (or the profile) in this fresh process: the limit set, the model built on the CPU."""
    from agent.testing.model_zoo import build, sample_batch

    device = torch.device(spec["device"])
    threads = spec.get("threads")
    if threads:
        torch.set_num_threads(threads)
    limit = spec.get("limit_bytes")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        if spec["dtype"] == "fp32":
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
        if limit:
            total = torch.cuda.get_device_properties(device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, limit / total), device)
    model, cfg = build(spec["kind"], spec["layers"], spec["hidden"], seq=max(spec["seq"], 128))
    model = model.to(DTYPES[spec["dtype"]])  # stays on the CPU: the reference copy never takes device memory
    batch = sample_batch(cfg, spec["batch"], spec["seq"], device=device)
    gc.collect()
    start = 0
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
    strategy, steps = spec["strategy"], spec["steps"]
    try:
        if strategy == "profile":
            import agent

            probe = copy.deepcopy(model).to(device)
            trace = agent.profile(
                probe,
                batch,
                optimizer=torch.optim.AdamW(probe.parameters(), lr=1e-3, fused=True),
                allocation_trace=False,
            )
            Path(spec["trace_file"]).write_text(trace.model_dump_json())
            return {"peak_device_bytes": trace.measurements.peak_device_bytes}
        if strategy in ("plain", "ckpt_all"):
            row = run_plain(model, batch, steps, device, ckpt_all=strategy == "ckpt_all")
        elif strategy in ("fsdp2_offload", "fsdp2_offload_ckpt"):
            row = run_fsdp2_offload(model, batch, steps, device, ckpt_all=strategy == "fsdp2_offload_ckpt")
        else:
            row = run_plan(model, batch, steps, device, _load_plan(spec["plan_file"]))
    except torch.OutOfMemoryError as exc:
        return {"skipped": f"out of memory under the limit: {exc}"[:240], "out_of_memory": True}
    if device.type == "cuda" and "iteration_s" in row:
        row["window_peak_device_bytes"] = row.get("peak_device_bytes")
        row["peak_device_bytes"] = torch.cuda.max_memory_allocated(device) - start
        row["peak_metric"] = "max_memory_allocated minus the bytes allocated at the window's start"
    return row


def in_fresh_process(spec: dict[str, Any]) -> dict[str, Any]:
    """Run `spec` through `--worker` in a new Python process; its result row (or why it failed)."""
    with tempfile.TemporaryDirectory(prefix="memplan-bench-") as tmp:
        spec_file, out_file = Path(tmp) / "spec.json", Path(tmp) / "row.json"
        spec_file.write_text(json.dumps(spec))
        cmd = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--worker",
            str(spec_file),
            "--worker-out",
            str(out_file),
        ]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0 or not out_file.is_file():
            return {
                "skipped": f"the {spec['strategy']} process failed (exit {done.returncode}): "
                f"{done.stderr.strip().splitlines()[-1] if done.stderr.strip() else 'no output'}"[:300]
            }
        row: dict[str, Any] = json.loads(out_file.read_text())
        return row


def compare(kind: str, layers: int, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    from client.contract import Constraints, Trace
    from planner_service.solver import solve

    base = {
        "kind": kind,
        "layers": layers,
        "hidden": args.hidden,
        "seq": args.seq,
        "batch": args.batch,
        "steps": args.steps,
        "device": str(device),
        "dtype": args.dtype,
        "threads": args.threads,
    }
    tokens = args.batch * args.seq
    rows: dict[str, dict[str, Any]] = {}
    # plain sets the limit (unbounded then); with --device-memory it runs under the limit like the others
    rows["plain"] = in_fresh_process({**base, "strategy": "plain", "limit_bytes": args.device_memory})
    limit = args.device_memory or int((rows["plain"].get("peak_device_bytes") or 0) * args.fraction)
    for name in ("ckpt_all", "fsdp2_offload", "fsdp2_offload_ckpt"):
        rows[name] = in_fresh_process({**base, "strategy": name, "limit_bytes": limit})
    with tempfile.TemporaryDirectory(prefix="memplan-bench-") as tmp:
        trace_file = Path(tmp) / "trace.json"
        prof = in_fresh_process({**base, "strategy": "profile", "trace_file": str(trace_file)})
        trace = Trace.model_validate_json(trace_file.read_text()) if trace_file.is_file() else None
        for solver in ("protrain", "cpsat"):
            if trace is None:
                rows[solver] = {"skipped": f"no trace: {prof.get('skipped', 'the profile failed')}"}
                continue
            plan = solve(trace, Constraints(device_memory_bytes=limit, time_limit_s=10.0), solver=solver)
            if plan.policy is None:
                rows[solver] = {
                    "skipped": f"infeasible: fits from {plan.solver.min_device_memory_bytes} bytes"
                }
                continue
            plan_file = Path(tmp) / f"plan-{solver}.json"
            plan_file.write_text(plan.model_dump_json())
            rows[solver] = in_fresh_process(
                {**base, "strategy": solver, "limit_bytes": limit, "plan_file": str(plan_file)}
            )
    for r in rows.values():
        if "iteration_s" in r:
            r["tokens_per_s"] = tokens / r["iteration_s"]
            peak = r.get("peak_device_bytes")
            r["fits"] = peak is not None and peak <= limit
    return {
        "kind": kind,
        "layers": layers,
        "limit_bytes": limit,
        "tokens_per_iteration": tokens,
        "strategies": rows,
    }


def ratio_lines(strategies: dict[str, dict[str, Any]]) -> list[str]:
    """`cpsat / other: N.NNx` for each comparison where both sides ran and fit the limit, else why not."""
    out = []
    c = strategies["cpsat"]
    for other in ("protrain", "fsdp2_offload", "fsdp2_offload_ckpt"):
        o = strategies[other]
        if c.get("fits") and o.get("fits"):
            out.append(f"cpsat / {other}: {c['tokens_per_s'] / o['tokens_per_s']:.2f}x")
        else:
            why = [
                f"{n} {'did not fit' if 'iteration_s' in r else 'did not run'}"
                for n, r in (("cpsat", c), (other, o))
                if not r.get("fits")
            ]
            out.append(f"cpsat / {other}: no ratio ({', '.join(why)})")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kind", default="llama")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--fraction", type=float, default=0.45)
    ap.add_argument("--device-memory", type=int, default=None)
    ap.add_argument(
        "--sweep", nargs="*", type=int, default=None, help="depths for the largest-model comparison"
    )
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads (default: 1 on CPU, steadier on a shared machine; every core on CUDA)",
    )
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    ap.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda:0 when CUDA is available)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        row = run_worker(json.loads(Path(args.worker).read_text()))
        Path(args.worker_out).write_text(json.dumps(row, default=str))
        return

    # the parent never initialises CUDA (a context here would take device memory from every strategy)
    device = resolve_device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.threads is None:
        args.threads = 1 if device.type == "cpu" else 0
    if device.type == "cuda" and args.dtype == "fp32":
        print("note: fp32 on CUDA; TF32 matmuls are on in every strategy's process (--dtype bf16 for bf16)")
    run = Run("train_throughput", args)
    depths = args.sweep or [args.layers]
    results = []
    for layers in depths:
        res = compare(args.kind, layers, args, device)
        results.append(res)
        print(
            f"{args.kind}-{layers}L, limit {res['limit_bytes'] / 2**20:.1f} MiB, {res['tokens_per_iteration']} tokens/iteration"
        )
        print(f"  {'strategy':<18} {'tokens/s':>10} {'peak MiB':>9} {'fits':>5}  notes")
        for name in STRATEGIES:
            r = res["strategies"][name]
            if "skipped" in r:
                print(f"  {name:<18} {'-':>10} {'-':>9} {'-':>5}  not run: {r['skipped']}")
                continue
            peak = r.get("peak_device_bytes")
            notes = (
                f"modes {r['modes']}, {r['offloaded_chunks']}/{r['chunks']} offloaded" if "modes" in r else ""
            )
            print(
                f"  {name:<18} {r['tokens_per_s']:>10.0f} {(peak or 0) / 2**20:>9.2f} {str(r['fits']):>5}  {notes}"
            )
        for line in ratio_lines(res["strategies"]):
            print(f"  {line}")
    largest: dict[str, int | None] = {}
    if args.sweep:
        for name in STRATEGIES:
            ok = [res["layers"] for res in results if res["strategies"][name].get("fits")]
            largest[name] = max(ok) if ok else None
        print("largest model that fits the limit (layers):", largest)
    save(args.out, run.document(device, results=results, largest_layers_that_fit=largest))


if __name__ == "__main__":
    main()
