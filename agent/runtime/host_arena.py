"""Host arena: every pinned host buffer of the runtime sliced from one host allocation the plan sized exactly.

Why (issue 19, defect 8): `torch.empty(..., pin_memory=True)` goes through PyTorch's caching host
allocator, which rounds every request up to a power of two (and keeps the blocks cached). A chunk of
300 MiB takes a 512 MiB pinned block; over a model's chunks and swap buffers the page-locked memory could
reach twice what the plan counted, on a host where page-locked memory is the scarce kind.

What: one host allocation of `chunk_bytes + swap_bytes`, page-locked on CUDA with `cudaHostRegister`
(`torch.cuda.cudart()`, the route PyTorch's own checkpoint stager uses) and unregistered on `close()`
(when the runtime is detached) or when the arena is collected. On CPU it is plain memory (no copy engine
needs it locked); the same slicing runs, so CI exercises the code path.

* chunk region (`take`): the offloaded chunks' pinned buffers (upload source, gradient staging, and the
  host gradient without a separate fp32 master), handed out in request order by a bump pointer. They live
  as long as the runtime, and the region is sized by `client.contract.offloaded_chunk_pinned_bytes` from
  the same layout (sharded chunks: `sharded_chunk_pinned_bytes`, less the compute copies a node shares,
  which live in its segment: `node_shared.py`, `chunk_region_bytes`), so every planned request fits; a
  request beyond the region (a layout the plan did not describe) is answered with `None`, the caller
  allocates it the old way and it is counted in `stats`.
  Each buffer is a tensor with a storage of its own aliasing arena bytes (the runtime and its accounting
  recognise buffers by `untyped_storage().data_ptr()`, as for the device arena in `arena.py`).
* swap region (`swap_take` / `swap_free`): the activation swap store's host copies, which come and go every
  iteration. A first-fit, address-ordered free list with coalescing (`FirstFit`), hand-written because
  PyTorch offers no sub-allocator over memory the caller owns (its caching host allocator makes its own
  power-of-two blocks, the very problem), and the need is small: one region, a few hundred live buffers, freed
  about in reverse order of allocation, so the region behaves like a stack and an iteration's peak equals its
  live bytes. Buffers are slices of one region tensor, so a stream-order checker sees reuse of the same bytes.
  A request that does not fit is answered with `None`: the swap store falls back to PyTorch's pinned
  allocation for it and counts it (`SwapCounters.arena_fallbacks`, `HostArenaStats.swap_fallbacks`).

Sizing (see `plan_host_arena_bytes`): the chunk region from the layout; the swap region is what the plan
counts as swapped activations, `Predictions.pinned_host_bytes` minus the chunk region (the planner counts the
chunk part with the same function). A plan without that figure (hand-built, or from an older planner) gets
an empty swap region: its swap buffers all take the counted fallback.

Non-owning views: tensors served by the arena do not keep it alive; the runtime holds its `DeviceContext`
(which holds the arena) for its whole life, and `detach` re-points the parameters at copies before `close`.
"""

from __future__ import annotations

import bisect
import logging
import weakref
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import _disable_current_modes

from agent.runtime.layout import ChunkLayout
from client.contract import (
    PARAMETER_ALIGN_BYTES,
    ActivationMode,
    Plan,
    offloaded_chunk_pinned_bytes,
    sharded_chunk_pinned_bytes,
)

log = logging.getLogger(__name__)

HOST_ALIGN_BYTES = PARAMETER_ALIGN_BYTES  # every buffer starts 16-byte aligned (vector loads, DMA)
_CUDA_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context, as PyTorch does


class HostArenaError(RuntimeError):
    """The arena could not be made (page-locking refused) or was used against its contract."""


