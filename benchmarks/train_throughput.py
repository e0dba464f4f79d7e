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

`--world-size N` (N > 1; issue 20) compares data-parallel strategies instead, each on N fresh ranks
(`torch.multiprocessing` spawn, `benchmarks/_ranks.py`; NCCL with rank r on `cuda:r` when the device is CUDA,
gloo on the CPU) training the same global batch (`--batch` rows, split evenly: each rank its own rows):
- ddp: plain PyTorch under `DistributedDataParallel`, everything on the device (it sets the limit, as plain
  does above; `fits` says whether its per-rank peak is within it);
- fsdp2_offload: FSDP2 (`fully_shard` per block and at the root on a 1-D device mesh of the N ranks) with
  `CPUOffloadPolicy` (pinned on CUDA; `pin_memory=False` on the CPU, where there is no accelerator to pin for
  and the "offload" is a copy within host memory: it exercises the path, it measures no offload). No
  `MixedPrecisionPolicy`: the model is cast to `--dtype` for every strategy, as in the single-process mode;
- memplan: `agent.wrap(model, optimizer, sample_batch=..., device_memory=limit)` under the group: rank 0
  profiles the job and solves the plan (in-process: MEMPLAN_SERVER is ignored) and broadcasts it, and every
  rank applies it. Whatever the plan says is run: replicated chunks today; sharded offloaded chunks once the
  trace is multi-rank and the planner shards (the row says how many chunks are sharded and the plan's world
  size). `wrap_s` is the time of the wrap call (profile, hardware probe, solve, broadcast).
