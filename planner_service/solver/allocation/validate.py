"""Placement validator: no two buffers live at the same time share an address; capacity; alignment.

Used by the tests and by the service before any allocation plan is stored. A sweep over time keeps the
live buffers sorted by offset, so checking a new buffer against its two address neighbours is enough
(the live set is overlap-free by induction): O(n log n) plus list inserts, fine for millions of events.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from planner_service.solver.allocation.buffers import Buffer


class AllocationValidationError(ValueError):
    """A placement that must not be used; the message names the buffers, the time or the field."""


def validate_placement(
    buffers: Sequence[Buffer], offsets: Sequence[int], *, capacity: int | None = None, alignment: int = 1,
) -> None:
    """Raise `AllocationValidationError` at the first violated rule, else return None."""
    if len(offsets) != len(buffers):
        raise AllocationValidationError(f"offsets: {len(offsets)} given for {len(buffers)} buffers")
    for b, off in zip(buffers, offsets, strict=True):
        if off < 0:
            raise AllocationValidationError(f"buffer {b.id}: offset {off} is negative")
        if alignment > 1 and off % alignment:
            raise AllocationValidationError(f"buffer {b.id}: offset {off} is not a multiple of alignment {alignment}")
        if capacity is not None and off + b.size > capacity:
            raise AllocationValidationError(
                f"buffer {b.id}: ends at {off + b.size} bytes, beyond capacity {capacity}"
            )
    # Sweep: frees (kind 0) before allocations (kind 1) at equal times, since lifetimes are [lower, upper).
    events = sorted(
        [(b.upper, 0, i) for i, b in enumerate(buffers)] + [(b.lower, 1, i) for i, b in enumerate(buffers)]
    )
    live: list[tuple[int, int]] = []  # (offset, buffer index), sorted by offset
    for t, kind, i in events:
        key = (offsets[i], i)
        if kind == 0:
            live.pop(bisect.bisect_left(live, key))
            continue
        pos = bisect.bisect_left(live, key)
        start, end = offsets[i], offsets[i] + buffers[i].size
        for j in (pos - 1, pos):
            if 0 <= j < len(live):
                o_off, o = live[j]
                if o_off < end and start < o_off + buffers[o].size:
                    a, b = buffers[o], buffers[i]
                    raise AllocationValidationError(
                        f"buffers {a.id} and {b.id} overlap at time {t}: addresses "
                        f"[{o_off}, {o_off + a.size}) and [{start}, {end})"
                    )
        live.insert(pos, key)
