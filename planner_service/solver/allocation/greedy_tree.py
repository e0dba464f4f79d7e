"""Best fit over a static order (size, area, length, start) without the quadratic scan: segment trees over time.

The same placement as `greedy.best_fit` (each buffer, in order, into the smallest gap that fits among the
already placed buffers overlapping it in time, lowest offset on ties, else on top), but the placed
buffers that overlap a new one are found through two segment trees over the compressed time axis
instead of a scan of every placed buffer:

* a *stabbing* tree holds each placed buffer at the O(log T) nodes that cover its lifetime exactly, so
  walking from the leaf of the new buffer's start to the root meets every placed buffer live then;
* a *start* tree holds each placed buffer at every ancestor of its start's leaf, so the canonical nodes
  of the new buffer's open lifetime (start, end) hold every placed buffer that starts inside it.

The two sets are disjoint and together are exactly the overlapping placed buffers; they are then sorted
by offset to find the gaps. Cost: O(n log T) to build, O(log T + k log k) per buffer with k overlapping
placed buffers, so O(pairs log) in all instead of O(n^2): on profiled traces (k ~ 10^3) 10^5 buffers take
seconds. Node lists are preallocated (capacities counted first), compiled with numba, and the loop
checks a deadline about every 20,000 overlapping buffers handled (so within milliseconds even where one
buffer overlaps 10^5 others), so the planner can abandon it.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from planner_service.solver.allocation.numba_clock import now

# Buffers taken in decreasing key order (ties by index), as `greedy.ORDERS`: the lexsort keys below
# (last key primary, ascending) express (size, length, -lower) etc. descending.


def greedy_order(lowers: np.ndarray, uppers: np.ndarray, sizes: np.ndarray, order: str) -> np.ndarray:
    """Buffer indices in the sequence of `greedy.ORDERS[order]` (same keys, same tie-breaking)."""
    length = uppers - lowers
    if order == "size":
        keys = (lowers, -length, -sizes)
    elif order == "area":
        keys = (lowers, -sizes, -(sizes * length))
    elif order == "length":
        keys = (lowers, -sizes, -length)
    elif order == "start":
        keys = (-length, -sizes, lowers)
    else:
        raise ValueError(f"order: {order!r} is not one of size, area, length, start")
    return np.lexsort(keys)


@njit(cache=True, nogil=True)
def _build(first, last, tree_size):  # type: ignore[no-untyped-def]
    """CSR pointers of both trees' node lists (capacity = every buffer that could be stored there)."""
    n = first.shape[0]
    stab_count = np.zeros(2 * tree_size + 1, dtype=np.int64)
    start_count = np.zeros(2 * tree_size + 1, dtype=np.int64)
    for b in range(n):
        lo = first[b] + tree_size
        hi = last[b] + tree_size
        while lo < hi:
            if lo & 1:
                stab_count[lo] += 1
                lo += 1
            if hi & 1:
                hi -= 1
                stab_count[hi] += 1
            lo >>= 1
            hi >>= 1
        node = first[b] + tree_size
        while node >= 1:
            start_count[node] += 1
            node >>= 1
    stab_ptr = np.zeros(2 * tree_size + 2, dtype=np.int64)
    start_ptr = np.zeros(2 * tree_size + 2, dtype=np.int64)
    for i in range(2 * tree_size + 1):
        stab_ptr[i + 1] = stab_ptr[i] + stab_count[i]
        start_ptr[i + 1] = start_ptr[i] + start_count[i]
    return stab_ptr, start_ptr


