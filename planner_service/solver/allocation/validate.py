"""Placement validator: no two buffers live at the same time share an address; capacity; alignment.

Used by the tests and by the service before any allocation plan is stored. A sweep over time keeps the
live buffers ordered by offset (a treap, `treap.py`), so checking a new buffer against its two address
neighbours is enough (the live set is overlap-free by induction): O(n log n), compiled with numba, so
10^6 buffers take about a second. The per-buffer checks (sign, alignment, capacity) are numpy.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
from numba import njit

from planner_service.solver.allocation.buffers import Buffer
from planner_service.solver.allocation.treap import (
    NIL,
    new_treap,
    treap_ceiling,
    treap_floor_below,
    treap_insert,
    treap_remove,
)


class AllocationValidationError(ValueError):
    """A placement that must not be used; the message names the buffers, the time or the field."""


@njit(cache=True, nogil=True)
def _first_overlap(order, lowers, uppers, sizes, offsets, k1, k2, pri, left, right, parent, root):  # type: ignore[no-untyped-def]
    """(live buffer, new buffer, time) of the first clash in sweep order, or (-1, -1, -1)."""
    n = sizes.shape[0]
    for code in order:
        if code < n:  # free (codes 0..n-1 are frees, n..2n-1 allocations)
            treap_remove(k1, k2, pri, left, right, parent, root, code)
            continue
        i = code - n
        start = offsets[i]
        end = start + sizes[i]
        below = treap_floor_below(k1, k2, left, right, root, start, i)
        if below != NIL and offsets[below] < end and start < offsets[below] + sizes[below]:
            return below, i, lowers[i]
        above = treap_ceiling(k1, k2, left, right, root, start, i)
        if above != NIL and offsets[above] < end and start < offsets[above] + sizes[above]:
            return above, i, lowers[i]
        treap_insert(k1, k2, pri, left, right, parent, root, i, start, i)
    return -1, -1, -1


def check_placement_arrays(
    lowers: np.ndarray,
    uppers: np.ndarray,
    sizes: np.ndarray,
    offsets: np.ndarray,
    name: Callable[[int], str],
    *,
    capacity: int | None = None,
    alignment: int = 1,
) -> None:
    """`validate_placement` on int64 arrays; `name(i)` names buffer i in messages."""
    bad = offsets < 0
    if alignment > 1:
        bad |= offsets % alignment != 0
    if capacity is not None:
        bad |= offsets + sizes > capacity
    if bad.any():
        i = int(np.argmax(bad))
        off = int(offsets[i])
        if off < 0:
            raise AllocationValidationError(f"buffer {name(i)}: offset {off} is negative")
        if alignment > 1 and off % alignment:
            raise AllocationValidationError(
                f"buffer {name(i)}: offset {off} is not a multiple of alignment {alignment}"
            )
        raise AllocationValidationError(
            f"buffer {name(i)}: ends at {off + int(sizes[i])} bytes, beyond capacity {capacity}"
        )
    n = sizes.shape[0]
    if n == 0:
        return
    # Sweep order: by time, frees (codes 0..n-1) before allocations (n..2n-1), then buffer index.
    keys = np.concatenate((2 * uppers, 2 * lowers + 1))
    order = np.argsort(keys, kind="stable")
    o, i, t = _first_overlap(order, lowers, uppers, sizes, offsets, *new_treap(n))
    if i >= 0:
        o_off, i_off = int(offsets[o]), int(offsets[i])
        raise AllocationValidationError(
            f"buffers {name(int(o))} and {name(int(i))} overlap at time {int(t)}: addresses "
            f"[{o_off}, {o_off + int(sizes[o])}) and [{i_off}, {i_off + int(sizes[i])})"
        )


def validate_placement(
    buffers: Sequence[Buffer],
    offsets: Sequence[int],
    *,
    capacity: int | None = None,
    alignment: int = 1,
) -> None:
    """Raise `AllocationValidationError` at the first violated rule, else return None."""
    if len(offsets) != len(buffers):
        raise AllocationValidationError(f"offsets: {len(offsets)} given for {len(buffers)} buffers")
    n = len(buffers)
    check_placement_arrays(
        np.fromiter((b.lower for b in buffers), dtype=np.int64, count=n),
        np.fromiter((b.upper for b in buffers), dtype=np.int64, count=n),
        np.fromiter((b.size for b in buffers), dtype=np.int64, count=n),
        np.asarray(offsets, dtype=np.int64).reshape(n),
        lambda i: buffers[i].id,
        capacity=capacity,
        alignment=alignment,
    )
