"""Benchmark: one offloaded chunk's host work against policy-1.8's host step charge (session 15).

    .venv/bin/python benchmarks/host_step_copies.py
    .venv/bin/python benchmarks/host_step_copies.py --sizes-mb 0.5 2 8 32 --reps 15

Around each offloaded chunk's host optimizer step the runtime (`agent/runtime/host_steps.py`) copies the
host gradient into the `.grad` it exposes, and the fp32 master and the optimizer state into the undo backup of
the speculative step, then steps the chunk with torch's fused AdamW over one flat tensor. Per chunk size this
times the same operations on host fp32 tensors (median of `--reps` after a warm-up): the step alone, the
copies, and both, against the cost model's charge for one chunk from the profiler's own figures: the step
(`host_step_overhead` + bytes / `host_step_throughput`, what policy-1.7 charged) and policy-1.8's copies
(`bandwidth.host_step_copy_bytes` / `host_copy_throughput`, charged off a CPU device). fp32 and AdamW, undo
backup on (the runtime's defaults). Saved to benchmarks/results/host_step_copies.json. Take figures on a quiet
machine; the copies' share is a property of the host's memory system, which is why a GPU job's host pays them
too.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from agent.profiler.optimizer_probe import host_copy_throughput, host_step_overhead, host_step_throughput
from benchmarks._results import Run, save
from planner_service.solver.bandwidth import host_step_copy_bytes

RESULTS = Path(__file__).resolve().parent / "results" / "host_step_copies.json"
UNDO_BYTES_PER_PARAM = 12  # an fp32 master and AdamW's two fp32 moments (`options.job_workload`)
ELT = 4


def timed(fn: Callable[[], None], reps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench(size_bytes: int, reps: int, rate: float, overhead: float, copy_rate: float) -> dict[str, Any]:
    n = size_bytes // ELT
    master = torch.zeros(n, requires_grad=True)
    host_grad = torch.full((n,), 1e-3)
    user_grad = torch.empty(n)
    opt = torch.optim.AdamW([master], lr=1e-3, fused=True)
    master.grad = host_grad
    opt.step()  # the state exists, as after the first iteration
    state = [v for v in opt.state[master].values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    backups = [torch.empty_like(v) for v in state]
    backup_master = torch.empty_like(master)

    def copies() -> None:
        user_grad.copy_(host_grad)
        with torch.no_grad():
            backup_master.copy_(master)
        for b, v in zip(backups, state, strict=True):
            b.copy_(v)

    def step() -> None:
        opt.step()

    def both() -> None:
        copies()
        step()

    step_s, copies_s, both_s = timed(step, reps), timed(copies, reps), timed(both, reps)
    copied = host_step_copy_bytes(n, n, ELT, UNDO_BYTES_PER_PARAM, separate_master=False, fill=True)
    charged_step = overhead + size_bytes / rate
    charged_copies = copied / copy_rate
    return {
        "size_bytes": size_bytes,
        "step_s": step_s,
        "copies_s": copies_s,
        "step_and_copies_s": both_s,
        "copied_bytes": copied,
        "charged_step_s": charged_step,
        "charged_copies_s": charged_copies,
        "error_step_only": charged_step / both_s - 1,
        "error_with_copies": (charged_step + charged_copies) / both_s - 1,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes-mb", type=float, nargs="+", default=[0.5, 2.0, 8.0, 32.0])
    p.add_argument("--reps", type=int, default=15, help="timed repetitions per size (median taken)")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    run = Run("host_step_copies", args)
    rate = host_step_throughput()
    overhead = host_step_overhead(rate)
    copy_rate = host_copy_throughput()
    print(
        f"profiler figures: host step {rate / 1e9:.2f} GB/s + {overhead * 1e3:.3f} ms per call, "
        f"host copy {copy_rate / 1e9:.2f} GB/s"
    )
    print(
        f"{'chunk MB':>8} {'step ms':>8} {'copies ms':>9} {'both ms':>8} {'charged 1.7':>11} {'error':>7} "
        f"{'charged 1.8':>11} {'error':>7}"
    )
    rows = []
    for mb in args.sizes_mb:
        row = bench(int(mb * 2**20) // ELT * ELT, args.reps, rate, overhead, copy_rate)
        rows.append(row)
        print(
            f"{mb:>8.1f} {row['step_s'] * 1e3:>8.3f} {row['copies_s'] * 1e3:>9.3f} "
            f"{row['step_and_copies_s'] * 1e3:>8.3f} {row['charged_step_s'] * 1e3:>11.3f} "
            f"{row['error_step_only']:>+7.1%} {(row['charged_step_s'] + row['charged_copies_s']) * 1e3:>11.3f} "
            f"{row['error_with_copies']:>+7.1%}"
        )
    save(
        args.out,
        run.document(
            host_step_bytes_per_s=rate,
            host_step_overhead_s=overhead,
            host_copy_bytes_per_s=copy_rate,
            rows=rows,
        ),
    )


if __name__ == "__main__":
    main()
