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

Implementation: the allocator state is flat numpy arrays (blocks as a doubly linked list per segment,
both pools in one treap keyed by (pool flag + size, address), see `treap.py`) and `malloc`/`free` are
numba-compiled, so a trace replay of 10^6 events runs in compiled code end to end (about a second);
`CachingAllocatorSimulator` wraps the same compiled functions for scripted, call-by-call use.

Figures: reserved = bytes of live segments, allocated = bytes of blocks handed out (rounded sizes, as
`torch.cuda.memory_allocated` counts them), fragmentation ratio = 1 - peak allocated / peak reserved.

Why one module over 400 lines: it replays one C++ allocator's rules (pools, rounding, splitting, freeing,
retries) over one shared allocator state.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from numba import njit

from client.contract import AllocationTrace
from planner_service.solver.allocation.intervals import trace_arrays
from planner_service.solver.allocation.treap import NIL, new_treap, treap_ceiling, treap_insert, treap_remove

MIN_BLOCK_SIZE = 512  # kMinBlockSize
SMALL_SIZE = 1 << 20  # kSmallSize: largest request served from the small pool
SMALL_BUFFER = 2 << 20  # kSmallBuffer: small-pool segment size
LARGE_BUFFER = 20 << 20  # kLargeBuffer: segment for large requests below MIN_LARGE_ALLOC
MIN_LARGE_ALLOC = 10 << 20  # kMinLargeAlloc
ROUND_LARGE = 2 << 20  # kRoundLarge
_LARGE_POOL = 1 << 52  # added to a large-pool block's size in the treap key: the pools never mix

# Indices into the counter array `ctr`.
(
    _BLOCKS,
    _SEGMENTS,
    _HANDLES,
    _RESERVED,
    _ALLOCATED,
    _REQUESTED,
    _PEAK_RESERVED,
    _PEAK_ALLOCATED,
    _PEAK_REQUESTED,
    _SMALL_SEGS,
    _LARGE_SEGS,
    _RELEASED,
    _LIVE_SEGS,
    _PEAK_SEGS,
    _NEXT_ADDRESS,
    _CAPACITY,
    _FAILED_SEGMENT,
) = range(17)


class SimulatedOutOfMemory(RuntimeError):
    """The simulated device had no room for a segment even after releasing the cached ones."""


