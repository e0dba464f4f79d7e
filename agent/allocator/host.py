"""`PlannedAllocator`: the planned allocator over host memory, for tests, trace replay and benchmarks.

The same C++ core as the CUDA allocator, with posix_memalign as the backend: everything but the
device calls (plan replay, matching, fallbacks, statistics, the debug check) runs on any CPU.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from types import TracebackType
from typing import TYPE_CHECKING

from agent.allocator.core import MatchRules, PlannedCore
from agent.allocator.library import load_library
from agent.allocator.slots import ReplayOps, iteration_ops, plan_slots
from agent.allocator.stats import AllocatorStats, ServedFrom
from client.contract import AllocationEvent, AllocationPlan

if TYPE_CHECKING:
    import torch


class PlannedAllocator:
    """Serve `events`' allocations at `plan`'s offsets in one host arena, with fallbacks.

    with PlannedAllocator(plan.allocation, trace.allocation_trace.events, debug=True) as pa:
        pa.begin_iteration()
        a = pa.malloc(4096)
        ...
        pa.free(a)
        print(pa.stats())
    """

    def __init__(
        self,
        plan: AllocationPlan,
        events: Sequence[AllocationEvent],
        *,
        debug: bool = False,
        rules: MatchRules | None = None,
    ) -> None:
        self._core = PlannedCore(
            load_library("host"), plan_slots(plan, events), device=0, debug=debug, rules=rules or MatchRules()
        )
        self.events = list(events)

    # ---------------------------------------------------------------- allocation
    def malloc(self, size: int) -> int:
        """Address of `size` fresh bytes (0 for size 0); raises MemoryError when the host has none."""
        if size < 0:
            raise ValueError(f"size: must be >= 0, got {size}")
        address = self._core.alloc(size)
        if size > 0 and address == 0:
            raise MemoryError(f"planned allocator: no memory for {size} bytes")
        return address

    def free(self, address: int) -> None:
        """Give back a block; freeing an address this allocator did not hand out raises ValueError."""
        if not self._core.free(address):
            raise ValueError(f"address: {address:#x} is not a live block of this allocator")

    def begin_iteration(self) -> None:
        """A training iteration starts: replay the plan from its first slot."""
        self._core.begin_iteration()

    def tensor(self, address: int, nbytes: int) -> torch.Tensor:
        """A uint8 tensor viewing `nbytes` at `address` (a live block); it must not outlive the block."""
        # local import: importing `agent.allocator` loads no torch (its docstring)
        import torch

        return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(address), dtype=torch.uint8)

    # ---------------------------------------------------------------- introspection
    @property
    def arena_base(self) -> int:
        """Address of the arena (0 until the first allocation reserves it)."""
        return self._core.arena_base()

    def offset_of(self, address: int) -> int | None:
        """Arena offset of `address`, or None when it is not inside the arena."""
        base = self._core.arena_base()
        if base == 0 or not base <= address < base + self._core.slots.arena_bytes:
            return None
        return address - base

    def served_from(self, address: int) -> ServedFrom | None:
        return self._core.served_from(address)

    def cursor(self) -> int:
        return self._core.cursor()

    def stats(self) -> AllocatorStats:
        return self._core.stats()

    def reset_peaks(self) -> None:
        self._core.reset_peaks()

    def check(self) -> None:
        """Debug check: raises AllocatorInvariantError if two live blocks share a byte or a counter is off."""
        self._core.check()

    def replay(self, iterations: int = 1, ops: ReplayOps | None = None, *, free_at_end: bool = True) -> None:
        """Replay `iterations` iterations of the trace (or of `ops`) inside the C++ core."""
        self._core.replay(ops or iteration_ops(self.events), iterations, free_at_end=free_at_end)

    # ---------------------------------------------------------------- lifetime
    def close(self) -> None:
        """Release the arena and every plain allocation; views made by `tensor` become invalid."""
        self._core.destroy()

    def __enter__(self) -> PlannedAllocator:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __del__(self) -> None:
        core = getattr(self, "_core", None)
        if core is not None:
            core.destroy()
