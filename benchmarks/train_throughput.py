"""Benchmark: training throughput of memory strategies on one model, batch and sequence length, in one run.

Strategies (same model, same batches, AdamW):
- plain: plain PyTorch, everything on the device (reported even when it exceeds the limit: on CPU nothing
  stops it, so `fits` says whether its measured peak is within the limit);
- ckpt_all: plain PyTorch with every repeated block checkpointed (memplan's activation manager, mode
  `checkpoint` everywhere, no offload);
- fsdp2_offload: FSDP2 (`fully_shard` per block and at the root) with `CPUOffloadPolicy` on one GPU
  (single-process group). CUDA only: on CPU the row says "not run";
- protrain: the ProTrain baseline plan (`solve(..., solver="protrain")`) applied by memplan's runtime;
- cpsat: the CP-SAT plan applied by memplan's runtime.
Both plans are solved from one real trace of the model under the device limit (default: `--fraction`
of plain's measured peak, or `--device-memory` bytes). For each strategy: tokens/s (batch x seq / median
iteration seconds over `--steps` timed steps after 2 warm-up steps), peak device bytes of one iteration
(profiler semantics: storage tracker on CPU, max_memory_allocated on CUDA) and whether it fits.

`--sweep L1 L2 ...` repeats the comparison for several depths and reports, per strategy, the largest
model that fits the limit (plain/ckpt_all: measured peak within the limit; plans: solver feasible and
measured peak within the limit; FSDP2: ran without running out of memory).

Targets (issue 7, one GPU): cpsat >= 1.4x fsdp2_offload tokens/s on a model that needs offload, and
cpsat >= protrain. On CPU this runs at small scale to exercise every path; CPU figures do not speak to
the GPU targets (copies and compute share the same cores and memory).

Usage: .venv/bin/python benchmarks/train_throughput.py [--kind llama] [--layers 8] [--hidden 128] [--seq 128]
       [--batch 4] [--steps 6] [--fraction 0.45] [--device-memory BYTES] [--sweep 4 8 16] [--device cpu|cuda]
Prints a table and writes benchmarks/results/train_throughput-<UTC timestamp>.json (pointer: train_throughput-latest.json).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _results import Run, save
from torch import nn

RESULTS = Path(__file__).resolve().parent / "results" / "train_throughput.json"
STRATEGIES = ("plain", "ckpt_all", "fsdp2_offload", "protrain", "cpsat")


def _timed_loop(model: nn.Module, opt: torch.optim.Optimizer, batch: dict[str, torch.Tensor], steps: int,
                device: torch.device, meter_state: Callable[[], list[Any]] | None) -> tuple[float, int | None]:
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
        out: list[tuple[torch.Tensor, AllocationCategory]] = [(p, AllocationCategory.param) for p in model.parameters()]
        out += [(b, AllocationCategory.param) for b in model.buffers()]
        out += [(v, AllocationCategory.optimizer) for _, v in state_tensors(opt)]
        return out

    return state


def run_plain(model: nn.Module, batch: Any, steps: int, device: torch.device, ckpt_all: bool) -> dict[str, Any]:
    from agent.profiler.block_detection import detect_blocks
    from agent.runtime.activations import ActivationManager, BlockTarget
    from client.contract import ActivationMode

    m = copy.deepcopy(model).to(device)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True)
    mgr = None
    if ckpt_all:
        blocks = detect_blocks(m)
        targets = [BlockTarget(i + 1, n, mod, ActivationMode.checkpoint)
                   for i, (n, mod) in enumerate(zip(blocks.names, blocks.modules, strict=True))]
        mgr = ActivationManager(m, targets, device)
    try:
        it, peak = _timed_loop(m, opt, batch, steps, device, _plain_state(m, opt))
    finally:
        if mgr is not None:
            mgr.remove()
    return {"iteration_s": it, "peak_device_bytes": peak}


def run_fsdp2_offload(model: nn.Module, batch: Any, steps: int, device: torch.device) -> dict[str, Any]:
    """FSDP2 with CPUOffloadPolicy on one GPU. Written for CUDA; not run in the CPU-only session that wrote it."""
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
        dist.init_process_group("nccl", rank=0, world_size=1)
        created = True
    try:
        # fully_shard moves the module to the mesh's device; CPUOffloadPolicy then keeps the sharded parameters,
        # gradients and optimizer step in pinned host memory and copies them in for each block's compute
        m = copy.deepcopy(model).to(device)
        for block in detect_blocks(m).modules:
            fully_shard(block, offload_policy=CPUOffloadPolicy())
        fully_shard(m, offload_policy=CPUOffloadPolicy())
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        torch.cuda.reset_peak_memory_stats(device)
        it, _ = _timed_loop(m, opt, batch, steps, device, None)
        return {"iteration_s": it, "peak_device_bytes": int(torch.cuda.max_memory_allocated(device))}
    except torch.OutOfMemoryError as exc:
        return {"skipped": f"out of memory: {exc}"[:200]}
    finally:
        if created:
            dist.destroy_process_group()


def run_plan(model: nn.Module, batch: Any, steps: int, device: torch.device, plan: Any) -> dict[str, Any]:
    from agent.wrapping import unwrap, wrap

    if plan.policy is None:
        return {"skipped": f"infeasible: fits from {plan.solver.min_device_memory_bytes} bytes"}
    m = copy.deepcopy(model).to(device) if device.type == "cpu" else copy.deepcopy(model)
    run = wrap(m, torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True), plan=plan, feedback_steps=steps + 3)
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
    return {"iteration_s": statistics.median(times), "peak_device_bytes": rep.measured.peak_device_bytes,
            "predicted_iteration_s": plan.predictions.iteration_s, "modes": plan.policy.mode_strip(),
            "offloaded_chunks": sum(c.placement.value == "offloaded" for c in plan.policy.chunks),
            "chunks": len(plan.policy.chunks), "n_buffers": plan.policy.n_buffers}


def compare(kind: str, layers: int, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    import agent
    from agent.testing.model_zoo import build, sample_batch
    from client.contract import Constraints
    from planner_service.solver import solve

    model, cfg = build(kind, layers, args.hidden, seq=max(args.seq, 128))
    model = model.to(device)  # type: ignore[arg-type]
    batch = sample_batch(cfg, args.batch, args.seq, device=device)
    tokens = args.batch * args.seq
    rows: dict[str, dict[str, Any]] = {}
    rows["plain"] = run_plain(model, batch, args.steps, device, ckpt_all=False)
    limit = args.device_memory or int((rows["plain"]["peak_device_bytes"] or 0) * args.fraction)
    rows["ckpt_all"] = run_plain(model, batch, args.steps, device, ckpt_all=True)
    rows["fsdp2_offload"] = run_fsdp2_offload(model, batch, args.steps, device)
    probe = copy.deepcopy(model).to(device)
    trace = agent.profile(probe, batch, optimizer=torch.optim.AdamW(probe.parameters(), lr=1e-3, fused=True),
                          allocation_trace=False)
    del probe
    for solver in ("protrain", "cpsat"):
        plan = solve(trace, Constraints(device_memory_bytes=limit, time_limit_s=10.0), solver=solver)
        rows[solver] = run_plan(model, batch, args.steps, device, plan)
    for r in rows.values():
        if "iteration_s" in r:
            r["tokens_per_s"] = tokens / r["iteration_s"]
            r["fits"] = r.get("peak_device_bytes") is not None and r["peak_device_bytes"] <= limit
    return {"kind": kind, "layers": layers, "limit_bytes": limit, "tokens_per_iteration": tokens, "strategies": rows}


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
    ap.add_argument("--sweep", nargs="*", type=int, default=None, help="depths for the largest-model comparison")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads (1: steadier timings on a shared machine; 0: torch's default)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()


    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    run = Run("train_throughput", args)
    depths = args.sweep or [args.layers]
    results = []
    for layers in depths:
        res = compare(args.kind, layers, args, device)
        results.append(res)
        print(f"{args.kind}-{layers}L, limit {res['limit_bytes'] / 2**20:.1f} MiB, {res['tokens_per_iteration']} tokens/iteration")
        print(f"  {'strategy':<14} {'tokens/s':>10} {'peak MiB':>9} {'fits':>5}  notes")
        for name in STRATEGIES:
            r = res["strategies"][name]
            if "skipped" in r:
                print(f"  {name:<14} {'-':>10} {'-':>9} {'-':>5}  not run: {r['skipped']}")
                continue
            peak = r.get("peak_device_bytes")
            notes = f"modes {r['modes']}, {r['offloaded_chunks']}/{r['chunks']} offloaded" if "modes" in r else ""
            print(f"  {name:<14} {r['tokens_per_s']:>10.0f} {(peak or 0) / 2**20:>9.2f} {str(r['fits']):>5}  {notes}")
        c, f, p = (res["strategies"][k] for k in ("cpsat", "fsdp2_offload", "protrain"))
        if "tokens_per_s" in c and "tokens_per_s" in p:
            print(f"  cpsat / protrain: {c['tokens_per_s'] / p['tokens_per_s']:.2f}x", end="")
            if "tokens_per_s" in f:
                print(f"; cpsat / fsdp2_offload: {c['tokens_per_s'] / f['tokens_per_s']:.2f}x", end="")
            print()
    largest: dict[str, int | None] = {}
    if args.sweep:
        for name in STRATEGIES:
            ok = [res["layers"] for res in results if res["strategies"][name].get("fits")]
            largest[name] = max(ok) if ok else None
        print("largest model that fits the limit (layers):", largest)
    save(args.out, run.document(device, results=results, largest_layers_that_fit=largest))


if __name__ == "__main__":
    main()