def _round_up(n: int, align: int = HOST_ALIGN_BYTES) -> int:
    return -(-n // align) * align


@dataclass
class HostArenaStats:
    """What the arena holds and served, and what went around it (counted, never silent)."""

    arena_bytes: int = 0
    chunk_region_bytes: int = 0
    swap_region_bytes: int = 0
    registered: bool = False  # page-locked with cudaHostRegister (CUDA only)
    chunk_served: int = 0
    chunk_served_bytes: int = 0
    chunk_fallbacks: int = 0  # chunk buffers allocated outside the arena (region exhausted)
    chunk_fallback_bytes: int = 0
    swap_served: int = 0
    swap_fallbacks: int = 0  # swap buffers allocated outside the arena (region full or fragmented)
    swap_fallback_bytes: int = 0
    swap_peak_bytes: int = 0  # highest swap-region extent in use (live bytes plus holes below the top)


class FirstFit:
    """First-fit allocation of `align`-rounded byte ranges in [0, size), free ranges kept sorted and coalesced."""

    def __init__(self, size: int, align: int = HOST_ALIGN_BYTES) -> None:
        if size < 0 or align <= 0:
            raise ValueError(f"FirstFit: size {size} must be >= 0 and align {align} > 0")
        self.size = size
        self.align = align
        self._starts: list[int] = [0] if size else []  # free ranges, by start
        self._ends: list[int] = [size] if size else []
        self.live: dict[int, int] = {}  # offset -> rounded length
        self.live_bytes = 0
        self.peak_extent = 0  # highest end of a live range ever

    def alloc(self, nbytes: int) -> int | None:
        """The offset of a free range of `nbytes` (rounded up to `align`), or None when none is large enough."""
        need = max(self.align, _round_up(nbytes, self.align))
        for i, (s, e) in enumerate(zip(self._starts, self._ends, strict=True)):
            if e - s >= need:
                if e - s == need:
                    del self._starts[i], self._ends[i]
                else:
                    self._starts[i] = s + need
                self.live[s] = need
                self.live_bytes += need
                self.peak_extent = max(self.peak_extent, s + need)
                return s
        return None

    def free(self, offset: int) -> None:
        """Return the range at `offset` (from `alloc`); neighbouring free ranges merge with it."""
        length = self.live.pop(offset, None)
        if length is None:
            raise HostArenaError(f"FirstFit.free: offset {offset} is not a live allocation")
        self.live_bytes -= length
        start, end = offset, offset + length
        i = bisect.bisect_left(self._starts, start)
        if i > 0 and self._ends[i - 1] == start:  # merge with the range before
            i -= 1
            start = self._starts[i]
            del self._starts[i], self._ends[i]
        if i < len(self._starts) and self._starts[i] == end:  # merge with the range after
            end = self._ends[i]
            del self._starts[i], self._ends[i]
        self._starts.insert(i, start)
        self._ends.insert(i, end)

    def free_ranges(self) -> list[tuple[int, int]]:
        return list(zip(self._starts, self._ends, strict=True))


def _aliasing(base: torch.Tensor, offset: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A 1-D tensor over base bytes [offset, offset + numel * itemsize) with a (non-owning) storage of its own."""
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    storage = torch._C._construct_storage_from_data_pointer(base.data_ptr() + offset, base.device, nbytes)
    return torch.empty(0, dtype=dtype, device=base.device).set_(storage, 0, (numel,), (1,))


def _unregister(memory: torch.Tensor) -> None:
    """Undo cudaHostRegister (weakref.finalize holds `memory`, so the bytes outlive their registration)."""
    err = int(torch.cuda.cudart().cudaHostUnregister(memory.data_ptr()))
    if err != 0:
        log.warning("memplan: cudaHostUnregister of the host arena failed (cudaError %d)", err)


class HostArena:
    """One host allocation for every pinned buffer of the runtime (see the module docstring)."""

    def __init__(self, chunk_bytes: int, swap_bytes: int, device: torch.device) -> None:
        if chunk_bytes < 0 or swap_bytes < 0:
            raise ValueError(f"HostArena: chunk_bytes {chunk_bytes} and swap_bytes {swap_bytes} must be >= 0")
        if chunk_bytes % HOST_ALIGN_BYTES:
            raise ValueError(f"HostArena: chunk_bytes {chunk_bytes} is not a multiple of {HOST_ALIGN_BYTES}")
        swap_bytes = _round_up(swap_bytes)
        total = chunk_bytes + swap_bytes
        self.device = device
        self.chunk_bytes = chunk_bytes
        self.stats = HostArenaStats(
            arena_bytes=total, chunk_region_bytes=chunk_bytes, swap_region_bytes=swap_bytes
        )
        # made with dispatch modes off: host memory is not device memory (the profiler's CPU storage tracker
        # would count it as device), and it is no kernel's output
        with _disable_current_modes():
            self.memory = torch.empty(total, dtype=torch.uint8, device="cpu")
            self.swap_region = (
                _aliasing(self.memory, chunk_bytes, swap_bytes, torch.uint8)
                if swap_bytes
                else torch.empty(0, dtype=torch.uint8)
            )
        self._cursor = 0
        self.swap = FirstFit(swap_bytes)
        self._finalizer: weakref.finalize | None = None
        if device.type == "cuda" and total:
            err = int(
                torch.cuda.cudart().cudaHostRegister(
                    self.memory.data_ptr(), total, _CUDA_HOST_REGISTER_PORTABLE
                )
            )
            if err != 0:
                raise HostArenaError(
                    f"host arena: cudaHostRegister of {total} bytes failed (cudaError {err}); the plan needs that "
                    "much page-locked host memory (check `ulimit -l` and the container's memlock limit, or plan "
                    "with Constraints.pinned_memory_bytes)"
                )
            self.stats.registered = True
            self._finalizer = weakref.finalize(self, _unregister, self.memory)

    @property
    def nbytes(self) -> int:
        """Bytes of the one host allocation (page-locked on CUDA)."""
        return self.stats.arena_bytes

    @property
    def pinned_bytes(self) -> int:
        """Host bytes the runtime holds page-locked now: the arena and chunk buffers that went around it.

        On CPU nothing is page-locked; the figure is what would be (the arena is the same size there)."""
        return self.stats.arena_bytes + self.stats.chunk_fallback_bytes

    # --------------------------------------------------------------------------------- chunk region
    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor | None:
        """A chunk buffer of `numel` elements from the chunk region, or None (counted) when it does not fit."""
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        size = _round_up(nbytes)
        if self._cursor + size > self.chunk_bytes:
            self.stats.chunk_fallbacks += 1
            self.stats.chunk_fallback_bytes += nbytes
            log.warning(
                "memplan: host arena: a pinned chunk buffer of %d bytes does not fit the %d-byte chunk region "
                "(%d used); allocated outside the arena",
                nbytes,
                self.chunk_bytes,
                self._cursor,
            )
            return None
        with _disable_current_modes():
            t = _aliasing(self.memory, self._cursor, numel, dtype)
        self._cursor += size
        self.stats.chunk_served += 1
        self.stats.chunk_served_bytes += nbytes
        return t

    # ---------------------------------------------------------------------------------- swap region
    def swap_take(self, nbytes: int) -> tuple[int, torch.Tensor] | None:
        """(offset, uint8 buffer of `nbytes`) from the swap region, or None (counted) when nothing fits.

        The caller guarantees that every copy reading or writing the bytes of a freed range is ordered before
        whatever the next owner of the range issues (see `SwapStore._free_host`)."""
        offset = self.swap.alloc(nbytes)
        if offset is None:
            self.stats.swap_fallbacks += 1
            self.stats.swap_fallback_bytes += nbytes
            return None
        self.stats.swap_served += 1
        self.stats.swap_peak_bytes = max(self.stats.swap_peak_bytes, self.swap.peak_extent)
        with _disable_current_modes():
            return offset, self.swap_region[offset : offset + nbytes]

    def swap_free(self, offset: int) -> None:
        self.swap.free(offset)

    # ------------------------------------------------------------------------------------ teardown
    def close(self) -> None:
        """Unregister the page-locked memory (CUDA); the bytes stay valid until the arena is collected."""
        if self._finalizer is not None:
            self._finalizer()
            self._finalizer = None
            self.stats.registered = False


def planned_chunk_bytes(layout: ChunkLayout, *, separate_master: bool, shared_compute: bool = False) -> int:
    """Pinned bytes of the layout's offloaded chunks per rank, as the planner counts them (contract functions).
    `shared_compute`: the sharded chunks' compute copies are node-shared, and a rank's share is one shard."""
    esize = torch.empty((), dtype=layout.compute_dtype).element_size()
    total = 0
    for c in layout.offloaded:
        if c.sharded:  # issue 20: the whole compute copy (or its share), this rank's shard of the rest
            total += sharded_chunk_pinned_bytes(
                c.used_numel,
                layout.world_size,
                esize,
                separate_master=separate_master,
                shared_compute=shared_compute,
            )
        else:
            total += offloaded_chunk_pinned_bytes(c.used_numel * esize, separate_master=separate_master)
    return total


def chunk_region_bytes(layout: ChunkLayout, *, separate_master: bool, shared_compute: bool = False) -> int:
    """Bytes of the arena's chunk region: what the planner counts (`planned_chunk_bytes`) less the shares of
    node-shared compute copies, which live in the node's segment (`node_shared.py`), not in the arena."""
    planned = planned_chunk_bytes(layout, separate_master=separate_master, shared_compute=shared_compute)
    if not shared_compute:
        return planned
    esize = torch.empty((), dtype=layout.compute_dtype).element_size()
    shares = sum(_round_up(c.shard_numel * esize) for c in layout.offloaded if c.sharded)
    return planned - shares


def plan_host_arena_bytes(
    plan: Plan,
    layout: ChunkLayout,
    *,
    separate_master: bool,
    shared_compute: bool = False,
    plan_shares: bool | None = None,
) -> tuple[int, int]:
    """(chunk region, swap region) bytes for `plan` applied as `layout` (`shared_compute`: the sharded chunks'
    compute copies are node-shared; the chunk region then holds the rest of their pinned buffers;
    `plan_shares`: the plan counted them shared, `client.contract.compute_copy_shared` for the job; default
    `shared_compute`).

    The swap region is the plan's swapped activations: `Predictions.pinned_host_bytes` less the chunks' pinned
    bytes as the planner counts them (`planned_chunk_bytes`, the same functions), so the arena and this rank's
    share of the node-shared copy are the plan's pinned figure exactly; 0 without that figure or without a
    swapped block. Where the plan counted a shared copy and the runtime could not share it (`node_shared.py`
    warns), the arena holds the whole private copies on top."""
    chunks = chunk_region_bytes(layout, separate_master=separate_master, shared_compute=shared_compute)
    policy = plan.policy
    swaps = policy is not None and any(b.mode == ActivationMode.swap for b in policy.blocks)
    pinned = plan.predictions.pinned_host_bytes if plan.predictions is not None else None
    if not swaps or pinned is None:
        return chunks, 0
    planned = planned_chunk_bytes(
        layout,
        separate_master=separate_master,
        shared_compute=shared_compute if plan_shares is None else plan_shares,
    )
    if pinned < planned:
        log.warning(
            "memplan: host arena: the plan counts %d pinned bytes, fewer than its offloaded chunks' %d here "
            "(solved for another precision or master setting?); no swap region",
            pinned,
            planned,
        )
        return chunks, 0
    return chunks, pinned - planned


def host_arena_for(
    plan: Plan,
    layout: ChunkLayout,
    device: torch.device,
    *,
    fp32_master: bool = True,
    shared_compute: bool = False,
    plan_shares: bool | None = None,
) -> HostArena | None:
    """The host arena `plan` needs on `device` (what `agent.wrap` makes); None where this PyTorch cannot alias
    arena bytes (pinned buffers are then PyTorch's own, as before). `fp32_master`: `RuntimeOptions.fp32_master`.
    `shared_compute`, `plan_shares`: as `plan_host_arena_bytes`."""
    if not supported():
        log.warning(
            "memplan: this PyTorch cannot alias host arena bytes; pinned buffers are allocated one by one"
        )
        return None
    separate_master = layout.compute_dtype != torch.float32 and fp32_master
    chunks, swap = plan_host_arena_bytes(
        plan, layout, separate_master=separate_master, shared_compute=shared_compute, plan_shares=plan_shares
    )
    return HostArena(chunks, swap, device)


def supported() -> bool:
    """Whether this PyTorch can alias arena bytes with storages of their own."""
    return hasattr(torch._C, "_construct_storage_from_data_pointer")
