"""Device buffer pool: `n_buffers` pre-allocated chunk-sized slots that offloaded chunks are uploaded into.

A slot holds at most one chunk: its compute copy (parameters are views into it while resident) and a
gradient area the chunk's gradients are gathered in before they go to the host. `free_after` is the
set of events a new upload into the slot must wait for: compute that read the old contents and the
gradient copy that drained it (`issued`: the host-worker tasks that record some of those events).
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from agent.runtime.device import DeviceContext, Event


@dataclass
class Slot:
    index: int
    params: torch.Tensor
    grad: torch.Tensor
    chunk: int | None = None
    pins: int = 0  # modules running forward with this chunk
    last_use: int = 0  # logical clock of the last demand (LRU tie-break)
    free_after: list[Event] = field(default_factory=list)
    # host-worker tasks that record events of `free_after` (a sharded chunk's reduce-scatter on CUDA): an event
    # must be recorded before a stream waits on it, so the next upload waits for these to have run first
    issued: list[Future[None]] = field(default_factory=list)


class BufferPool:
    def __init__(self, ctx: DeviceContext, n_buffers: int, chunk_numel: int, dtype: torch.dtype) -> None:
        self.slots = [
            Slot(
                index=i,
                params=ctx.device_empty(chunk_numel, dtype),
                grad=ctx.device_empty(chunk_numel, dtype),
            )
            for i in range(n_buffers)
        ]

    @property
    def nbytes(self) -> int:
        return sum(s.params.nbytes + s.grad.nbytes for s in self.slots)

    def storage_ids(self) -> dict[int, Slot]:
        """data_ptr of each slot's parameter storage -> slot: how saved tensors are recognised."""
        return {s.params.untyped_storage().data_ptr(): s for s in self.slots}
