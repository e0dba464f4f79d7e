"""Buffers to place: the plain (id, lower, upper, size) problem every allocation solver works on.

Units: `lower`/`upper` are logical time (event indices), the buffer is live over [lower, upper);
`size` and `offset` are bytes (or alignment units inside the search, see `planner.py`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


class AllocationInputError(ValueError):
    """A buffer or a problem that cannot be planned; the message names the row or field."""


@dataclass(frozen=True, slots=True)
class Buffer:
    """One buffer: `size` bytes live over the half-open logical-time interval [lower, upper)."""

    id: str
    lower: int
    upper: int
    size: int

    def overlaps_in_time(self, other: Buffer) -> bool:
        return self.lower < other.upper and other.lower < self.upper


def check_buffer(buffer: Buffer, where: str) -> None:
    """Raise `AllocationInputError` naming `where` (e.g. 'row 7 (id b3)') when a field is unusable."""
    for name in ("lower", "upper", "size"):
        value = getattr(buffer, name)
        if isinstance(value, bool) or not isinstance(value, int):
            raise AllocationInputError(f"{where}: {name} must be an integer, got {value!r}")
    if buffer.size <= 0:
        raise AllocationInputError(f"{where}: size must be positive, got {buffer.size}")
    if buffer.lower < 0:
        raise AllocationInputError(f"{where}: lower must not be negative, got {buffer.lower}")
    if buffer.upper <= buffer.lower:
        raise AllocationInputError(
            f"{where}: upper ({buffer.upper}) must be greater than lower ({buffer.lower})"
        )


def check_buffers(buffers: Sequence[Buffer]) -> None:
    """Check every buffer and that ids are unique; errors name the position and id."""
    seen: dict[str, int] = {}
    for i, b in enumerate(buffers):
        check_buffer(b, f"buffer {i} (id {b.id})")
        if b.id in seen:
            raise AllocationInputError(f"buffer {i} (id {b.id}): id already used by buffer {seen[b.id]}")
        seen[b.id] = i


def peak_live_bytes(lowers: Sequence[int], uppers: Sequence[int], sizes: Sequence[int]) -> int:
    """Max over time of the summed size of live buffers: no placement can use less address space."""
    events: list[tuple[int, int]] = []
    for lo, up, sz in zip(lowers, uppers, sizes, strict=True):
        events.append((lo, sz))
        events.append((up, -sz))
    # At equal times frees (negative) sort first: [a, t) and [t, b) are never live together.
    events.sort()
    live = peak = 0
    for _, delta in events:
        live += delta
        if live > peak:
            peak = live
    return peak


def lower_bound(buffers: Sequence[Buffer]) -> int:
    return peak_live_bytes([b.lower for b in buffers], [b.upper for b in buffers], [b.size for b in buffers])


def arena_of(sizes: Sequence[int], offsets: Sequence[int]) -> int:
    """Peak address used by a placement: max(offset + size), 0 when empty."""
    return max((o + s for o, s in zip(offsets, sizes, strict=True)), default=0)
