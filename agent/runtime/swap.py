"""Activation swapping: a block's saved tensors go to host memory in forward and come back one block ahead in backward.

How it works (one `SwapStore` per wrapped model, shared by every block in `swap` mode):
- forward: while a swap block runs, `torch.autograd.graph.saved_tensors_hooks` give each saved tensor to
  `pack`. Model state (parameters, buffers: their storages are listed by the caller) and tensors on other
  devices are passed to the hooks that were active outside the block (the chunk runtime's, when chunks
  are offloaded), so they keep their own handling. Every other saved tensor is swapped by *storage*: the
  whole storage is copied once into a host buffer (pinned on CUDA) on a copy-out stream, after an event
  that marks the compute that produced it; the entry holds the device storage until that copy is done
  (`record_stream` would do for the caching allocator, but does nothing under the planned one), and drops it
  after the compute stream waited for the copy's event: at a later pack once the copy is done, and at the latest
  at the end of the next block's forward (`settle_through`; the end of the root forward for the last block; a
  copy-out slower than that forward then holds the compute stream until it ends). The packed value is the
  storage's entry plus the view geometry (dtype, size, stride, offset), so views of one storage (q/k/v split
  from one projection) share a copy.
  Once its copy is done the device storage is held by nothing of ours: it is freed when the forward stops
  using it.
  A block that runs several times in one root forward (one module called repeatedly: ALBERT's shared layer
  group) keeps every call's tensors in its record (`begin_forward` at the root forward's start tells a second
  call from a later forward's); before, each call forgot the last one's, whose backward then failed.
- backward: `prefetch(block)` starts the copy back of a whole block on a copy-in stream: device memory
  is allocated on the compute stream (so the allocator orders its reuse there), the copy-in stream waits
  for that point and for the copy-out, and an event marks the copy's end. `unpack` makes the compute
  stream wait for that event and rebuilds the view. A block that was not prefetched is fetched when its
  first tensor is unpacked (counted as a miss). Which block to prefetch is decided by the caller from the
  order blocks' backwards started in the previous iteration (see `activations.py`), never from the
  order tensors were packed: unpack order inside a block is whatever autograd's graph walk gives.
- release: each entry counts its packed views; when all were unpacked the entry drops its device copy
  (autograd still holds the unpacked tensors while it needs them) and its host buffer (on CPU the buffer
  is kept for the next copy-out of the same size: fresh host memory costs page faults on every copy).
- host buffers: with the runtime's host arena (`host_arena.py`, what `agent.wrap` gives) each host copy is a
  range of the arena's swap region (first fit), so the pinned memory is the plan's swapped bytes, not
  PyTorch's power-of-two blocks. A freed range is handed out again at once: before freeing it the compute
  stream waits for the copies that used it (copy-out, copy-in), and every later copy into the range waits
  for a compute-stream point after that. A copy that does not fit the region (more swapped bytes than the
  plan counted, or fragmentation) takes a buffer of its own from PyTorch, counted in
  `SwapCounters.arena_fallbacks` / `arena_fallback_bytes`.

On CPU there are no streams: copies are synchronous and events are `None` (the same code path, as in
`device.py`). The CUDA branches (streams, events, pinned memory, record_stream) are written for, but
could not be run in, the CPU-only session that wrote them.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

from agent.runtime.device import Event
from agent.runtime.eager import eager
from agent.runtime.host_arena import HostArena
from agent.runtime.timing import SWAP_IN, SWAP_OUT, SWAP_PREFETCH, RuntimeTiming, section

ModelStateTest = Callable[[torch.Tensor], bool]


@dataclass
class SwapCounters:
    """What swapping moved since the store was made."""

    swapped_out_bytes: int = 0
    swapped_in_bytes: int = 0
    storages_out: int = 0
    prefetched_blocks: int = 0
    late_fetches: int = 0  # blocks fetched only when their own backward started (exposed, like the first one)
    demand_fetches: int = 0  # blocks fetched at their first unpack (not even at their backward's start)
    host_bytes_live: int = 0
    host_bytes_peak: int = 0
    arena_fallbacks: int = 0  # host copies that did not fit the host arena's swap region (own allocation)
    arena_fallback_bytes: int = 0


@dataclass(eq=False)
class SwapEntry:
    """One device storage copied to the host: where its bytes are now, and when each copy is done."""

    block: int
    nbytes: int
    device: torch.device
    host: torch.Tensor | None  # uint8, nbytes
    out_done: Event = None  # copy-out finished (copy-out stream)
    on_device: torch.Tensor | None = None  # uint8 device copy after prefetch
    in_done: Event = None  # copy-in finished (copy-in stream)
    packed: int = 0  # views packed that point at this entry
    unpacked: int = 0
    key: int = 0  # the device storage's address in `SwapStore._by_storage`
    # the swapped device storage, held until its copy-out is done: `record_stream` does nothing under the planned
    # (pluggable) allocator, so only a live reference keeps the storage from being handed out while the copy
    # still reads it (issue 19, defect 5)
    source: torch.Tensor | None = None
    host_offset: int | None = (
        None  # the host copy's range in the host arena's swap region (None: its own buffer)
    )


@dataclass(frozen=True)
class SwappedView:
    """A saved tensor as (entry, geometry): rebuilt from wherever the entry's bytes are at unpack."""

    entry: SwapEntry
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int  # in elements of `dtype`, as `Tensor.storage_offset()`