Per strategy: tokens/s = global tokens / the slowest rank's median iteration, the peak device bytes of every
rank (`max_memory_allocated` minus the bytes at the window's start on CUDA; the storage tracker on CPU, where
the process's resident-set peak over the training steps, `peak_rss_bytes`, is also given per rank: the
host peak, interpreter, libraries and the CPU reference model included; `rss_before_bytes` is the resident
set before the strategy's model copy was made). A rank that fails (out of memory under the limit, or an error) makes the strategy's
row say why; the other ranks are ended with it.

Targets (issue 7, one GPU): cpsat >= 1.4x fsdp2_offload tokens/s on a model that needs offload, and
cpsat >= protrain. On CPU this runs at small scale to exercise every path; CPU figures do not speak to
the GPU targets (copies and compute share the same cores and memory).

On a GPU use a model that needs offload at a realistic size, e.g. a 1-3B llama at seq >= 1024 in bf16:
  benchmarks/train_throughput.py --device cuda --kind llama --layers 24 --hidden 2048 --seq 1024 --batch 4 --dtype bf16

Usage: .venv/bin/python benchmarks/train_throughput.py [--kind llama] [--layers 8] [--hidden 128] [--seq 128]
       [--batch 4] [--steps 6] [--fraction 0.45] [--device-memory BYTES] [--sweep 4 8 16] [--device cpu|cuda[:N]]
       [--dtype fp32|bf16] [--threads N] [--world-size N]
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
from typing import TYPE_CHECKING, Any

import torch
from _ranks import launch, peak_rss_bytes, reset_peak_rss, rss_bytes
from _results import Run, save
from torch import nn

if TYPE_CHECKING:
    from agent.runtime import RuntimeOptions

RESULTS = Path(__file__).resolve().parent / "results" / "train_throughput.json"
STRATEGIES = ("plain", "ckpt_all", "fsdp2_offload", "fsdp2_offload_ckpt", "protrain", "cpsat")
DISTRIBUTED_STRATEGIES = ("ddp", "fsdp2_offload", "memplan")  # --world-size N > 1
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
    reset_peak_rss()  # the host's peak over the steps (`--world-size` rows report it)
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
    """FSDP2 with CPUOffloadPolicy (optionally every block checkpointed) on the ranks of the process group
    already initialised (`--world-size`), else on one GPU in a group of its own. The single-GPU and NCCL
    paths were written for CUDA and not run in the CPU-only sessions that wrote them; on the CPU it runs in a
    multi-rank gloo group only (a device mesh on "cpu", `pin_memory=False`: nothing to pin for)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    from agent.profiler.block_detection import detect_blocks

    if device.type != "cuda" and not dist.is_initialized():
        return {"skipped": "FSDP2 CPUOffloadPolicy needs a CUDA device (on the CPU: --world-size N, gloo)"}
    created = False
    if not dist.is_initialized():
        torch.cuda.set_device(device)
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=device)
        created = True
    try:
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        policy = CPUOffloadPolicy(pin_memory=device.type == "cuda")
        # fully_shard moves the module to the mesh's device; CPUOffloadPolicy then keeps the sharded parameters,
        # gradients and optimizer step in (pinned) host memory and copies them in for each block's compute
        m = copy.deepcopy(model).to(device)
        if ckpt_all:
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})  # type: ignore[operator]
        for block in detect_blocks(m).modules:
            fully_shard(block, mesh=mesh, offload_policy=policy)
        fully_shard(m, mesh=mesh, offload_policy=policy)
        opt = host_adamw(m.parameters())
        # on CUDA run_worker / run_rank read max_memory_allocated; on the CPU the storage tracker meters one
        # step, starting from this rank's shards (DTensors' local tensors) and optimizer state
        meter = _sharded_state(m, opt) if device.type == "cpu" else None
        it, peak = _timed_loop(m, opt, batch, steps, device, meter)
        return {"iteration_s": it} if peak is None else {"iteration_s": it, "peak_device_bytes": peak}
    finally:
        if created:
            dist.destroy_process_group()


def _sharded_state(model: nn.Module, opt: torch.optim.Optimizer) -> Callable[[], list[Any]]:
    """`_plain_state` for FSDP2: the local shard of every DTensor parameter and optimizer state tensor."""
    from torch.distributed.tensor import DTensor

    plain = _plain_state(model, opt)

    def state() -> list[Any]:
        return [(t.to_local() if isinstance(t, DTensor) else t, cat) for t, cat in plain()]

    return state


def memplan_options(device: torch.device | str | None, bf16_states: bool) -> RuntimeOptions:
    """The runtime options of memplan's rows: the defaults (an fp32 master and fp32 moments for a bf16 model, the
    undo backup of speculative host steps), or with `bf16_states` the FSDP2 rows' optimizer arithmetic (no
    master: bf16 parameters and moments stepped on the host; no undo backup: this loop does not clip)."""
    from agent.runtime import RuntimeOptions

    if bf16_states:
        return RuntimeOptions(device=device, fp32_master=False, undo_host_steps=False)
    return RuntimeOptions(device=device)


def run_plan(
    model: nn.Module, batch: Any, steps: int, device: torch.device, plan: Any, *, bf16_states: bool = False
) -> dict[str, Any]:
    from agent.wrapping import unwrap, wrap

    if plan.policy is None:
        return {"skipped": f"infeasible: fits from {plan.solver.min_device_memory_bytes} bytes"}
    m = copy.deepcopy(model)  # on the CPU: wrap places it (the runtime's device is RuntimeOptions' or CUDA's)
    run = wrap(
        m,
        torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True),
        plan=plan,
        feedback_steps=steps + 3,
        options=memplan_options(device, bf16_states),
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
            row = run_plan(
                model,
                batch,
                steps,
                device,
                _load_plan(spec["plan_file"]),
                bf16_states=spec.get("bf16_states", False),
            )
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


# ------------------------------------------------------------------------------------------ N ranks (issue 20)
def split_batch(batch: dict[str, torch.Tensor], rank: int, world: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s rows of the global batch: the same global batch as one process trains, split evenly."""
    rows = next(iter(batch.values())).shape[0]
    if rows % world:
        raise ValueError(f"batch: {rows} rows do not split evenly over {world} ranks")
    b = rows // world
    return {k: v[rank * b : (rank + 1) * b] for k, v in batch.items()}


def run_ddp(model: nn.Module, batch: Any, steps: int, device: torch.device) -> dict[str, Any]:
    """Plain PyTorch under DistributedDataParallel: every rank holds everything, gradients all-reduced."""
    from torch.nn.parallel import DistributedDataParallel

    m = copy.deepcopy(model).to(device)
    ddp = DistributedDataParallel(m, device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3, fused=True)
    it, peak = _timed_loop(ddp, opt, batch, steps, device, _plain_state(m, opt))
    return {"iteration_s": it, "peak_device_bytes": peak}


