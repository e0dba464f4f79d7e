"""One C++ planned-allocator core seen from Python: creation from slots, statistics, checks, replay."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

from agent.allocator.library import STAT_FIELDS, Library, StatsStruct
from agent.allocator.slots import ReplayOps, Slots
from agent.allocator.stats import AllocatorStats, ServedFrom

RULE_LOOKAHEAD = 1
RULE_SHRINK = 2
RULE_POOL = 4
RULE_GUARD = 8


class AllocatorInvariantError(AssertionError):
    """The debug check found the allocator's state inconsistent (overlapping live ranges, wrong counters)."""


class ReplayError(RuntimeError):
    """A trace replay failed (backend out of memory, or an operation on a buffer that is not live)."""


@dataclass(frozen=True)
class MatchRules:
    """Which matching and fallback rules are on (all by default); switch one off to measure what it buys.

    lookahead: a request may match one of the next `lookahead_slots` expected slots (resynchronise);
    shrink: a smaller request is served inside the larger slot at the cursor;
    pool: unmatched requests go to a best-fit pool in the arena's free gaps before a plain allocation;
    guard: the pool avoids the ranges of the next `guard_window` planned slots, except after
        `relax_after` consecutive requests that missed the plan (0: never relax): a program not
        following the plan (another batch size) would otherwise be pushed out of the arena.
    """

    lookahead: bool = True
    shrink: bool = True
    pool: bool = True
    guard: bool = True
    lookahead_slots: int = 16
    guard_window: int = 64
    relax_after: int = 8

    @property
    def bits(self) -> int:
        return (
            (RULE_LOOKAHEAD if self.lookahead else 0)
            | (RULE_SHRINK if self.shrink else 0)
            | (RULE_POOL if self.pool else 0)
            | (RULE_GUARD if self.guard else 0)
        )


def _u64_array(values: Sequence[int]) -> ctypes.Array[ctypes.c_uint64]:
    return (ctypes.c_uint64 * len(values))(*values)


class PlannedCore:
    """Owns one `mp_core`. Not thread-safe to destroy while others use it; everything else is (C++ mutex)."""

    def __init__(self, lib: Library, slots: Slots, *, device: int, debug: bool, rules: MatchRules) -> None:
        if rules.lookahead_slots < 0 or rules.guard_window < 0 or rules.relax_after < 0:
            raise ValueError("rules: lookahead_slots, guard_window and relax_after must be >= 0")
        self.lib = lib
        self.slots = slots
        n = len(slots.sizes)
        handle = lib.mp_create(  # type: ignore[attr-defined]
            slots.arena_bytes,
            slots.alignment_bytes,
            _u64_array(slots.sizes),
            _u64_array(slots.offsets),
            (ctypes.c_uint8 * n)(*[1 if p else 0 for p in slots.persistent]),
            n,
            device,
            rules.bits,
            rules.lookahead_slots,
            rules.guard_window,
            rules.relax_after,
            1 if debug else 0,
        )
        if not handle:
            raise ValueError(f"planned allocator: {lib.last_error()}")
        self.handle: int | None = handle
        self.debug = debug

    def _h(self) -> int:
        if self.handle is None:
            raise RuntimeError("planned allocator: already closed")
        return self.handle

    def alloc(self, size: int) -> int:
        return self.lib.mp_alloc(self._h(), size) or 0  # type: ignore[attr-defined]

    def free(self, address: int) -> bool:
        return self.lib.mp_free(self._h(), address) == 0  # type: ignore[attr-defined]

    def begin_iteration(self) -> None:
        self.lib.mp_begin_iteration(self._h())  # type: ignore[attr-defined]

    def cursor(self) -> int:
        return int(self.lib.mp_cursor(self._h()))  # type: ignore[attr-defined]

    def arena_base(self) -> int:
        return self.lib.mp_arena_base(self._h()) or 0  # type: ignore[attr-defined]

    def reserve_arena(self) -> None:
        if self.lib.mp_reserve_arena(self._h()) != 0:  # type: ignore[attr-defined]
            raise MemoryError(
                f"planned allocator: could not reserve the arena of {self.slots.arena_bytes} bytes"
            )

    def served_from(self, address: int) -> ServedFrom | None:
        k = self.lib.mp_block_kind(self._h(), address)  # type: ignore[attr-defined]
        return None if k < 0 else ServedFrom(k)

    def stats(self) -> AllocatorStats:
        s = StatsStruct()
        self.lib.mp_get_stats(self._h(), ctypes.byref(s))  # type: ignore[attr-defined]
        return AllocatorStats(**{name: int(getattr(s, name)) for name in STAT_FIELDS})

    def reset_peaks(self) -> None:
        self.lib.mp_reset_peaks(self._h())  # type: ignore[attr-defined]

    def check(self) -> None:
        """Raise AllocatorInvariantError unless every live range is disjoint and every counter is right."""
        buf = ctypes.create_string_buffer(512)
        if self.lib.mp_check(self._h(), buf, len(buf)) != 0:  # type: ignore[attr-defined]
            raise AllocatorInvariantError(f"planned allocator: {buf.value.decode(errors='replace')}")

    def replay(self, ops: ReplayOps, iterations: int, *, free_at_end: bool = True) -> None:
        """Run `iterations` passes of `ops` inside the C++ core (begin_iteration before each)."""
        if iterations < 1:
            raise ValueError(f"iterations: must be at least 1, got {iterations}")
        c_ops = (ctypes.c_int64 * len(ops.ops))(*ops.ops)
        rc = self.lib.mp_replay(  # type: ignore[attr-defined]
            self._h(),
            c_ops,
            len(ops.ops),
            _u64_array(ops.sizes),
            len(ops.sizes),
            iterations,
            1 if free_at_end else 0,
        )
        if rc != 0:
            raise ReplayError(f"planned allocator replay: {self.lib.last_error()}")

    def destroy(self) -> None:
        if self.handle is not None:
            self.lib.mp_destroy(self.handle)  # type: ignore[attr-defined]
            self.handle = None
