"""Benchmark: host<->device copy bandwidth, each direction alone and both at once (issue 19 item 10c).

    .venv/bin/python benchmarks/copy_bandwidth.py              # CPU (and the GPU when present)
    .venv/bin/python benchmarks/copy_bandwidth.py --rounds 5 --device cuda:1

Runs the profiler's own hardware probe (`agent.profiler.hardware.measure_bandwidth`, what every trace
carries) `--rounds` times and prints, per size, the median over rounds of the pinned H2D and D2H rates alone
and while the other direction copies at the same time (two streams on CUDA, two threads on CPU), the ratio
duplex/alone, and the probe's wall seconds. The cost model charges the concurrent rates in windows that copy
both ways. Saved to benchmarks/results/copy_bandwidth.json. On a CPU "device" every copy is a memcpy: the
concurrent figures show what two copies at once get from the host's memory system and cores (the cost model
uses them only where copies overlap compute, i.e. on CUDA). Take figures on a quiet machine.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from agent.profiler.hardware import BANDWIDTH_SIZES, measure_bandwidth
from benchmarks._results import Run, save

RESULTS = Path(__file__).resolve().parent / "results" / "copy_bandwidth.json"
CURVES = ("h2d_pinned", "duplex_h2d_pinned", "d2h_pinned", "duplex_d2h_pinned")


def bench(device: torch.device, rounds: int) -> dict[str, Any]:
    rates: dict[str, list[list[float]]] = {k: [[] for _ in BANDWIDTH_SIZES] for k in CURVES}
    seconds: list[float] = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        curves = measure_bandwidth(device)
        seconds.append(time.perf_counter() - t0)
        for k in CURVES:
            for i, s in enumerate(getattr(curves, k)):
                rates[k][i].append(s.bytes_per_s)
    rows = []
    print(
        f"\n{device}: GB/s, median of {rounds} probes (probe wall median {statistics.median(seconds):.2f} s)"
    )
    print(f"{'size':>10} {'h2d':>8} {'h2d both':>9} {'ratio':>6} {'d2h':>8} {'d2h both':>9} {'ratio':>6}")
    for i, size in enumerate(BANDWIDTH_SIZES):
        med = {k: statistics.median(rates[k][i]) for k in CURVES}
        row = {"size_bytes": size, **{f"{k}_bytes_per_s": v for k, v in med.items()}}
        row["h2d_ratio"] = med["duplex_h2d_pinned"] / med["h2d_pinned"]
        row["d2h_ratio"] = med["duplex_d2h_pinned"] / med["d2h_pinned"]
        rows.append(row)
        print(
            f"{size:>10} {med['h2d_pinned'] / 1e9:>8.2f} {med['duplex_h2d_pinned'] / 1e9:>9.2f} "
            f"{row['h2d_ratio']:>6.2f} {med['d2h_pinned'] / 1e9:>8.2f} {med['duplex_d2h_pinned'] / 1e9:>9.2f} "
            f"{row['d2h_ratio']:>6.2f}"
        )
    return {"device": str(device), "rounds": rounds, "probe_wall_s": seconds, "rows": rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3, help="probes per device (median taken)")
    p.add_argument("--device", default=None, help="the GPU besides the CPU (default: cuda:0 when present)")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    run = Run("copy_bandwidth", args)
    gpu = (
        torch.device(args.device)
        if args.device
        else torch.device("cuda", 0)
        if torch.cuda.is_available()
        else None
    )
    devices = [torch.device("cpu")] + ([gpu] if gpu is not None and gpu.type != "cpu" else [])
    results = [bench(d, args.rounds) for d in devices]
    save(args.out, run.document(devices[-1], results=results))


if __name__ == "__main__":
    main()
