"""CPU memory tracker: a `TorchDispatchMode` that records every tensor storage allocated and freed.

How it works: every ATen op of the iteration passes through `__torch_dispatch__`. After the op runs, each
output that the op's schema does not declare as an alias of an input (views, in-place and out= ops
allocate nothing) has its `untyped_storage()` looked up by StorageImpl address in a table of live
storages; a storage not seen before is a new allocation (its `nbytes()` at that moment, the current block and phase from the `BlockTracker`). A
`weakref.finalize` on the storage's Python object records the free: PyTorch keeps one Python object per
live storage (PyObject preservation), so the finaliser runs exactly when the last tensor using the
storage dies, including frees that happen inside C++ (autograd releasing saved tensors). Storages that
were alive before the window (parameters, buffers, optimizer states, the batch) are registered up front,
so views and in-place ops on them are not mistaken for allocations.

This sees what PyTorch's CPU allocator is asked for, op by op, including memory that functional ops
(softmax, layer_norm, cross-entropy) allocate and free between module hooks. It does not see allocator
rounding or fragmentation (the CPU allocator is malloc), nor memory outside tensors. It is also the
`Gauge` (live and peak bytes) for the `BlockTracker`'s marks.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from agent.profiler.block_marks import BlockTracker
from client.contract import AllocationCategory, Phase

_EXTERNAL = -1


@dataclass
class StorageRecord:
    """One tracked storage: where and when it was allocated, when it was freed (event positions)."""

    sid: int
    nbytes: int
    alloc_event: int
    block: int | None
    phase: Phase
    category: AllocationCategory | None = None  # fixed for pre-registered storages, else decided later
    free_event: int | None = None
    saved_for_backward: bool = False


class StorageTracker(TorchDispatchMode):
    """Records allocations and frees of tensor storages; use as a context manager around one iteration."""

    def __init__(self, block_tracker: BlockTracker | None = None) -> None:
        super().__init__()
        self.block_tracker = block_tracker
        self.records: list[StorageRecord] = []
        self.n_events = 0
        # Keyed by the StorageImpl's address (`_cdata`), removed when the storage dies, so a reused address
        # is a new storage. Values: record id, or _EXTERNAL for storages that are not tracked.
        self._ids: dict[int, int] = {}
        self._finalizers: list[weakref.finalize] = []
        self._aliasing: dict[Any, tuple[bool, ...]] = {}
        self._live = 0
        self._peak = 0
        self._overall_peak = 0
        self._open = True

    # ------------------------------------------------------------------ registration
    def register_existing(
        self,
        tensor: torch.Tensor,
        category: AllocationCategory,
        block: int | None,
        phase: Phase = Phase.forward,
    ) -> None:
        """A storage alive before the window that belongs to the iteration's memory (model state)."""
        st = tensor.untyped_storage()
        if st._cdata in self._ids or st.nbytes() == 0:
            return
        self._track(st, block, phase, category)

    def register_external(self, tensor: torch.Tensor) -> None:
        """A storage alive before the window that is not the model's (e.g. the batch): ignored."""
        st = tensor.untyped_storage()
        if st._cdata not in self._ids:
            self._ids[st._cdata] = _EXTERNAL
            self._finalizers.append(weakref.finalize(st, self._forget, st._cdata))

    def record_of(self, tensor: torch.Tensor) -> StorageRecord | None:
        sid = self._ids.get(tensor.untyped_storage()._cdata)
        return None if sid is None or sid == _EXTERNAL else self.records[sid]

    def mark_saved(self, tensor: torch.Tensor) -> None:
        rec = self.record_of(tensor)
        if rec is not None:
            rec.saved_for_backward = True

    # ------------------------------------------------------------------ gauge
    def live_bytes(self) -> int:
        return self._live

    def take_peak(self) -> int:
        peak, self._peak = self._peak, self._live
        return peak

    def take_sub_peak(self) -> int:
        return self.take_peak()

    @property
    def peak_bytes(self) -> int:
        return self._overall_peak

    # ------------------------------------------------------------------ dispatch
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if not self._open:
            return out
        aliasing = self._aliasing.get(func)
        if aliasing is None:
            # Outputs that the schema declares as aliases of inputs (views, in-place and out= ops) are never
            # new allocations; only the other outputs can be.
            aliasing = tuple(r.alias_info is not None for r in func._schema.returns)
            self._aliasing[func] = aliasing
        inputs = _Inputs(args, kwargs)
        if isinstance(out, torch.Tensor):
            if not (aliasing and aliasing[0]):
                self._maybe_new(out, inputs)
        elif isinstance(out, (tuple, list)):
            for i, t in enumerate(out):
                if i < len(aliasing) and aliasing[i]:
                    continue
                if isinstance(t, torch.Tensor):
                    self._maybe_new(t, inputs)
                elif isinstance(t, (tuple, list)):  # e.g. Tensor[] returns
                    for u in t:
                        if isinstance(u, torch.Tensor):
                            self._maybe_new(u, inputs)
        return out

    def _maybe_new(self, t: torch.Tensor, inputs: _Inputs) -> None:
        if not _has_storage(t):
            return
        st = t.untyped_storage()
        if st._cdata in self._ids or st.nbytes() == 0 or st._cdata in inputs.storages():
            return
        block_tracker = self.block_tracker
        self._track(
            st,
            block_tracker.block if block_tracker is not None else None,
            block_tracker.phase if block_tracker is not None else Phase.forward,
            None,
        )

    def _track(self, st: Any, block: int | None, phase: Phase, category: AllocationCategory | None) -> None:
        sid = len(self.records)
        nbytes = int(st.nbytes())
        self.records.append(StorageRecord(sid, nbytes, self.n_events, block, phase, category))
        self.n_events += 1
        self._ids[st._cdata] = sid
        self._finalizers.append(weakref.finalize(st, self._freed, sid, st._cdata))
        self._live += nbytes
        if self._live > self._peak:
            self._peak = self._live
            if self._live > self._overall_peak:
                self._overall_peak = self._live

    def _freed(self, sid: int, cdata: int) -> None:
        self._ids.pop(cdata, None)
        if not self._open:
            return
        rec = self.records[sid]
        rec.free_event = self.n_events
        self.n_events += 1
        self._live -= rec.nbytes

    def _forget(self, cdata: int) -> None:
        self._ids.pop(cdata, None)

    # ------------------------------------------------------------------ lifecycle
    def __exit__(self, *exc: Any) -> Any:
        try:
            return super().__exit__(*exc)
        finally:
            self.close()

    def close(self) -> None:
        """Stop recording: later frees (e.g. gradients released next iteration) are not part of the window."""
        self._open = False
        for f in self._finalizers:
            f.detach()
        self._finalizers.clear()


