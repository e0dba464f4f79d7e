"""The planned allocator's statistics, read from the C++ core (torch.cuda.memory_stats is unavailable under it)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import IntEnum
from typing import Any


class ServedFrom(IntEnum):
    """Where a live block was served (values of `mp_block_kind`)."""

    planned = 0  # the expected iteration slot, at its planned offset
    persistent = 1  # a long-lived slot (parameter, gradient, optimizer state), at its planned offset
    shrunk = 2  # inside the larger slot at the cursor
    pool = 3  # best fit in the arena's free gaps
    device = 4  # plain backend allocation (cudaMalloc / posix_memalign)


@dataclass(frozen=True)
class AllocatorStats:
    """Counters and byte totals of one planned allocator. Bytes are rounded to the plan's alignment
    except `requested_bytes`; reserved = arena + live plain allocations."""

    arena_bytes: int
    reserved_bytes: int
    peak_reserved_bytes: int
    allocated_bytes: int
    peak_allocated_bytes: int
    requested_bytes: int
    peak_requested_bytes: int
    device_bytes: int
    peak_device_bytes: int
    allocs: int
    frees: int
    planned: int
    persistent: int
    shrunk: int
    resyncs: int
    skipped_slots: int
    mismatches: int
    displaced: int
    pool_fallbacks: int
    device_fallbacks: int
    before_cycle_allocs: int
    iterations: int
    live_blocks: int
    unknown_frees: int
    debug_violations: int
    failed_allocs: int
    unguarded_pool_fallbacks: int
    arena_reserve_failures: int

    @property
    def fallbacks(self) -> int:
        """Requests during the replay not served at a planned offset."""
        return self.pool_fallbacks + self.device_fallbacks

    @property
    def fragmentation_ratio(self) -> float:
        """1 - peak allocated / peak reserved (0 when nothing was reserved)."""
        if self.peak_reserved_bytes == 0:
            return 0.0
        return 1.0 - self.peak_allocated_bytes / self.peak_reserved_bytes

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["fallbacks"] = self.fallbacks
        d["fragmentation_ratio"] = self.fragmentation_ratio
        return d