def run_memplan(model: nn.Module, batch: Any, steps: int, device: torch.device, limit: int) -> dict[str, Any]:
    """`agent.wrap` under the process group with the device limit: every rank profiles, rank 0 solves, every
    rank applies the plan it broadcasts (whatever it says: replicated or sharded chunks)."""
    import agent
    from agent.runtime import RuntimeOptions
    from agent.wrapping import unwrap

    os.environ.pop("MEMPLAN_SERVER", None)  # solved in-process, as the single-process rows are
    m = copy.deepcopy(model)  # on the CPU: wrap places it on `device`
    with tempfile.TemporaryDirectory(prefix="memplan-bench-") as tmp:
        t0 = time.perf_counter()
        run = agent.wrap(
            m,
            torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True),
            sample_batch=batch,
            device_memory=limit,
            options=RuntimeOptions(device=device),
            feedback_steps=steps + 3,
            feedback_path=Path(tmp) / "feedback.jsonl",
        )
        wrap_s = time.perf_counter() - t0
        reset_peak_rss()  # the steps' host peak, not rank 0's profile and hardware probe
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
            assert run.monitor is not None
            measured = run.monitor.measured  # this rank's own figures (the report's are the job's maxima)
            # device-sharded chunks: the most bytes of whole copies gathered at once (on the CPU the meter, a
            # storage tracker, does not see them: they are resized in place, not allocated)
            shards = run.runtime.device_shards
            gathered = shards.max_gathered_bytes if shards is not None else 0
        finally:
            unwrap(run)
    plan = run.plan
    assert plan.policy is not None and plan.predictions is not None
    return {
        "iteration_s": statistics.median(times),
        "peak_device_bytes": measured.peak_device_bytes,
        "peak_host_bytes": measured.peak_host_bytes,
        "gathered_peak_bytes": gathered,
        "wrap_s": wrap_s,
        "plan_origin": run.source.origin if run.source is not None else None,
        "predicted_peak_device_bytes": plan.predictions.peak_device_bytes,
        "predicted_peak_host_bytes": plan.predictions.peak_host_bytes,
        "predicted_iteration_s": plan.predictions.iteration_s,
        "plan_world_size": plan.policy.world_size,
        "modes": plan.policy.mode_strip(),
        "offloaded_chunks": sum(c.placement.value == "offloaded" for c in plan.policy.chunks),
        "sharded_chunks": len(plan.policy.sharded_chunks),
        # persistent chunks sharded on the device (ZeRO-3, `agent/runtime/device_shards.py`)
        "device_sharded_chunks": sum(
            c.sharded and c.placement.value == "persistent" for c in plan.policy.chunks
        ),
        "chunks": len(plan.policy.chunks),
        "n_buffers": plan.policy.n_buffers,
    }


def run_rank(rank: int, world: int, device: torch.device, spec: dict[str, Any]) -> dict[str, Any]:
    """One strategy on one rank of a fresh group (`_ranks.launch`): the model built on the CPU with the same
    seed on every rank, this rank's rows of the global batch, the limit set on CUDA as `run_worker` does."""
    from agent.testing.model_zoo import build, sample_batch

    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    limit = spec.get("limit_bytes")
    if device.type == "cuda":
        if spec["dtype"] == "fp32":
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
        if limit:
            total = torch.cuda.get_device_properties(device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, limit / total), device)
    model, cfg = build(spec["kind"], spec["layers"], spec["hidden"], seq=max(spec["seq"], 128))
    model = model.to(DTYPES[spec["dtype"]])
    batch = split_batch(sample_batch(cfg, spec["batch"], spec["seq"], device=device), rank, world)
    gc.collect()
    start = 0
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
    rss_before = rss_bytes()
    strategy, steps = spec["strategy"], spec["steps"]
    if strategy == "ddp":
        row = run_ddp(model, batch, steps, device)
    elif strategy == "fsdp2_offload":
        row = run_fsdp2_offload(model, batch, steps, device)
    elif strategy == "memplan":
        row = run_memplan(model, batch, steps, device, int(limit or 0))
    else:
        raise ValueError(f"strategy: {strategy!r} is not one of {DISTRIBUTED_STRATEGIES}")
    if device.type == "cuda" and "iteration_s" in row:
        row["window_peak_device_bytes"] = row.get("peak_device_bytes")
        row["peak_device_bytes"] = torch.cuda.max_memory_allocated(device) - start
        row["peak_metric"] = "max_memory_allocated minus the bytes allocated at the window's start"
    return {
        "rank": rank,
        **row,
        "rss_before_bytes": rss_before,
        "peak_rss_bytes": peak_rss_bytes(),  # over the training steps (reset before them)
    }


PLAN_FIELDS = (
    "plan_origin",
    "predicted_peak_device_bytes",
    "predicted_peak_host_bytes",
    "predicted_iteration_s",
    "plan_world_size",
    "modes",
    "offloaded_chunks",
    "sharded_chunks",
    "device_sharded_chunks",
    "chunks",
    "n_buffers",
    "gathered_peak_bytes",
    "wrap_s",
)