@njit(cache=True, nogil=True)
def round_size(size: int) -> int:
    return MIN_BLOCK_SIZE if size < MIN_BLOCK_SIZE else -(-size // MIN_BLOCK_SIZE) * MIN_BLOCK_SIZE


@njit(cache=True, nogil=True)
def allocation_size(size: int) -> int:
    """Bytes of the segment cudaMalloc'd for a (rounded) request that found no cached block."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-size // ROUND_LARGE) * ROUND_LARGE


class _State:
    """The allocator's arrays: blocks, segments, handles, the pool treap and the counters."""

    def __init__(self, capacity_bytes: int | None, max_blocks: int) -> None:
        n = max(max_blocks, 4)
        self.b_seg = np.zeros(n, np.int64)
        self.b_addr = np.zeros(n, np.int64)
        self.b_size = np.zeros(n, np.int64)
        self.b_small = np.zeros(n, np.bool_)
        self.b_alloc = np.zeros(n, np.bool_)
        self.b_prev = np.full(n, NIL, np.int64)
        self.b_next = np.full(n, NIL, np.int64)
        self.s_size = np.zeros(n, np.int64)
        self.s_first = np.full(n, NIL, np.int64)
        self.s_alive = np.zeros(n, np.bool_)
        self.h_block = np.full(n, NIL, np.int64)
        self.h_nbytes = np.zeros(n, np.int64)
        self.treap = new_treap(n)
        self.ctr = np.zeros(17, np.int64)
        self.ctr[_CAPACITY] = -1 if capacity_bytes is None else capacity_bytes

    def arrays(self) -> tuple[np.ndarray, ...]:
        return (
            self.b_seg,
            self.b_addr,
            self.b_size,
            self.b_small,
            self.b_alloc,
            self.b_prev,
            self.b_next,
            self.s_size,
            self.s_first,
            self.s_alive,
            self.h_block,
            self.h_nbytes,
            *self.treap,
            self.ctr,
        )

    def grow(self) -> None:
        """Double every array (scripted use, where the number of calls is not known up front)."""
        n = self.b_seg.shape[0]
        for name in (
            "b_seg",
            "b_addr",
            "b_size",
            "b_small",
            "b_alloc",
            "b_prev",
            "b_next",
            "s_size",
            "s_first",
            "s_alive",
            "h_block",
            "h_nbytes",
        ):
            old = getattr(self, name)
            new = np.full(2 * n, NIL if name in ("b_prev", "b_next", "s_first", "h_block") else 0, old.dtype)
            new[:n] = old
            setattr(self, name, new)
        k1, k2, pri, left, right, parent, root = self.treap
        fresh = new_treap(2 * n, seed=1)
        for old, new in zip((k1, k2, pri, left, right, parent), fresh[:6], strict=True):
            new[:n] = old
        self.treap = (*fresh[:6], root)


@njit(cache=True, nogil=True)
def _new_segment(  # type: ignore[no-untyped-def]
    b_seg,
    b_addr,
    b_size,
    b_small,
    b_alloc,
    b_prev,
    b_next,
    s_size,
    s_first,
    s_alive,
    ctr,
    size,
    small,
):
    if ctr[_CAPACITY] >= 0 and ctr[_RESERVED] + size > ctr[_CAPACITY]:
        return NIL
    seg = ctr[_SEGMENTS]
    ctr[_SEGMENTS] += 1
    b = ctr[_BLOCKS]
    ctr[_BLOCKS] += 1
    b_seg[b] = seg
    b_addr[b] = ctr[_NEXT_ADDRESS]
    b_size[b] = size
    b_small[b] = small
    b_alloc[b] = False
    b_prev[b] = NIL
    b_next[b] = NIL
    ctr[_NEXT_ADDRESS] += size
    s_size[seg] = size
    s_first[seg] = b
    s_alive[seg] = True
    if small:
        ctr[_SMALL_SEGS] += 1
    else:
        ctr[_LARGE_SEGS] += 1
    ctr[_RESERVED] += size
    ctr[_PEAK_RESERVED] = max(ctr[_PEAK_RESERVED], ctr[_RESERVED])
    ctr[_LIVE_SEGS] += 1
    ctr[_PEAK_SEGS] = max(ctr[_PEAK_SEGS], ctr[_LIVE_SEGS])
    return b


@njit(cache=True, nogil=True)
def _malloc(  # type: ignore[no-untyped-def]
    b_seg,
    b_addr,
    b_size,
    b_small,
    b_alloc,
    b_prev,
    b_next,
    s_size,
    s_first,
    s_alive,
    h_block,
    h_nbytes,
    k1,
    k2,
    pri,
    left,
    right,
    parent,
    root,
    ctr,
    nbytes,
):
    """Serve one request; the handle, or -1 when out of memory (segment size in ctr[_FAILED_SEGMENT])."""
    size = round_size(nbytes)
    small = size <= SMALL_SIZE
    flag = 0 if small else _LARGE_POOL
    # get_free_block: best fit in the request's pool, lowest address on ties.
    b = treap_ceiling(k1, k2, left, right, root, flag + size, -1)
    if b != NIL and (small and k1[b] >= _LARGE_POOL):
        b = NIL
    if b != NIL:
        treap_remove(k1, k2, pri, left, right, parent, root, b)
    else:
        seg_size = allocation_size(size)
        b = _new_segment(
            b_seg,
            b_addr,
            b_size,
            b_small,
            b_alloc,
            b_prev,
            b_next,
            s_size,
            s_first,
            s_alive,
            ctr,
            seg_size,
            small,
        )
        if b == NIL:
            # release_cached_blocks: every segment that is one free, unsplit block, then retry once.
            for seg in range(ctr[_SEGMENTS]):
                first = s_first[seg]
                if s_alive[seg] and not b_alloc[first] and b_prev[first] == NIL and b_next[first] == NIL:
                    treap_remove(k1, k2, pri, left, right, parent, root, first)
                    s_alive[seg] = False
                    ctr[_RESERVED] -= s_size[seg]
                    ctr[_RELEASED] += 1
                    ctr[_LIVE_SEGS] -= 1
            b = _new_segment(
                b_seg,
                b_addr,
                b_size,
                b_small,
                b_alloc,
                b_prev,
                b_next,
                s_size,
                s_first,
                s_alive,
                ctr,
                seg_size,
                small,
            )
        if b == NIL:
            ctr[_FAILED_SEGMENT] = seg_size
            return -1
    # should_split: remainder >= 512 B (small pool) or > 1 MiB (large pool).
    remaining = b_size[b] - size
    if (remaining >= MIN_BLOCK_SIZE) if small else (remaining > SMALL_SIZE):
        r = ctr[_BLOCKS]
        ctr[_BLOCKS] += 1
        b_seg[r] = b_seg[b]
        b_addr[r] = b_addr[b] + size
        b_size[r] = remaining
        b_small[r] = small
        b_alloc[r] = False
        b_prev[r] = b
        b_next[r] = b_next[b]
        if b_next[b] != NIL:
            b_prev[b_next[b]] = r
        b_next[b] = r
        b_size[b] = size
        treap_insert(k1, k2, pri, left, right, parent, root, r, flag + remaining, b_addr[r])
    b_alloc[b] = True
    ctr[_ALLOCATED] += b_size[b]
    ctr[_REQUESTED] += nbytes
    ctr[_PEAK_ALLOCATED] = max(ctr[_PEAK_ALLOCATED], ctr[_ALLOCATED])
    ctr[_PEAK_REQUESTED] = max(ctr[_PEAK_REQUESTED], ctr[_REQUESTED])
    handle = ctr[_HANDLES]
    ctr[_HANDLES] += 1
    h_block[handle] = b
    h_nbytes[handle] = nbytes
    return handle


@njit(cache=True, nogil=True)
def _free(  # type: ignore[no-untyped-def]
    b_seg,
    b_addr,
    b_size,
    b_small,
    b_alloc,
    b_prev,
    b_next,
    s_size,
    s_first,
    s_alive,
    h_block,
    h_nbytes,
    k1,
    k2,
    pri,
    left,
    right,
    parent,
    root,
    ctr,
    handle,
):
    """free_block + try_merge_blocks: merge with free neighbours of the same segment, back to the pool."""
    b = h_block[handle]
    h_block[handle] = NIL
    b_alloc[b] = False
    ctr[_ALLOCATED] -= b_size[b]
    ctr[_REQUESTED] -= h_nbytes[handle]
    before = b_prev[b]
    after = b_next[b]
    if before != NIL and not b_alloc[before]:
        treap_remove(k1, k2, pri, left, right, parent, root, before)
        b_addr[b] = b_addr[before]
        b_prev[b] = b_prev[before]
        if b_prev[before] != NIL:
            b_next[b_prev[before]] = b
        else:
            s_first[b_seg[b]] = b
        b_size[b] += b_size[before]
    if after != NIL and not b_alloc[after]:
        treap_remove(k1, k2, pri, left, right, parent, root, after)
        b_next[b] = b_next[after]
        if b_next[after] != NIL:
            b_prev[b_next[after]] = b
        b_size[b] += b_size[after]
    flag = 0 if b_small[b] else _LARGE_POOL
    treap_insert(k1, k2, pri, left, right, parent, root, b, flag + b_size[b], b_addr[b])


@njit(cache=True, nogil=True)
def _replay(  # type: ignore[no-untyped-def]
    codes,
    nbytes,
    handle_of,
    b_seg,
    b_addr,
    b_size,
    b_small,
    b_alloc,
    b_prev,
    b_next,
    s_size,
    s_first,
    s_alive,
    h_block,
    h_nbytes,
    k1,
    k2,
    pri,
    left,
    right,
    parent,
    root,
    ctr,
):
    """Replay codes (i >= 0: allocate event i; -1 - i: free it); False when out of memory."""
    for c in codes:
        if c >= 0:
            h = _malloc(
                b_seg,
                b_addr,
                b_size,
                b_small,
                b_alloc,
                b_prev,
                b_next,
                s_size,
                s_first,
                s_alive,
                h_block,
                h_nbytes,
                k1,
                k2,
                pri,
                left,
                right,
                parent,
                root,
                ctr,
                nbytes[c],
            )
            if h < 0:
                return False
            handle_of[c] = h
        else:
            _free(
                b_seg,
                b_addr,
                b_size,
                b_small,
                b_alloc,
                b_prev,
                b_next,
                s_size,
                s_first,
                s_alive,
                h_block,
                h_nbytes,
                k1,
                k2,
                pri,
                left,
                right,
                parent,
                root,
                ctr,
                handle_of[-1 - c],
            )
    return True


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

    def __init__(self, capacity_bytes: int | None = None, *, max_blocks: int = 1024) -> None:
        self.capacity = capacity_bytes
        self._state = _State(capacity_bytes, max_blocks)

    def malloc(self, nbytes: int) -> int:
        if nbytes <= 0:
            raise ValueError(f"nbytes: must be positive, got {nbytes}")
        st = self._state
        # A call adds at most two blocks, one segment and one handle.
        if max(st.ctr[_BLOCKS] + 2, st.ctr[_HANDLES] + 1, st.ctr[_SEGMENTS] + 1) > st.b_seg.shape[0]:
            st.grow()
        handle = int(_malloc(*st.arrays(), nbytes))  # type: ignore[call-arg]
        if handle < 0:
            raise SimulatedOutOfMemory(self._oom_message())
        return handle

    def free(self, handle: int) -> None:
        st = self._state
        if not 0 <= handle < st.ctr[_HANDLES] or st.h_block[handle] == NIL:
            raise KeyError(f"handle {handle} is not allocated")
        _free(*st.arrays(), handle)  # type: ignore[call-arg]

    def address(self, handle: int) -> int:
        """Simulated device address of a live allocation (segments laid out one after another)."""
        st = self._state
        if not 0 <= handle < st.ctr[_HANDLES] or st.h_block[handle] == NIL:
            raise KeyError(f"handle {handle} is not allocated")
        return int(st.b_addr[st.h_block[handle]])

    def _oom_message(self) -> str:
        c = self._state.ctr
        return (
            f"no room for a {int(c[_FAILED_SEGMENT])}-byte segment: {int(c[_RESERVED])} of {self.capacity} "
            "bytes reserved"
        )

    @property
    def segment_count(self) -> int:
        return int(self._state.ctr[_LIVE_SEGS])

    def _counter(self, i: int) -> int:
        return int(self._state.ctr[i])

    reserved = property(lambda self: self._counter(_RESERVED), doc="bytes of live segments")
    allocated = property(lambda self: self._counter(_ALLOCATED), doc="bytes of blocks handed out")
    requested = property(lambda self: self._counter(_REQUESTED), doc="bytes requested by live allocations")
    peak_reserved = property(lambda self: self._counter(_PEAK_RESERVED))
    peak_allocated = property(lambda self: self._counter(_PEAK_ALLOCATED))
    peak_requested = property(lambda self: self._counter(_PEAK_REQUESTED))
    segments_allocated = property(lambda self: self._counter(_SEGMENTS), doc="cudaMalloc calls")
    small_segments = property(lambda self: self._counter(_SMALL_SEGS))
    large_segments = property(lambda self: self._counter(_LARGE_SEGS))
    segments_released = property(lambda self: self._counter(_RELEASED), doc="cudaFree calls")
    peak_segments = property(lambda self: self._counter(_PEAK_SEGS))

    def report(self, iterations: int, out_of_memory: bool = False) -> CachingAllocatorReport:
        c = [int(v) for v in self._state.ctr]
        frag = 0.0 if c[_PEAK_RESERVED] == 0 else 1.0 - c[_PEAK_ALLOCATED] / c[_PEAK_RESERVED]
        return CachingAllocatorReport(
            peak_reserved_bytes=c[_PEAK_RESERVED],
            peak_allocated_bytes=c[_PEAK_ALLOCATED],
            peak_requested_bytes=c[_PEAK_REQUESTED],
            fragmentation_ratio=frag,
            segments_allocated=c[_SEGMENTS],
            small_segments_allocated=c[_SMALL_SEGS],
            large_segments_allocated=c[_LARGE_SEGS],
            segments_released=c[_RELEASED],
            peak_segments=c[_PEAK_SEGS],
            iterations=iterations,
            out_of_memory=out_of_memory,
        )


def replay_codes(trace: AllocationTrace, iterations: int) -> np.ndarray:
    """The replay order: `iterations` back-to-back iterations (long-lived buffers allocated once), by time,
    frees before allocations at equal times, then event id. Codes: event i allocated, -1 - i freed."""
    arr = trace_arrays(trace)
    h = trace.horizon
    n = arr.ids.shape[0]
    idx = np.arange(n, dtype=np.int64)
    rest = idx[~arr.long_lived]
    times = [
        arr.alloc,
        *[k * h + arr.alloc[rest] for k in range(1, iterations)],
        *[k * h + arr.free[rest] for k in range(iterations)],
    ]
    codes = [idx, *[rest] * (iterations - 1), *[-1 - rest] * iterations]
    kinds = [
        np.ones(n, np.int64),
        *[np.ones(rest.size, np.int64)] * (iterations - 1),
        *[np.zeros(rest.size, np.int64)] * iterations,
    ]
    all_codes = np.concatenate(codes)
    event = np.where(all_codes >= 0, all_codes, -1 - all_codes)
    order = np.lexsort((arr.ids[event], np.concatenate(kinds), np.concatenate(times)))
    return all_codes[order]


def simulate_caching_allocator(
    trace: AllocationTrace,
    *,
    iterations: int = 2,
    capacity_bytes: int | None = None,
) -> CachingAllocatorReport:
    """Replay `iterations` back-to-back iterations of `trace` (long-lived buffers allocated once).

    Within a time step frees come before allocations ([alloc, free) lifetimes), then event id order.
    """
    if iterations < 1:
        raise ValueError(f"iterations: must be at least 1, got {iterations}")
    codes = replay_codes(trace, iterations)
    mallocs = int((codes >= 0).sum())
    sim = CachingAllocatorSimulator(capacity_bytes, max_blocks=2 * mallocs + 2)
    sizes = trace.arrays.array("size_bytes").astype(np.int64)
    handle_of = np.full(sizes.shape[0], NIL, dtype=np.int64)
    ok = _replay(codes, sizes, handle_of, *sim._state.arrays())
    if not ok:
        report = sim.report(iterations, out_of_memory=True)
        report.notes.append(sim._oom_message())
        return report
    return sim.report(iterations)
