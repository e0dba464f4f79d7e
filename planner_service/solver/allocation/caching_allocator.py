"""Replay of an allocation trace through PyTorch's CUDA caching allocator: the baseline a plan beats.

The rules, and where they come from (PyTorch `c10/cuda/CUDACachingAllocator.cpp`, with the constants
in `c10/core/CachingDeviceAllocator.h` in recent releases; default configuration, i.e. no
`max_split_size_mb`, no `expandable_segments`, no `roundup_power2_divisions`):

* `round_size`: a request is rounded up to a multiple of kMinBlockSize = 512 B (at least 512 B);
* pools: a rounded size <= kSmallSize = 1 MiB is served from the *small* pool, anything larger from
  the *large* pool;
* `get_allocation_size`: a new segment (one cudaMalloc) is kSmallBuffer = 2 MiB for a small request,
  kLargeBuffer = 20 MiB for a large request below kMinLargeAlloc = 10 MiB, and the request rounded
  up to kRoundLarge = 2 MiB otherwise;
* `get_free_block`: best fit, the smallest cached free block of the pool (same stream; one stream is
  simulated) whose size is at least the request, lowest address on ties (the pool is a set ordered by
  (stream, size, address));
* `should_split`: a block larger than the request is split when the remainder is >= 512 B (small pool)
  or > 1 MiB (large pool); otherwise the whole block is handed out (and counted as allocated);
* `free_block` / `try_merge_blocks`: a freed block merges with free neighbours of the same segment;
  segments are never returned to the device while allocations succeed;
* on a miss, a new segment is allocated; if that would exceed the device capacity the allocator frees
  every cached segment that is entirely free (`release_cached_blocks`; `release_available_cached_blocks`
  does nothing without max_split_size) and retries once, then reports out of memory.

Figures: reserved = bytes of live segments, allocated = bytes of blocks handed out (rounded sizes, as
`torch.cuda.memory_allocated` counts them), fragmentation ratio = 1 - peak allocated / peak reserved.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from client.contract import AllocationTrace

MIN_BLOCK_SIZE = 512  # kMinBlockSize
SMALL_SIZE = 1 << 20  # kSmallSize: largest request served from the small pool
SMALL_BUFFER = 2 << 20  # kSmallBuffer: small-pool segment size
LARGE_BUFFER = 20 << 20  # kLargeBuffer: segment for large requests below MIN_LARGE_ALLOC
MIN_LARGE_ALLOC = 10 << 20  # kMinLargeAlloc
ROUND_LARGE = 2 << 20  # kRoundLarge


class SimulatedOutOfMemory(RuntimeError):
    """The simulated device had no room for a segment even after releasing the cached ones."""


def round_size(size: int) -> int:
    return MIN_BLOCK_SIZE if size < MIN_BLOCK_SIZE else -(-size // MIN_BLOCK_SIZE) * MIN_BLOCK_SIZE


def allocation_size(size: int) -> int:
    """Bytes of the segment cudaMalloc'd for a (rounded) request that found no cached block."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-size // ROUND_LARGE) * ROUND_LARGE


@dataclass(eq=False, slots=True)
class _Block:
    segment: int
    address: int
    size: int
    small: bool
    allocated: bool = False
    prev: _Block | None = None
    next: _Block | None = None

    @property
    def key(self) -> tuple[int, int]:
        return (self.size, self.address)


@dataclass(slots=True)
class CachingAllocatorReport:
    """What PyTorch's caching allocator would have reserved for the replayed trace."""

    peak_reserved_bytes: int
    peak_allocated_bytes: int  # rounded block sizes, as torch.cuda.max_memory_allocated
    peak_requested_bytes: int  # raw request sizes
    fragmentation_ratio: float  # 1 - peak_allocated / peak_reserved
    segments_allocated: int  # cudaMalloc calls
    small_segments_allocated: int
    large_segments_allocated: int
    segments_released: int  # cudaFree calls (free-and-retry on a miss at capacity)
    peak_segments: int  # most segments held at once
    iterations: int
    out_of_memory: bool = False
    notes: list[str] = field(default_factory=list)


