"""Optimizer facts: its kind and per-parameter state, and measured step throughput on device and host.

Device throughput is the real optimizer's `step()` timed inside the profiler's plain iterations
(parameter bytes stepped / seconds). Host throughput is a fused AdamW (`fused=True`, falling back to
`foreach=True` where this build has no fused CPU kernel) stepping `HOST_SAMPLE_BYTES` of host fp32
parameters in `HOST_SAMPLE_TENSORS` tensors (median of 3 steps after one warm-up step). It is a property
of the host, not of the model (fused kernels stream all tensors in one pass), so it is measured once per
process and reused.

Host step overhead (`host_step_overhead`): the runtime steps each offloaded chunk with its own call (one flat
tensor per run of the chunk: `agent/runtime/stepper.py`), and a call costs more than its bytes over the rate
(dispatch, the kernel's setup, the optimizer's Python): measured as the same fused step on one flat tensor of
`HOST_SMALL_BYTES`, less those bytes over the rate (median of `HOST_SMALL_REPS` steps). The cost model charges
each chunk's host step overhead + bytes / rate. On this development machine (AMD EPYC, 2 cores) the small step
took ~0.08 ms, of which ~0.07 ms is the overhead (docs/BENCHMARKS.md, session 9).

Host copy rate (`host_copy_throughput`): a host-to-host copy of `host_copy_sample_bytes()`, twice the host's
last-level cache (64-512 MiB), so that it streams from DRAM as the runtime's copies of chunks of tens to hundreds
of MB do: a copy that fits the cache reads fast (on the 2-core EPYC VM, 32 MiB L3: 11.7 GB/s for 16 MiB against
8.5-8.8 GB/s for 256-512 MiB; the H200's host, a 16-core Xeon, reports 300 MiB of L3). The fused AdamW step is
not sized so: it is compute-bound (on that Xeon 14.2 GB/s for 16 MiB of parameters, 16.1 for 256 MiB, 15.9 for
512 MiB; docs/BENCHMARKS.md "GPU, session 17"). Around each offloaded chunk's
step the runtime copies the master and optimizer state into the undo backup, and the host gradient into the
`.grad` it exposes (and, in mixed precision, the master into the compute copy): on the session-15 VM (Intel
Xeon, 2 cores) the backup alone took 0.5-1.45x the fused AdamW step of the same chunk (0.5-8 MB).
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from client.contract import OptimizerKind

HOST_SAMPLE_BYTES = 16 * 2**20
HOST_SAMPLE_TENSORS = 16
COPY_SAMPLE_MIN_BYTES = 64 * 2**20
COPY_SAMPLE_MAX_BYTES = 512 * 2**20
ASSUMED_CACHE_BYTES = 32 * 2**20  # where the OS does not say (no sysfs cache entries): a common server L3
CACHE_SYSFS = Path("/sys/devices/system/cpu/cpu0/cache")
HOST_SMALL_BYTES = 64 * 2**10
HOST_SMALL_REPS = 9

_KINDS: dict[str, OptimizerKind] = {
    "AdamW": OptimizerKind.adamw,
    "Adam": OptimizerKind.adam,
    "SGD": OptimizerKind.sgd,
}


def optimizer_kind(optimizer: torch.optim.Optimizer) -> OptimizerKind:
    name = type(optimizer).__name__
    kind = _KINDS.get(name)
    if kind is None:
        raise ValueError(
            f"optimizer: {name} is not one the wire contract v1 describes ({', '.join(_KINDS)}); "
            "profile with one of those (the cost model needs its state size and step cost)"
        )
    return kind


def state_tensors(optimizer: torch.optim.Optimizer) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every tensor of the optimizer's state, with the parameter it belongs to."""
    out: list[tuple[torch.Tensor, torch.Tensor]] = []
    for p, state in optimizer.state.items():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                out.append((p, v))
    return out


def state_bytes_per_param(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter]) -> int:
    """Measured optimizer-state bytes per parameter element (rounded), e.g. 8 for AdamW's fp32 moments."""
    numel = sum(p.numel() for p in params)
    if numel == 0:
        return 0
    ids = {id(p) for p in params}
    total = sum(v.numel() * v.element_size() for p, v in state_tensors(optimizer) if id(p) in ids)
    return round(total / numel)


def host_step_throughput(reps: int = 3) -> float:
    """Parameter bytes per second of a fused (or foreach) AdamW step on host fp32 tensors (cached per process)."""
    return _measure_host_step(HOST_SAMPLE_TENSORS, HOST_SAMPLE_BYTES // HOST_SAMPLE_TENSORS // 4, reps)


def last_level_cache_bytes(root: Path = CACHE_SYSFS) -> int | None:
    """The largest CPU cache the OS reports for CPU 0 (sysfs `index*/size`: "32768K", "300M"), or None."""
    sizes = []
    for index in root.glob("index*"):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        unit = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:].upper(), 1)
        digits = text[:-1] if unit != 1 else text
        if digits.isdigit():
            sizes.append(int(digits) * unit)
    return max(sizes) if sizes else None


def host_copy_sample_bytes(cache_bytes: int | None = None) -> int:
    """Bytes the host copy probe copies: twice the last-level cache (`ASSUMED_CACHE_BYTES` where unknown), within
    64-512 MiB, a multiple of 4."""
    cache = cache_bytes if cache_bytes is not None else last_level_cache_bytes()
    wanted = 2 * (cache or ASSUMED_CACHE_BYTES)
    return min(COPY_SAMPLE_MAX_BYTES, max(COPY_SAMPLE_MIN_BYTES, wanted // 4 * 4))


@functools.lru_cache(maxsize=1)
def host_copy_throughput(reps: int = 3) -> float:
    """Bytes written per second by a host-to-host copy of `host_copy_sample_bytes()` (fp32, median of `reps` after
    a warm-up; cached per process): the rate of the runtime's copies around a host step (`host_steps.py`)."""
    size = host_copy_sample_bytes()
    src = torch.ones(size // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)
    return size / _median_s(lambda: dst.copy_(src), reps)


def host_step_overhead(rate: float | None = None, reps: int = HOST_SMALL_REPS) -> float:
    """Seconds per host step call beyond its bytes over `rate` (default: `host_step_throughput()`), from a
    step of one flat `HOST_SMALL_BYTES` tensor (cached per process); never negative."""
    rate = host_step_throughput() if rate is None else rate
    small_s = HOST_SMALL_BYTES / _measure_host_step(1, HOST_SMALL_BYTES // 4, reps)
    return max(0.0, small_s - HOST_SMALL_BYTES / rate)


@functools.lru_cache(maxsize=4)
def _measure_host_step(n_tensors: int, numel: int, reps: int) -> float:
    tensors = [torch.zeros(numel, dtype=torch.float32, requires_grad=True) for _ in range(n_tensors)]
    for t in tensors:
        t.grad = torch.full_like(t, 1e-3)
    try:
        opt = torch.optim.AdamW(tensors, lr=1e-3, fused=True)
        opt.step()
    except (RuntimeError, TypeError, ValueError):
        opt = torch.optim.AdamW(tensors, lr=1e-3, foreach=True)
        opt.step()
    return n_tensors * numel * 4 / _median_s(opt.step, reps)


def _median_s(run: Callable[[], object], reps: int) -> float:
    """Median wall seconds of `reps` calls of `run` (after the caller's warm-up), never below 1 ns."""
    times: list[float] = []
    for _ in range(reps):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return max(statistics.median(times), 1e-9)