def combine_ranks(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """One strategy's row from its ranks' rows: the slowest rank's iteration (the ranks step together), every
    rank's peak and the largest, the plan's fields from rank 0; or why it did not run (the first rank that
    said why, rather than a rank ended because another failed)."""
    failed = [r for r in ranks if "skipped" in r]
    if failed:
        first = next((r for r in failed if "ended without a result" not in r["skipped"]), failed[0])
        return {
            "skipped": first["skipped"],
            "out_of_memory": any(r.get("out_of_memory") for r in ranks),
            "ranks": ranks,
        }
    peaks = [r.get("peak_device_bytes") for r in ranks]
    row: dict[str, Any] = {k: ranks[0][k] for k in PLAN_FIELDS if k in ranks[0]}
    row.update(
        {
            "iteration_s": max(r["iteration_s"] for r in ranks),
            "iteration_s_per_rank": [r["iteration_s"] for r in ranks],
            "peak_device_bytes": None if None in peaks else max(peaks),
            "peak_device_bytes_per_rank": peaks,
            "peak_rss_bytes_per_rank": [r.get("peak_rss_bytes") for r in ranks],
            "ranks": ranks,
        }
    )
    return row


def compare_distributed(
    kind: str, layers: int, args: argparse.Namespace, device: torch.device
) -> dict[str, Any]:
    """ddp, fsdp2_offload and memplan, each on `--world-size` fresh ranks, the same global batch."""
    world = args.world_size
    base = {
        "kind": kind,
        "layers": layers,
        "hidden": args.hidden,
        "seq": args.seq,
        "batch": args.batch,
        "steps": args.steps,
        "device_type": device.type,
        "dtype": args.dtype,
        "threads": args.threads,
    }
    rows: dict[str, dict[str, Any]] = {}
    rows["ddp"] = combine_ranks(
        launch(run_rank, world, {**base, "strategy": "ddp", "limit_bytes": args.device_memory})
    )
    limit = args.device_memory or int((rows["ddp"].get("peak_device_bytes") or 0) * args.fraction)
    for name in ("fsdp2_offload", "memplan"):
        rows[name] = combine_ranks(launch(run_rank, world, {**base, "strategy": name, "limit_bytes": limit}))
    tokens = args.batch * args.seq  # the global batch: every rank trains batch / world rows of it
    for r in rows.values():
        if "iteration_s" in r:
            r["tokens_per_s"] = tokens / r["iteration_s"]
            peak = r.get("peak_device_bytes")
            r["fits"] = peak is not None and peak <= limit
    return {
        "kind": kind,
        "layers": layers,
        "world_size": world,
        "limit_bytes": limit,
        "tokens_per_iteration": tokens,
        "strategies": rows,
    }


def compare(kind: str, layers: int, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    from agent.runtime.options import job_trace
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
        "bf16_states": args.bf16_states,
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
            # planned for the job the runtime runs (fp32 master, undo backups), as `agent.wrap` plans
            job = job_trace(trace, memplan_options(None, args.bf16_states))
            plan = solve(job, Constraints(device_memory_bytes=limit, time_limit_s=10.0), solver=solver)
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


def ratio_lines(
    strategies: dict[str, dict[str, Any]],
    ours: str = "cpsat",
    others: tuple[str, ...] = ("protrain", "fsdp2_offload", "fsdp2_offload_ckpt"),
) -> list[str]:
    """`ours / other: N.NNx` for each comparison where both sides ran and fit the limit, else why not."""
    out = []
    c = strategies[ours]
    for other in others:
        o = strategies[other]
        if c.get("fits") and o.get("fits"):
            out.append(f"{ours} / {other}: {c['tokens_per_s'] / o['tokens_per_s']:.2f}x")
        else:
            why = [
                f"{n} {'did not fit' if 'iteration_s' in r else 'did not run'}"
                for n, r in ((ours, c), (other, o))
                if not r.get("fits")
            ]
            out.append(f"{ours} / {other}: no ratio ({', '.join(why)})")
    return out


def _mib(xs: list[Any]) -> str:
    return "/".join("-" if x is None else f"{x / 2**20:.1f}" for x in xs)


def row_notes(r: dict[str, Any]) -> str:
    """The notes column: the plan (memplan rows) and, for a multi-rank row, every rank's peaks."""
    notes = []
    if "modes" in r:
        notes.append(f"modes {r['modes']}, {r['offloaded_chunks']}/{r['chunks']} offloaded")
        if "sharded_chunks" in r:
            if r.get("gathered_peak_bytes"):
                notes.append(
                    f"whole copies gathered at most {r['gathered_peak_bytes'] / 2**20:.1f} MiB at once"
                )
            notes.append(
                f"{r['sharded_chunks']} sharded ({r.get('device_sharded_chunks', 0)} persistent, on the device; "
                f"plan world size {r['plan_world_size']}), "
                f"predicted peak {r['predicted_peak_device_bytes'] / 2**20:.1f} MiB, wrap {r['wrap_s']:.1f} s"
            )
    if "peak_device_bytes_per_rank" in r:
        notes.append(f"per rank: peak {_mib(r['peak_device_bytes_per_rank'])} MiB")
        if r["ranks"] and r["ranks"][0].get("peak_rss_bytes") is not None:
            notes.append(f"RSS peak over the steps {_mib(r['peak_rss_bytes_per_rank'])} MiB")
    return "; ".join(notes)


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
    ap.add_argument(
        "--world-size",
        type=int,
        default=1,
        help="ranks (N > 1: ddp, fsdp2_offload and memplan on N spawned ranks, the same global --batch "
        "split evenly; gloo on the CPU, NCCL with rank r on cuda:r)",
    )
    ap.add_argument(
        "--bf16-states",
        action="store_true",
        help="memplan's rows (one process) step as the FSDP2 rows do: no fp32 master, bf16 moments, no undo backup "
        "(RuntimeOptions(fp32_master=False, undo_host_steps=False)); default: memplan's defaults (an fp32 master and "
        "fp32 moments for a bf16 model, more accurate and more host work)",
    )
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.world_size < 1:
        ap.error(f"--world-size: must be at least 1, got {args.world_size}")
    if args.batch % args.world_size:
        ap.error(f"--batch: {args.batch} rows do not split evenly over --world-size {args.world_size}")
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
    if args.bf16_states and args.world_size > 1:
        ap.error(
            "--bf16-states: single-process comparisons only (the multi-rank rows use memplan's defaults)"
        )
    if args.dtype != "fp32":
        print(
            "note: memplan's rows "
            + (
                "step bf16 parameters and moments on the host, as FSDP2's do (--bf16-states)"
                if args.bf16_states
                else "keep an fp32 master and fp32 moments (FSDP2's rows step bf16 ones: --bf16-states compares "
                "the same arithmetic)"
            )
        )
    run = Run("train_throughput", args)
    depths = args.sweep or [args.layers]
    results = []
    distributed = args.world_size > 1
    strategies = DISTRIBUTED_STRATEGIES if distributed else STRATEGIES
    for layers in depths:
        res = (compare_distributed if distributed else compare)(args.kind, layers, args, device)
        results.append(res)
        ranks = (
            f"{args.world_size} ranks ({'nccl' if device.type == 'cuda' else 'gloo'}), "
            if distributed
            else ""
        )
        print(
            f"{args.kind}-{layers}L, {ranks}limit {res['limit_bytes'] / 2**20:.1f} MiB"
            f"{' per rank' if distributed else ''}, {res['tokens_per_iteration']} tokens/iteration"
        )
        print(f"  {'strategy':<18} {'tokens/s':>10} {'peak MiB':>9} {'fits':>5}  notes")
        for name in strategies:
            r = res["strategies"][name]
            if "skipped" in r:
                print(f"  {name:<18} {'-':>10} {'-':>9} {'-':>5}  not run: {r['skipped']}")
                continue
            peak = r.get("peak_device_bytes")
            print(
                f"  {name:<18} {r['tokens_per_s']:>10.0f} {(peak or 0) / 2**20:>9.2f} {str(r['fits']):>5}  "
                f"{row_notes(r)}"
            )
        lines = (
            ratio_lines(res["strategies"], "memplan", ("fsdp2_offload", "ddp"))
            if distributed
            else ratio_lines(res["strategies"])
        )
        for line in lines:
            print(f"  {line}")
    largest: dict[str, int | None] = {}
    if args.sweep:
        for name in strategies:
            ok = [res["layers"] for res in results if res["strategies"][name].get("fits")]
            largest[name] = max(ok) if ok else None
        print("largest model that fits the limit (layers):", largest)
    load = os.getloadavg()
    print(
        f"load average (1/5/15 min) before {'/'.join(f'{x:.2f}' for x in run.load_before)}, "
        f"after {'/'.join(f'{x:.2f}' for x in load)}"
    )
    save(args.out, run.document(device, results=results, largest_layers_that_fit=largest))


if __name__ == "__main__":
    main()