class CachingAllocatorSimulator:
    """One device, one stream; `malloc` returns a handle for `free`. Rules as in the module docstring."""

    def __init__(self, capacity_bytes: int | None = None) -> None:
        self.capacity = capacity_bytes
        self._pools: dict[bool, list[tuple[int, int, int]]] = {True: [], False: []}  # small? -> (size, addr, id)
        self._free_by_id: dict[int, _Block] = {}
        self._segments: dict[int, tuple[int, _Block]] = {}  # segment id -> (size, first block)
        self._next_segment_address = 0
        self._next_id = 0
        self.reserved = self.allocated = self.requested = 0
        self.peak_reserved = self.peak_allocated = self.peak_requested = 0
        self.segments_allocated = self.small_segments = self.large_segments = 0
        self.segments_released = 0
        self.peak_segments = 0
        self._handles: dict[int, tuple[_Block, int]] = {}

    # ----------------------------------------------------------------------------- pool bookkeeping
    def _insert_free(self, block: _Block) -> None:
        bid = id(block)
        self._free_by_id[bid] = block
        bisect.insort(self._pools[block.small], (block.size, block.address, bid))

    def _remove_free(self, block: _Block) -> None:
        pool = self._pools[block.small]
        i = bisect.bisect_left(pool, (block.size, block.address, id(block)))
        del pool[i]
        del self._free_by_id[id(block)]

    def _new_segment(self, size: int, small: bool) -> _Block | None:
        if self.capacity is not None and self.reserved + size > self.capacity:
            return None
        seg = self.segments_allocated
        block = _Block(segment=seg, address=self._next_segment_address, size=size, small=small)
        self._next_segment_address += size
        self._segments[seg] = (size, block)
        self.segments_allocated += 1
        if small:
            self.small_segments += 1
        else:
            self.large_segments += 1
        self.reserved += size
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        self.peak_segments = max(self.peak_segments, len(self._segments))
        return block

    def _release_cached_segments(self) -> None:
        """`release_cached_blocks`: give back every segment that is one free, unsplit block."""
        for seg, (size, first) in list(self._segments.items()):
            if not first.allocated and first.prev is None and first.next is None:
                self._remove_free(first)
                del self._segments[seg]
                self.reserved -= size
                self.segments_released += 1

    # ----------------------------------------------------------------------------- malloc / free
    def malloc(self, nbytes: int) -> int:
        if nbytes <= 0:
            raise ValueError(f"nbytes: must be positive, got {nbytes}")
        size = round_size(nbytes)
        small = size <= SMALL_SIZE
        pool = self._pools[small]
        i = bisect.bisect_left(pool, (size, -1, -1))
        if i < len(pool):
            block = self._free_by_id[pool[i][2]]
            self._remove_free(block)
        else:
            seg_size = allocation_size(size)
            new = self._new_segment(seg_size, small)
            if new is None:
                self._release_cached_segments()
                new = self._new_segment(seg_size, small)
            if new is None:
                raise SimulatedOutOfMemory(
                    f"no room for a {seg_size}-byte segment: {self.reserved} of {self.capacity} bytes reserved"
                )
            block = new
        remaining = block.size - size
        if (remaining >= MIN_BLOCK_SIZE) if small else (remaining > SMALL_SIZE):
            rest = _Block(segment=block.segment, address=block.address + size, size=remaining, small=small,
                          prev=block, next=block.next)
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            block.size = size
            self._insert_free(rest)
        block.allocated = True
        self.allocated += block.size
        self.requested += nbytes
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self.peak_requested = max(self.peak_requested, self.requested)
        handle = self._next_id
        self._next_id += 1
        self._handles[handle] = (block, nbytes)
        return handle

    def free(self, handle: int) -> None:
        block, nbytes = self._handles.pop(handle)
        block.allocated = False
        self.allocated -= block.size
        self.requested -= nbytes
        for neighbour in (block.prev, block.next):
            if neighbour is not None and not neighbour.allocated:
                self._remove_free(neighbour)
                if neighbour is block.prev:
                    block.address = neighbour.address
                    block.prev = neighbour.prev
                    if neighbour.prev is not None:
                        neighbour.prev.next = block
                    else:
                        size, _ = self._segments[block.segment]
                        self._segments[block.segment] = (size, block)
                else:
                    block.next = neighbour.next
                    if neighbour.next is not None:
                        neighbour.next.prev = block
                block.size += neighbour.size
        self._insert_free(block)

    @property
    def segment_count(self) -> int:
        return len(self._segments)

    def report(self, iterations: int, out_of_memory: bool = False) -> CachingAllocatorReport:
        frag = 0.0 if self.peak_reserved == 0 else 1.0 - self.peak_allocated / self.peak_reserved
        return CachingAllocatorReport(
            peak_reserved_bytes=self.peak_reserved, peak_allocated_bytes=self.peak_allocated,
            peak_requested_bytes=self.peak_requested, fragmentation_ratio=frag,
            segments_allocated=self.segments_allocated, small_segments_allocated=self.small_segments,
            large_segments_allocated=self.large_segments, segments_released=self.segments_released,
            peak_segments=self.peak_segments, iterations=iterations, out_of_memory=out_of_memory,
        )


def simulate_caching_allocator(
    trace: AllocationTrace, *, iterations: int = 2, capacity_bytes: int | None = None,
) -> CachingAllocatorReport:
    """Replay `iterations` back-to-back iterations of `trace` (long-lived buffers allocated once).

    Within a time step frees come before allocations ([alloc, free) lifetimes), then event id order.
    """
    if iterations < 1:
        raise ValueError(f"iterations: must be at least 1, got {iterations}")
    sim = CachingAllocatorSimulator(capacity_bytes)
    h = trace.horizon
    steps: list[tuple[int, int, int, int]] = []  # (time, 0 free / 1 alloc, event id, size)
    for k in range(iterations):
        for e in trace.events:
            if e.free_index is None:
                if k == 0:
                    steps.append((e.alloc_index, 1, e.id, e.size_bytes))
                continue
            steps.append((k * h + e.alloc_index, 1, e.id, e.size_bytes))
            steps.append((k * h + e.free_index, 0, e.id, e.size_bytes))
    steps.sort()
    handles: dict[int, int] = {}
    try:
        for _, kind, eid, size in steps:
            if kind == 1:
                handles[eid] = sim.malloc(size)
            else:
                sim.free(handles.pop(eid))
    except SimulatedOutOfMemory as exc:
        report = sim.report(iterations, out_of_memory=True)
        report.notes.append(str(exc))
        return report
    return sim.report(iterations)