@njit(cache=True, nogil=True)
def _place(order, first, last, sizes, tree_size, stab_ptr, start_ptr, deadline):  # type: ignore[no-untyped-def]
    n = first.shape[0]
    off = np.zeros(n, dtype=np.int64)
    stab_fill = stab_ptr[:-1].copy()
    start_fill = start_ptr[:-1].copy()
    stab_items = np.empty(stab_ptr[-1], dtype=np.int32)
    start_items = np.empty(start_ptr[-1], dtype=np.int32)
    found = np.empty(n, dtype=np.int64)
    work = 0  # overlapping buffers handled since the last deadline check
    for step in range(n):
        if work > 20_000:
            work = 0
            if now() > deadline:
                return off, False
        b = order[step]
        k = 0
        # Placed buffers live at b's start: every list on the path from its start leaf to the root.
        node = first[b] + tree_size
        while node >= 1:
            for j in range(stab_ptr[node], stab_fill[node]):
                found[k] = stab_items[j]
                k += 1
            node >>= 1
        # Placed buffers starting strictly inside b's lifetime: canonical nodes of [first + 1, last).
        lo = first[b] + 1 + tree_size
        hi = last[b] + tree_size
        while lo < hi:
            if lo & 1:
                for j in range(start_ptr[lo], start_fill[lo]):
                    found[k] = start_items[j]
                    k += 1
                lo += 1
            if hi & 1:
                hi -= 1
                for j in range(start_ptr[hi], start_fill[hi]):
                    found[k] = start_items[j]
                    k += 1
            lo >>= 1
            hi >>= 1
        size = sizes[b]
        work += k + 64
        if k > 0:
            starts = np.empty(k, dtype=np.int64)
            for i in range(k):
                starts[i] = off[found[i]]
            idx = np.argsort(starts, kind="mergesort")
            run = 0  # highest end among the placed buffers below the current gap
            best_len = -1
            best_off = 0
            for i in range(k):
                o = found[idx[i]]
                gap = off[o] - run
                if gap >= size and (best_len < 0 or gap < best_len):
                    best_len = gap
                    best_off = run
                end = off[o] + sizes[o]
                if end > run:
                    run = end
            off[b] = best_off if best_len >= 0 else run
        # Register b as placed in both trees.
        lo = first[b] + tree_size
        hi = last[b] + tree_size
        while lo < hi:
            if lo & 1:
                stab_items[stab_fill[lo]] = b
                stab_fill[lo] += 1
                lo += 1
            if hi & 1:
                hi -= 1
                stab_items[stab_fill[hi]] = b
                stab_fill[hi] += 1
            lo >>= 1
            hi >>= 1
        node = first[b] + tree_size
        while node >= 1:
            start_items[start_fill[node]] = b
            start_fill[node] += 1
            node >>= 1
    return off, True


class TreeBestFit:
    """The trees' layout for one problem, built once; `place(order)` runs best fit in one order."""

    def __init__(self, lowers: np.ndarray, uppers: np.ndarray, sizes: np.ndarray) -> None:
        self.lo = np.asarray(lowers, dtype=np.int64)
        self.up = np.asarray(uppers, dtype=np.int64)
        self.sz = np.asarray(sizes, dtype=np.int64)
        times = np.unique(np.concatenate((self.lo, self.up)))
        self.first = np.searchsorted(times, self.lo)
        self.last = np.searchsorted(times, self.up)
        self.tree_size = 1
        while self.tree_size < times.shape[0]:
            self.tree_size *= 2
        self.stab_ptr, self.start_ptr = _build(self.first, self.last, self.tree_size)

    def place(self, order: str, *, deadline: float | None = None) -> np.ndarray | None:
        """Offsets of best fit in `order` (as `greedy.best_fit`), or None when `deadline` passed first."""
        if self.sz.shape[0] == 0:
            return np.zeros(0, dtype=np.int64)
        sequence = greedy_order(self.lo, self.up, self.sz, order)
        off, done = _place(
            sequence,
            self.first,
            self.last,
            self.sz,
            self.tree_size,
            self.stab_ptr,
            self.start_ptr,
            float("inf") if deadline is None else deadline,
        )
        return off if done else None


def tree_best_fit(
    lowers: np.ndarray,
    uppers: np.ndarray,
    sizes: np.ndarray,
    order: str,
    *,
    deadline: float | None = None,
) -> np.ndarray | None:
    """Offsets of best fit in `order` (as `greedy.best_fit`), or None when `deadline` passed first."""
    return TreeBestFit(lowers, uppers, sizes).place(order, deadline=deadline)
