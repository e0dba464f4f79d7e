"""Constructive best-fit placement: fast, always succeeds, and the upper bound the exact search improves.

Buffers are taken in a fixed order (several orders are tried; the best wins). Each goes into the
smallest gap, among the buffers already placed that overlap it in time, that is large enough
(best fit; lowest offset on ties), or on top of them when no gap fits. This is the "greedy by size"
planner of TensorFlow Lite's arena planner generalised to other orders. Per buffer the overlapping
set is found with numpy over the placed arrays, so n buffers cost O(n^2 / vector width).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np

# name -> sort key over (lower, upper, size); larger key first.
ORDERS: dict[str, Callable[[int, int, int], tuple[int, ...]]] = {
    "size": lambda lo, up, sz: (sz, up - lo, -lo),
    "area": lambda lo, up, sz: (sz * (up - lo), sz, -lo),
    "length": lambda lo, up, sz: (up - lo, sz, -lo),
    "start": lambda lo, up, sz: (-lo, sz, up - lo),
}


def best_fit(
    lowers: Sequence[int],
    uppers: Sequence[int],
    sizes: Sequence[int],
    order: str,
    *,
    deadline: float | None = None,
) -> list[int] | None:
    """Offsets of a best-fit placement with buffers taken in `order` (a key of `ORDERS`).

    With a `deadline` (a `time.perf_counter()` value), None when it passes first (checked every 128 buffers).
    """
    n = len(sizes)
    key = ORDERS[order]
    sequence = sorted(range(n), key=lambda i: key(lowers[i], uppers[i], sizes[i]), reverse=True)
    lo = np.asarray(lowers, dtype=np.int64)[sequence]
    up = np.asarray(uppers, dtype=np.int64)[sequence]
    sz = np.asarray(sizes, dtype=np.int64)[sequence]
    off = np.zeros(n, dtype=np.int64)
    for k in range(n):
        if deadline is not None and (k & 127) == 127 and time.perf_counter() > deadline:
            return None
        mask = (lo[:k] < up[k]) & (up[:k] > lo[k])
        if not mask.any():
            continue  # offset 0
        starts = off[:k][mask]
        ends = starts + sz[:k][mask]
        order_idx = np.argsort(starts, kind="stable")
        starts = starts[order_idx]
        ends = np.maximum.accumulate(ends[order_idx])
        # Gaps: [0, starts[0]) and [ends[i-1], starts[i]) where positive, and the top from ends[-1].
        gap_lo = np.concatenate(([0], ends[:-1]))
        gap_len = starts - gap_lo
        fits = gap_len >= sz[k]
        if fits.any():
            cand = np.flatnonzero(fits)
            best = cand[np.argmin(gap_len[cand])]  # smallest fitting gap, first (lowest) on ties
            off[k] = gap_lo[best]
        else:
            off[k] = ends[-1]
    result = [0] * n
    for pos, i in enumerate(sequence):
        result[i] = int(off[pos])
    return result
