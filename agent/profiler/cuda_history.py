"""CUDA memory: the caching allocator's own history of one iteration, and a live/peak gauge.

`CudaAllocatorHistory` turns on `torch.cuda.memory._record_memory_history` for the window, reads
`torch.cuda.memory._snapshot()["device_traces"]` at the end and always turns recording off again (on
success or error). Each `alloc` entry becomes a `StorageRecord` (size is the size the program requested,
which the trace entries carry, not the caching allocator's rounded block); the matching `free_completed` entry (same address, the moment the block is
reusable on its stream) is its free. Blocks are attributed to the profiler's `BlockTracker` without timestamps:
at every `BlockTracker` mark the gauge reads the allocator's cumulative allocation count
(`memory_stats()["allocation.all.allocated"]`), and the n-th `alloc` entry of the window belongs to the
last mark whose count is at most n. Saved-for-backward storages are matched by (address, allocation
count at pack time), so a later reuse of the same address is not confused with them.

`skip_actions=` (drop segment events from the history) exists only in newer PyTorch; older versions
allowed by pyproject's torch floor record them too, and `records` ignores them either way.

The conversion from a snapshot to records is plain functions over the snapshot's dictionaries
(`snapshot_trace`, `state_records`, `history_records`), shared by the profiler's tracked iteration and by
the feedback's recording of the managed iteration (`agent.allocator.managed_step`), and tested on CPU
with snapshots in `torch.cuda.memory._snapshot`'s documented layout.

Written against the PyTorch 2.x API; the development machine has no GPU, so this path was not run there.
"""

from __future__ import annotations

import bisect
import inspect
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from agent.allocator.device_memory import check_history_available
from agent.profiler.storage_tracker import StorageRecord
from agent.profiler.tensors import storage_key
from client.contract import AllocationCategory, Phase

_COUNT_KEY = "allocation.all.allocated"


@dataclass
class CudaGauge:
    """Live and peak allocated bytes from the caching allocator's statistics; counts allocations at marks."""

    device: torch.device
    mark_counts: list[int] = field(default_factory=list)  # allocations since the gauge started, per mark

    def __post_init__(self) -> None:
        check_history_available(self.device)  # memory_stats raise under the planned allocator
        torch.cuda.reset_peak_memory_stats(self.device)
        self.base_count = self.alloc_count()

    def alloc_count(self) -> int:
        return int(torch.cuda.memory_stats(self.device).get(_COUNT_KEY, 0))

    def live_bytes(self) -> int:
        return int(torch.cuda.memory_allocated(self.device))

    def take_peak(self) -> int:
        peak = self.take_sub_peak()
        self.mark_counts.append(self.alloc_count() - self.base_count)
        return peak

    def take_sub_peak(self) -> int:
        """The peak since the previous take, then a new window; no mark count (a gradient landing, not a mark)."""
        peak = int(torch.cuda.max_memory_allocated(self.device))
        torch.cuda.reset_peak_memory_stats(self.device)
        return peak


def record_history_takes_skip_actions() -> bool:
    """Whether this PyTorch's `_record_memory_history` accepts `skip_actions=` (absent in older 2.x)."""
    return "skip_actions" in inspect.signature(torch.cuda.memory._record_memory_history).parameters


class CudaAllocatorHistory:
    """Context manager recording the caching allocator's events for one window on `device`."""

    def __init__(self, device: torch.device, max_entries: int = 2_000_000) -> None:
        check_history_available(device)  # no memory history under the planned allocator
        self.device = device
        self.max_entries = max_entries
        self.entries: list[dict[str, Any]] = []
        self.saved: list[tuple[int, int]] = []  # (address, allocations so far) of storages saved for backward
        self._count_base = 0

    def __enter__(self) -> CudaAllocatorHistory:
        torch.cuda.synchronize(self.device)
        self._count_base = int(torch.cuda.memory_stats(self.device).get(_COUNT_KEY, 0))
        options: dict[str, Any] = {}
        if record_history_takes_skip_actions():
            options["skip_actions"] = ["segment_alloc", "segment_free", "segment_map", "segment_unmap"]
        torch.cuda.memory._record_memory_history(
            enabled="all",
            context=None,
            stacks="python",
            max_entries=self.max_entries,
            device=self.device,
            clear_history=True,
            **options,
        )
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            if exc[0] is None:
                torch.cuda.synchronize(self.device)
                snap = torch.cuda.memory._snapshot(self.device)
                index = self.device.index if self.device.index is not None else torch.cuda.current_device()
                self.entries = snapshot_trace(snap, index)
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)

    @property
    def overflowed(self) -> bool:
        """The history's ring buffer filled: its oldest entries were overwritten, the window is incomplete."""
        return len(self.entries) >= self.max_entries

    def mark_saved(self, tensor: torch.Tensor) -> None:
        count = int(torch.cuda.memory_stats(self.device).get(_COUNT_KEY, 0)) - self._count_base
        self.saved.append((tensor.untyped_storage().data_ptr(), count))

    def records(
        self,
        first_event: int,
        first_sid: int,
        mark_counts: list[int],
        mark_blocks: list[tuple[int | None, Phase]],
    ) -> tuple[list[StorageRecord], int, dict[int, list[tuple[int, int]]]]:
        """Records of the window's allocations, numbered after `first_event`/`first_sid` (`window_records`)."""
        return window_records(self.entries, first_event, first_sid, mark_counts, mark_blocks, self.saved)