@dataclass(frozen=True)
class PassedThrough:
    """A saved tensor that is not ours to swap, packed by the hooks active outside the block (if any)."""

    packed: Any
    unpack: Callable[[Any], torch.Tensor] | None


@dataclass
class _BlockRecord:
    entries: list[SwapEntry] = field(default_factory=list)  # every entry the block packed, shared ones too
    ids: set[int] = field(default_factory=set)
    fetched: bool = False
    # the root forward that ran the block (`SwapStore.begin_forward`; None: outside one)
    forward: int | None = None


def _uint8_view(t: torch.Tensor) -> torch.Tensor:
    """The whole storage of `t` as a flat uint8 tensor (no copy)."""
    st = t.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(st, 0, (st.nbytes(),), (1,))


class SwapStore:
    """Swaps the saved tensors of blocks in `swap` mode (see the module docstring)."""

    def __init__(
        self, device: torch.device, is_model_state: ModelStateTest, host_arena: HostArena | None = None
    ) -> None:
        self.device = device
        self.host_arena = host_arena
        self.is_cuda = device.type == "cuda"
        self.is_model_state = is_model_state
        self.counters = SwapCounters()
        self.timing = RuntimeTiming()  # the profiler's probes time the store through its listeners
        if self.is_cuda:
            self.out_stream: torch.cuda.Stream | None = torch.cuda.Stream(device)
            self.in_stream: torch.cuda.Stream | None = torch.cuda.Stream(device)
        else:
            self.out_stream = None
            self.in_stream = None
        self._blocks: dict[int, _BlockRecord] = {}
        # storages swapped in this iteration, by StorageImpl address, dropped when the storage dies: a
        # storage saved by two swap blocks (or twice by one) is copied once
        self._by_storage: dict[int, SwapEntry] = {}
        # CPU: host buffers of released entries by size, reused by the next copy-outs (see `_free_host`);
        # at most the largest set of swapped bytes live at once (the plan's swapped host bytes)
        self._host_free: dict[int, list[torch.Tensor]] = {}
        self._copying: list[
            SwapEntry
        ] = []  # entries whose swapped storage is held until its copy-out is done
        self._current: int | None = None
        self._outer: tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]] | None = None
        self._forwards = 0  # root forwards begun
        self._forward: int | None = None  # the root forward running now (None: none)

    def begin_forward(self) -> None:
        """A root forward starts: a block that runs again before it ends adds to what it saved in it."""
        self._forwards += 1
        self._forward = self._forwards

    def end_forward(self) -> None:
        """The root forward ended (a block run after it, outside any, starts its record afresh)."""
        self._forward = None

    # ------------------------------------------------------------------------------ forward
    @contextmanager
    def swapping(self, block: int) -> Iterator[None]:
        """While open, tensors saved for backward are swapped out as block `block`'s."""
        if not torch.is_grad_enabled():
            yield  # nothing is saved without grad (e.g. evaluation): run the block as it is
            return
        outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        prev_block, prev_outer = self._current, self._outer
        self._current, self._outer = block, outer
        rec = self._blocks.get(block)
        if rec is None or rec.fetched or self._forward is None or rec.forward != self._forward:
            self._forget(block)  # tensors of an earlier forward whose backward never ran
            self._blocks[block] = _BlockRecord(forward=self._forward)
        # else the block runs again in the same root forward (one module called several times: ALBERT's shared
        # layer group, a ModuleList holding one block N times): its saved tensors join the earlier calls', all
        # fetched back at its first backward (the profile counts the block's calls together)
        try:
            with torch.autograd.graph.saved_tensors_hooks(eager(self._pack), eager(self._unpack)):
                yield
        finally:
            self._current, self._outer = prev_block, prev_outer

    @section(SWAP_OUT)
    def _pack(self, t: torch.Tensor) -> Any:
        if (
            t.device != self.device
            or t.layout != torch.strided
            or t.is_meta
            or self._current is None
            or self.is_model_state(t)
        ):
            if self._outer is None:
                return PassedThrough(t, None)
            return PassedThrough(self._outer[0](t), self._outer[1])
        st = t.untyped_storage()
        key = st._cdata
        entry = self._by_storage.get(key)
        rec = self._blocks[self._current]
        if entry is None or entry.host is None:  # (a released entry: the storage outlived its backward)
            entry = self._copy_out(t, self._current)
            entry.key = key
            self._by_storage[key] = entry
            weakref.finalize(st, self._by_storage.pop, key, None)
        if id(entry) not in rec.ids:  # a storage an earlier swap block saved too: one copy, fetched by both
            rec.ids.add(id(entry))
            rec.entries.append(entry)
        entry.packed += 1
        return SwappedView(entry, t.dtype, tuple(t.shape), tuple(t.stride()), int(t.storage_offset()))

    def settle_through(self, block: int | None) -> None:
        """Drop the swapped storages of blocks up to `block` (every block: None), copied out or not, and any whose
        copy-out is done. Called at the end of each block's forward for the blocks before it and at the end of
        the root forward for all (`activations.py`): a swapped block's storages live through the next block's
        forward at most, as the planner counts them on a device whose copies overlap compute. Before (session
        17, an H200), they were let go only at the next swap block's first pack or in backward's first
        prefetch, so the last swapped block's activations stayed on the device through the end of forward and
        the start of backward: peaks 4-15% over the plan's with a swapped block."""
        self._settle_sources(through=block, wait=block is None)

    def _settle_sources(self, *, wait: bool = False, through: int | None = None) -> None:
        """Drop the swapped storages whose copy-out is done (all of them with `wait`, and those of blocks up to
        `through`). The compute stream first waits for the copy's event, so whatever the allocator hands out
        after the free (on the compute stream) is ordered after the copy; for a finished copy that wait costs
        nothing."""
        still: list[SwapEntry] = []
        for entry in self._copying:
            done = entry.out_done
            due = wait or (through is not None and entry.block <= through)
            if done is not None and not due and not done.query():
                still.append(entry)
                continue
            if done is not None:
                torch.cuda.current_stream(self.device).wait_event(done)
            entry.source = None
        self._copying = still

    def _copy_out(self, t: torch.Tensor, block: int) -> SwapEntry:
        self._settle_sources()
        src = _uint8_view(t)
        nbytes = src.numel()
        host, offset = self._take_host(nbytes)
        entry = SwapEntry(block=block, nbytes=nbytes, device=t.device, host=host, host_offset=offset)
        if self.out_stream is not None:
            produced = torch.cuda.current_stream(self.device).record_event()
            with torch.cuda.stream(self.out_stream):
                self.out_stream.wait_event(produced)
                host.copy_(src, non_blocking=True)
                entry.out_done = self.out_stream.record_event()
            entry.source = (
                src  # released by `_settle_sources` once the copy is done (record_stream is not enough)
            )
            self._copying.append(entry)
        else:
            host.copy_(src)
        c = self.counters
        c.swapped_out_bytes += nbytes
        c.storages_out += 1
        c.host_bytes_live += nbytes
        c.host_bytes_peak = max(c.host_bytes_peak, c.host_bytes_live)
        return entry

    # ----------------------------------------------------------------------------- backward
    def swapped_blocks(self) -> list[int]:
        """Blocks holding swapped tensors now (swapped in this forward, not yet fully unpacked)."""
        return [b for b, r in self._blocks.items() if r.entries]

    @section(SWAP_PREFETCH)
    def prefetch(self, block: int, *, late: bool = False) -> bool:
        """Start copying block `block`'s swapped tensors back to the device; False if it has none pending.

        `late`: the block's own backward has already started (counted in `late_fetches`).
        """
        rec = self._blocks.get(block)
        if rec is None or rec.fetched or not rec.entries:
            return False
        rec.fetched = True
        if late:
            self.counters.late_fetches += 1
            self.counters.prefetched_blocks -= 1
        self._settle_sources(wait=True)  # backward: every copy-out before it is needed anyway
        compute_point = torch.cuda.current_stream(self.device).record_event() if self.is_cuda else None
        for entry in rec.entries:
            if entry.on_device is not None or entry.host is None:
                continue
            dst = torch.empty(entry.nbytes, dtype=torch.uint8, device=self.device)  # on the compute stream
            if self.in_stream is not None:
                with torch.cuda.stream(self.in_stream):
                    assert compute_point is not None
                    self.in_stream.wait_event(compute_point)
                    if entry.out_done is not None:
                        self.in_stream.wait_event(entry.out_done)
                    dst.copy_(entry.host, non_blocking=True)
                    entry.in_done = self.in_stream.record_event()
            else:
                dst.copy_(entry.host)
            entry.on_device = dst
            self.counters.swapped_in_bytes += entry.nbytes
        self.counters.prefetched_blocks += 1
        return True

    @section(SWAP_IN)
    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, PassedThrough):
            return packed.unpack(packed.packed) if packed.unpack is not None else packed.packed
        assert isinstance(packed, SwappedView)
        entry = packed.entry
        if entry.on_device is None:
            rec = self._blocks.get(entry.block)
            if rec is not None and not rec.fetched and not self._shared_elsewhere(entry):
                self.counters.demand_fetches += 1
                self.counters.prefetched_blocks -= 1  # counted as a demand fetch, not a prefetch
                self.prefetch(entry.block)
            if entry.on_device is None:  # a shared entry, or unpacked again after release: fetch it alone
                self._refetch(entry)
        if entry.in_done is not None:
            torch.cuda.current_stream(self.device).wait_event(entry.in_done)
        data = entry.on_device
        assert data is not None
        out = torch.empty(0, dtype=packed.dtype, device=self.device).set_(
            data.untyped_storage(), packed.offset, packed.size, packed.stride
        )
        entry.unpacked += 1
        if entry.unpacked >= entry.packed:
            self._release(entry)
        return out

    def _shared_elsewhere(self, entry: SwapEntry) -> bool:
        """The entry is also in another swap block's list (a storage several blocks saved)."""
        return any(id(entry) in r.ids for b, r in self._blocks.items() if b != entry.block)

    def _refetch(self, entry: SwapEntry) -> None:
        if entry.host is None:
            raise RuntimeError(
                "activation swap: a swapped tensor was unpacked after its host copy was released: a second "
                "backward through the same graph (the first needs retain_graph=True), or the backward of a "
                "forward that another forward with gradients followed before it (two forwards whose losses are "
                "summed: the swap store keeps one forward's activations per block). Run one forward on the "
                "batches concatenated, or a forward and its backward in turn for each (gradient accumulation). "
                "A block module that runs several times in one forward (weights shared across layers) keeps "
                "every call's tensors only when the forward is the wrapped model's own call "
                "(`wrapped.model(...)`), not a submodule's or `.forward(...)` called directly"
            )
        dst = torch.empty(entry.nbytes, dtype=torch.uint8, device=self.device)
        if entry.out_done is not None:
            torch.cuda.current_stream(self.device).wait_event(entry.out_done)
        dst.copy_(entry.host, non_blocking=self.is_cuda)
        entry.on_device = dst
        entry.in_done = None

    def _release(self, entry: SwapEntry) -> None:
        """Every packed view was unpacked: drop our device copy and the host buffer."""
        self._drop_device_copy(entry)
        if entry.host is not None:
            self.counters.host_bytes_live -= entry.nbytes
            self._free_host(entry)
        if self._by_storage.get(entry.key) is entry:
            del self._by_storage[
                entry.key
            ]  # a storage that lives on (a batch tensor) is copied afresh next time
        for b in [b for b, r in self._blocks.items() if id(entry) in r.ids]:
            if all(e.host is None for e in self._blocks[b].entries):
                del self._blocks[b]

    def _forget(self, block: int) -> None:
        rec = self._blocks.pop(block, None)
        if rec is None:
            return
        for e in rec.entries:
            if e.host is not None:
                self.counters.host_bytes_live -= e.nbytes
                self._free_host(e)
            self._drop_device_copy(e)
            if self._by_storage.get(e.key) is e:
                del self._by_storage[e.key]

    def _drop_device_copy(self, entry: SwapEntry) -> None:
        """Free the prefetched device copy; the compute stream waits for the copy-in writing it first (an entry
        dropped without being unpacked, e.g. a graph freed without backward), so a reuse of the memory on the
        compute stream cannot overtake the copy. A swapped storage still held for its copy-out is let go too."""
        if entry.on_device is not None and entry.in_done is not None:
            torch.cuda.current_stream(self.device).wait_event(entry.in_done)
        entry.on_device = None
        if entry.source is not None:
            if entry.out_done is not None:
                torch.cuda.current_stream(self.device).wait_event(entry.out_done)
            entry.source = None
            self._copying = [e for e in self._copying if e is not entry]

    def _take_host(self, nbytes: int) -> tuple[torch.Tensor, int | None]:
        """A host buffer for a copy-out: a range of the host arena's swap region, else one of its own."""
        if self.host_arena is not None:
            got = self.host_arena.swap_take(nbytes)
            if got is not None:
                return got[1], got[0]
            self.counters.arena_fallbacks += 1
            self.counters.arena_fallback_bytes += nbytes
        free = self._host_free.get(nbytes)
        return (free.pop() if free else _host_bytes(nbytes, pinned=self.is_cuda)), None

    def _free_host(self, entry: SwapEntry) -> None:
        """The entry's host buffer is no longer needed.

        An arena range goes back to the swap region's free list at once, so the compute stream first waits
        for the copies that used it: whoever gets the range next copies into it on a stream that waits for a
        compute-stream point after this one (copy-out) or copies on the compute stream (refetch). Otherwise, on
        CUDA, the caching host allocator keeps pinned memory until its copies end; on CPU the buffer is kept for
        the next iteration's copy of the same size (copies are synchronous there): fresh host memory would be
        faulted in page by page every iteration."""
        host, entry.host = entry.host, None
        if host is None:
            return
        if entry.host_offset is not None:
            assert self.host_arena is not None
            if self.is_cuda:
                compute = torch.cuda.current_stream(self.device)
                for done in (entry.out_done, entry.in_done):
                    if done is not None:
                        compute.wait_event(done)
            self.host_arena.swap_free(entry.host_offset)
            entry.host_offset = None
        elif not self.is_cuda:
            self._host_free.setdefault(entry.nbytes, []).append(host)

    def end_iteration(self) -> None:
        """Forget every block's swapped tensors (used when the manager is removed) and the kept host buffers."""
        for block in list(self._blocks):
            self._forget(block)
        self._host_free.clear()


def _host_bytes(nbytes: int, *, pinned: bool) -> torch.Tensor:
    """A host buffer for swapped bytes.

    Allocated with dispatch modes switched off: host memory is not device memory, and on CPU the device
    memory meter (the profiler's storage tracker, a TorchDispatchMode) would otherwise count it as device.
    On CUDA `pin_memory=True` goes through PyTorch's caching host allocator (no cudaHostAlloc per call).
    """
    with _disable_current_modes():
        return torch.empty(nbytes, dtype=torch.uint8, device="cpu", pin_memory=pinned)
