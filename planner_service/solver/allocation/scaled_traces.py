"""Large allocation traces for tests and benchmarks: a profiled trace replicated, and random ones.

Every number in a real trace is measured; these are built from one (or drawn at random) only to test
and time the planner at 10^5..10^6 events, where profiling a real model of that size is not possible
on a CI machine. Built straight into packed arrays (`EventArrays`), never as 10^6 event objects.

* `replicate_trace(trace, copies, layout="sequential")`: the iteration repeated `copies` times one after
  the other (like micro-batches of gradient accumulation; the model's long-lived buffers replicated too,
  so memory grows like a model `copies` times larger that runs its parts in turn). Between copies
  nothing of the iteration is live, so the planner sees `copies` identical partitions.
* `layout="deep"`: a model `copies` times deeper: the forward parts of all copies in order, then their
  backward parts in reverse order, then their optimizer parts. Activations saved in copy k's forward
  stay live until copy k's backward, across every later copy, as in a deep network: one partition,
  with a live set `copies` times larger at the peak.
* `random_trace(n, ...)`: start times uniform, lifetimes exponential (so about `mean_live` buffers are
  live at a time), sizes log-uniform from 512 B to 64 MiB, a few long-lived buffers.
"""

from __future__ import annotations

from typing import Literal

import numpy as np

from client.contract import AllocationCategory, AllocationTrace, EventArrays, Phase
from client.contract.trace import CATEGORIES, PHASES
from planner_service.solver.allocation.intervals import trace_arrays


def _phase_bounds(trace: AllocationTrace) -> tuple[int, int]:
    """(first backward time, first optimizer time) of one iteration; horizon when a phase is absent."""
    a = trace.arrays
    h = trace.horizon
    alloc, phase = a.array("alloc_index"), a.array("phase")
    bwd = alloc[phase == PHASES.index(Phase.backward)]
    opt = alloc[phase == PHASES.index(Phase.optimizer)]
    b_start = int(bwd.min()) if bwd.size else h
    o_start = max(int(opt.min()) if opt.size else h, b_start)
    return b_start, o_start


def _deep_time(t: np.ndarray, k: int, copies: int, f: int, b: int, h: int) -> np.ndarray:
    """Copy k's time t in the deep layout (strictly increasing in t within a copy)."""
    fwd = k * f + t
    bwd = copies * f + (copies - 1 - k) * (b - f) + (t - f)
    opt = copies * b + k * (h - b) + (t - b)
    out = np.where(t < f, fwd, np.where(t < b, bwd, opt))
    return np.where(t >= h, copies * h, out)


def replicate_trace(
    trace: AllocationTrace,
    copies: int,
    *,
    layout: Literal["sequential", "deep"] = "sequential",
) -> AllocationTrace:
    """`copies` copies of `trace`'s iteration laid out in time as described in the module docstring."""
    if copies < 1:
        raise ValueError(f"copies: must be at least 1, got {copies}")
    if layout not in ("sequential", "deep"):
        raise ValueError(f"layout: {layout!r} is not 'sequential' or 'deep'")
    arr = trace_arrays(trace)
    packed = trace.arrays
    h = trace.horizon
    id_step = int(arr.ids.max()) + 1 if arr.ids.size else 1
    f, b = _phase_bounds(trace)
    ids, allocs, frees = [], [], []
    long_lived = arr.free < 0
    for k in range(copies):
        ids.append(arr.ids + k * id_step)
        if layout == "sequential":
            allocs.append(arr.alloc + k * h)
            frees.append(np.where(long_lived, -1, arr.free + k * h))
        else:
            allocs.append(_deep_time(arr.alloc, k, copies, f, b, h))
            frees.append(np.where(long_lived, -1, _deep_time(arr.free, k, copies, f, b, h)))
    arrays = EventArrays.from_arrays(
        id=np.concatenate(ids),
        size_bytes=np.tile(arr.sizes, copies),
        alloc_index=np.concatenate(allocs),
        free_index=np.concatenate(frees),
        category=np.tile(packed.array("category"), copies),
        block=np.tile(packed.array("block"), copies),
        phase=np.tile(packed.array("phase"), copies),
    )
    return AllocationTrace(source=trace.source, horizon=copies * h, event_arrays=arrays)


def random_trace(
    n: int,
    *,
    seed: int = 0,
    mean_live: int = 1000,
    long_lived_fraction: float = 0.01,
) -> AllocationTrace:
    """A random trace of `n` events over a horizon of `4 n` steps (see the module docstring)."""
    if n < 1:
        raise ValueError(f"n: must be at least 1, got {n}")
    rng = np.random.default_rng(seed)
    horizon = 4 * n
    alloc = rng.integers(0, horizon - 1, size=n)
    # Arrivals at rate n / horizon per step, so a mean lifetime of mean_live * horizon / n keeps
    # about mean_live buffers live (Little's law), up to the clipping at the horizon.
    life = np.maximum(1, rng.exponential(mean_live * horizon / n, size=n).astype(np.int64))
    free = np.minimum(alloc + life, horizon)
    long_lived = rng.random(n) < long_lived_fraction
    sizes = np.exp(rng.uniform(np.log(512), np.log(64 << 20), size=n)).astype(np.int64)
    arrays = EventArrays.from_arrays(
        id=np.arange(n),
        size_bytes=sizes,
        alloc_index=alloc,
        free_index=np.where(long_lived, -1, free),
        category=np.where(
            long_lived, CATEGORIES.index(AllocationCategory.param), CATEGORIES.index(AllocationCategory.temp)
        ),
        block=np.full(n, -1),
        phase=np.full(n, PHASES.index(Phase.forward)),
    )
    return AllocationTrace(source="dispatch_tracker", horizon=horizon, event_arrays=arrays)
