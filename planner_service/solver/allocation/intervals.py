"""Lifetimes as numpy arrays: live-bytes peak, zero-cut partitions, and an allocation trace's columns.

The vectorised counterparts of `buffers.peak_live_bytes` and `sweep.sweep`'s partitions, for traces of
10^5..10^6 events, where a Python loop over events (or a list of 10^6 pydantic events) costs seconds.
Lifetimes are half-open [lower, upper): at equal times frees come before allocations.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from client.contract import AllocationTrace


def _endpoint_order(lowers: np.ndarray, uppers: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(buffer index, +1 alloc / -1 free) of the 2n endpoints in time order, frees first at equal times."""
    n = lowers.shape[0]
    # key = 2 * time + (0 free, 1 alloc): one stable integer sort instead of a lexsort.
    keys = np.concatenate((2 * uppers, 2 * lowers + 1))
    order = np.argsort(keys, kind="stable")
    idx = np.concatenate((np.arange(n), np.arange(n)))[order]
    sign = np.where(order >= n, 1, -1)
    return idx, sign


def peak_live(lowers: np.ndarray, uppers: np.ndarray, sizes: np.ndarray) -> int:
    """Max over time of the summed size of live buffers (the live-bytes lower bound), O(n log n)."""
    if sizes.shape[0] == 0:
        return 0
    idx, sign = _endpoint_order(lowers, uppers)
    live = np.cumsum(sign * sizes[idx])
    return max(int(live.max()), 0)


def overlap_pairs(lowers: np.ndarray, uppers: np.ndarray) -> int:
    """Number of pairs of buffers live at a common time (what the search's preprocessing enumerates)."""
    if lowers.shape[0] == 0:
        return 0
    _, sign = _endpoint_order(lowers, uppers)
    live = np.cumsum(sign)
    return int((live[sign > 0] - 1).sum())


@dataclass(slots=True)
class Partitions:
    """Buffers grouped into runs of time that no buffer crosses (a zero-cut between consecutive runs)."""

    of_buffer: np.ndarray  # partition number of every buffer (partitions numbered in time order)
    members: np.ndarray  # buffer indices grouped by partition, each group in increasing index order
    starts: np.ndarray  # members[starts[p]:starts[p + 1]] are partition p's buffers; len = count + 1

    @property
    def count(self) -> int:
        return int(self.starts.shape[0] - 1)

    def of(self, p: int) -> np.ndarray:
        return self.members[self.starts[p] : self.starts[p + 1]]


def partitions(lowers: np.ndarray, uppers: np.ndarray) -> Partitions:
    """Independent sub-problems: buffers separated by a time at which nothing is live."""
    n = lowers.shape[0]
    if n == 0:
        return Partitions(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(1, np.int64))
    idx, sign = _endpoint_order(lowers, uppers)
    live = np.cumsum(sign)
    # A partition ends at every endpoint after which nothing is live; an allocation belongs to the
    # partition numbered by how many such ends precede it.
    ended_before = np.concatenate(([0], np.cumsum(live == 0)[:-1]))
    of_buffer = np.empty(n, dtype=np.int64)
    allocs = sign > 0
    of_buffer[idx[allocs]] = ended_before[allocs]
    members = np.argsort(of_buffer, kind="stable")
    counts = np.bincount(of_buffer)
    starts = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
    return Partitions(of_buffer, members, starts)


@dataclass(slots=True)
class TraceArrays:
    """An `AllocationTrace`'s events as int64 arrays, read from its packed columns (never from `trace.events`)."""

    ids: np.ndarray
    sizes: np.ndarray  # bytes
    alloc: np.ndarray  # logical time
    free: np.ndarray  # logical time; -1 for a long-lived buffer (free_index None)
    horizon: int

    @property
    def long_lived(self) -> np.ndarray:
        return self.free < 0


def trace_arrays(trace: AllocationTrace) -> TraceArrays:
    a = trace.arrays
    return TraceArrays(
        a.array("id").astype(np.int64),
        a.array("size_bytes").astype(np.int64),
        a.array("alloc_index").astype(np.int64),
        a.array("free_index").astype(np.int64),
        trace.horizon,
    )


def trace_lower_bound_arrays(arrays: TraceArrays) -> int:
    """Long-lived bytes (live at every time of the steady state) plus the iteration's live-bytes peak."""
    ll = arrays.long_lived
    rest = ~ll
    return int(arrays.sizes[ll].sum()) + peak_live(arrays.alloc[rest], arrays.free[rest], arrays.sizes[rest])