def snapshot_trace(snapshot: Mapping[str, Any], index: int) -> list[dict[str, Any]]:
    """Device `index`'s history in a `torch.cuda.memory._snapshot()` (its `device_traces[index]`, the
    `TraceEntry` dictionaries in the order the allocator acted); empty when the snapshot has none."""
    traces = snapshot.get("device_traces", [])
    return [dict(e) for e in traces[index]] if 0 <= index < len(traces) else []


def window_records(
    entries: Sequence[Mapping[str, Any]],
    first_event: int,
    first_sid: int,
    mark_counts: Sequence[int] = (),
    mark_blocks: Sequence[tuple[int | None, Phase]] = (),
    saved: Sequence[tuple[int, int]] = (),
) -> tuple[list[StorageRecord], int, dict[int, list[tuple[int, int]]]]:
    """Records of a window's `alloc` entries, numbered after `first_event`/`first_sid`.

    An `alloc` is a record (its requested `size`); the `free_completed` at the same address is its free
    (a `free_completed` of an address allocated before the window is not an event of it); segment, `oom`
    and `snapshot` entries are not allocations of a tensor. Without marks every record is (no block,
    forward). Returns the records, the next free event index, and per address the (allocation number, sid)
    pairs in order, for matching gradients and saved tensors (`saved`: (address, allocations so far)) to
    records."""
    records: list[StorageRecord] = []
    live: dict[int, StorageRecord] = {}
    by_addr: dict[int, list[tuple[int, int]]] = {}
    event = first_event
    n_alloc = 0
    for e in entries:
        action = e.get("action")
        if action == "alloc":
            k = bisect.bisect_right(mark_counts, n_alloc) - 1
            block, phase = mark_blocks[k] if k >= 0 else (None, Phase.forward)
            sid = first_sid + len(records)
            rec = StorageRecord(sid, int(e["size"]), event, block, phase)
            records.append(rec)
            live[int(e["addr"])] = rec
            by_addr.setdefault(int(e["addr"]), []).append((n_alloc, sid))
            event += 1
            n_alloc += 1
        elif action == "free_completed":
            addr = int(e["addr"])
            if addr in live:
                live.pop(addr).free_event = event
                event += 1
    for addr, count in saved:
        pairs = by_addr.get(addr, [])
        # `count` allocations had happened when it was saved: it is the latest one at `addr` numbered below it
        i = bisect.bisect_right(pairs, (count - 1, 2**62)) - 1
        if i >= 0:
            records[pairs[i][1] - first_sid].saved_for_backward = True
    return records, event, by_addr


def state_records(
    state: Iterable[tuple[torch.Tensor, AllocationCategory, int | None]],
) -> list[StorageRecord]:
    """Records of the device storages alive before the window (model state: parameters, buffers, optimizer
    state, gradients kept across steps), one per storage, at events 0..n-1 and never freed in it."""
    records: list[StorageRecord] = []
    seen: set[tuple[str, int]] = set()
    for t, cat, blk in state:
        key = storage_key(t)
        nbytes = int(t.untyped_storage().nbytes())
        if key in seen or nbytes == 0:
            continue
        seen.add(key)
        records.append(StorageRecord(len(records), nbytes, len(records), blk, Phase.forward, cat))
    return records


def history_records(
    state: list[StorageRecord],
    entries: Sequence[Mapping[str, Any]],
    grad_addrs: Mapping[int, int | None],
    *,
    mark_counts: Sequence[int] = (),
    mark_blocks: Sequence[tuple[int | None, Phase]] = (),
    saved: Sequence[tuple[int, int]] = (),
) -> tuple[list[StorageRecord], int, set[int], dict[int, int | None]]:
    """The window's records after the state's (`state_records`), with the gradients found: `grad_addrs`
    maps the address of each parameter's `.grad` at the end of the window to its block; the last
    allocation at that address is that gradient. Returns records, number of events, gradient sids and
    their blocks (what `build_allocation_trace` takes)."""
    window, n_events, by_addr = window_records(
        entries, len(state), len(state), mark_counts, mark_blocks, saved
    )
    grad_sids: set[int] = set()
    grad_blocks: dict[int, int | None] = {}
    for addr, blk in grad_addrs.items():
        pairs = by_addr.get(addr)
        if pairs:
            sid = pairs[-1][1]
            grad_sids.add(sid)
            grad_blocks[sid] = blk
    return state + window, n_events, grad_sids, grad_blocks