class _Inputs:
    """The storages of an op's tensor arguments, looked up only when an output's storage is unknown.

    An output on the storage of one of the op's own arguments is that argument, not an allocation, whatever
    the schema says. The schemas of torch.distributed's collectives (`c10d::allreduce_`, `_allgather_base_`,
    `_reduce_scatter_base_`, `broadcast_`, ...) return their in/out arguments with no alias annotation; read as
    allocations, every collective on a tensor the window did not register (an offloaded chunk's host gradient,
    staging buffer, exposed gradient, compute copy: host memory) added that tensor's bytes to the device
    figure for the rest of the window (issue 20: multi-rank peaks 7-35% over the plan on CPU)."""

    __slots__ = ("_args", "_kwargs", "_storages")

    def __init__(self, args: Any, kwargs: Any) -> None:
        self._args = args
        self._kwargs = kwargs
        self._storages: set[int] | None = None

    def storages(self) -> set[int]:
        if self._storages is None:
            found: set[int] = set()
            _collect_storages(self._args, found)
            if self._kwargs:
                _collect_storages(tuple(self._kwargs.values()), found)
            self._storages = found
        return self._storages


def _collect_storages(values: Any, found: set[int]) -> None:
    for v in values:
        if isinstance(v, torch.Tensor):
            if _has_storage(v):
                found.add(v.untyped_storage()._cdata)
        elif isinstance(v, (tuple, list)):  # Tensor[] and Tensor[][] arguments
            _collect_storages(v, found)


def _has_storage(t: torch.Tensor) -> bool:
    return not t.is_meta and t.layout == torch.strided and t.device.type != "meta"
