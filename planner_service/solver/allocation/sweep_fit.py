"""Best fit in time order: an O(n log n) constructive placement for traces of any size (10^6 buffers).

The buffers are replayed as an allocator would see them (frees before allocations at equal times; at
equal times larger buffers first). The live buffers form a doubly linked list in address order; the
free gaps between address neighbours sit in a treap keyed by (length, start), so each allocation takes
the smallest gap that fits (lowest address on ties), or goes on top of the highest live buffer, and each
free merges the gaps on both sides: O(log n) per event. Taking buffers by start time, the buffers that
overlap a new one in time are exactly those live at its start, so this is the "start" order of the
quadratic best fit in `greedy.py`, at n log n.

Run backwards (time reversed: frees become allocations), it gives a second, different placement of the
same problem; `planner.py` keeps the better of the two. On profiled LLM iterations both are within a
fraction of a percent of the live-bytes bound (docs/BENCHMARKS.md, "Scale").

Units: times are logical, sizes and offsets in the caller's units (alignment units in the planner).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from planner_service.solver.allocation.treap import NIL, new_treap, treap_ceiling, treap_insert, treap_remove


def event_order(lowers: np.ndarray, uppers: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """Replay order as codes: `i` allocates buffer i, `-1 - i` frees it. Frees first at equal times,
    then allocations by decreasing size, then by index."""
    n = lowers.shape[0]
    idx = np.arange(n, dtype=np.int64)
    times = np.concatenate((uppers, lowers)).astype(np.int64)
    kind = np.concatenate((np.zeros(n, np.int64), np.ones(n, np.int64)))
    neg_size = np.concatenate((np.zeros(n, np.int64), -sizes.astype(np.int64)))
    codes = np.concatenate((-1 - idx, idx))
    order = np.lexsort((np.concatenate((idx, idx)), neg_size, kind, times))
    return codes[order]


@njit(cache=True, nogil=True)
def _replay_best_fit(codes, sizes, k1, k2, pri, left, right, parent, root):  # type: ignore[no-untyped-def]
    n = sizes.shape[0]
    bottom = n  # sentinel slot: a zero-size "buffer" ending at address 0
    off = np.zeros(n, dtype=np.int64)
    end = np.zeros(n + 1, dtype=np.int64)
    prev = np.full(n + 1, NIL, dtype=np.int64)
    nxt = np.full(n + 1, NIL, dtype=np.int64)
    has_gap = np.zeros(n + 1, dtype=np.bool_)  # slot's gap (above it, below its next) is in the treap
    tail = bottom
    for c in codes:
        if c >= 0:
            x = c
            s = sizes[x]
            a = treap_ceiling(k1, k2, left, right, root, s, -1)
            if a != NIL:
                treap_remove(k1, k2, pri, left, right, parent, root, a)
                has_gap[a] = False
            else:
                a = tail
            b = nxt[a]
            off[x] = end[a]
            end[x] = end[a] + s
            prev[x] = a
            nxt[x] = b
            nxt[a] = x
            if b == NIL:
                tail = x
            else:
                prev[b] = x
                room = off[b] - end[x]
                if room > 0:
                    treap_insert(k1, k2, pri, left, right, parent, root, x, room, end[x])
                    has_gap[x] = True
        else:
            x = -1 - c
            p = prev[x]
            b = nxt[x]
            if has_gap[p]:
                treap_remove(k1, k2, pri, left, right, parent, root, p)
                has_gap[p] = False
            if has_gap[x]:
                treap_remove(k1, k2, pri, left, right, parent, root, x)
                has_gap[x] = False
            nxt[p] = b
            if b == NIL:
                tail = p
            else:
                prev[b] = p
                treap_insert(k1, k2, pri, left, right, parent, root, p, off[b] - end[p], end[p])
                has_gap[p] = True
    return off


def sweep_best_fit(
    lowers: np.ndarray, uppers: np.ndarray, sizes: np.ndarray, *, reverse: bool = False
) -> np.ndarray:
    """Offsets (int64 array) of best fit in time order; `reverse=True` replays time backwards."""
    lo = np.asarray(lowers, dtype=np.int64)
    up = np.asarray(uppers, dtype=np.int64)
    sz = np.asarray(sizes, dtype=np.int64)
    n = sz.shape[0]
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    if reverse:
        horizon = int(up.max())
        lo, up = horizon - up, horizon - lo
    # Number the buffers by start time: the replay then touches its per-buffer arrays almost in order.
    perm = np.argsort(lo, kind="stable")
    lo, up, sz = lo[perm], up[perm], sz[perm]
    codes = event_order(lo, up, sz)
    out = np.empty(n, dtype=np.int64)
    out[perm] = _replay_best_fit(codes, sz, *new_treap(n + 1))
    return out
