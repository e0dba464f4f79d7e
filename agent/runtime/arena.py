"""Runtime arena: the runtime's own device buffers as views into one pre-allocated arena at planned offsets.

Level 1 of the planned allocation (issue 9). The chunk runtime asks its `DeviceContext` for every
device buffer it owns (`device_empty`): persistent chunk storage (parameters, gradients, fp32 masters
under mixed precision) and the device buffer pool for offloaded chunks (parameter and gradient area
per buffer). `ArenaDeviceContext` is a `DeviceContext` that reserves one arena of the planned size
up front and answers each request with a tensor at its planned offset, so the runtime makes no
device allocation of its own after construction, and its memory is exactly what the plan certified.

* `runtime_buffers(layout)`: the buffers the runtime will ask for, in the order it asks;
* `plan_runtime_arena(layout)`: their allocation trace (all long-lived) and the allocation planner's
  offsets for it (the embedded solver, in-process);
* `ArenaDeviceContext(device, allocation, events)`: the arena; requests are matched to planned buffers
  by order and size (any unused planned buffer of the same size when the order differs); a request
  that matches none is allocated outside the arena and counted (or refused with `strict=True`);
* `runtime_arena_context(device, layout)`: both steps, what `agent.wrap` calls.

Each served tensor has its own storage aliasing the arena's bytes (not a view sharing the arena's
storage), because the runtime recognises its buffers by `untyped_storage().data_ptr()`. That storage
is made with `torch._C._construct_storage_from_data_pointer` (the non-owning storage PyTorch's
CUDA-graph trees use); the context keeps the arena alive, so tensors served by it must not outlive
the context (the runtime holds its context for its whole life). Not placed here: gradient staging
(host memory) and activation swap (`swap.py` makes its swapped-in device copies with `torch.empty`
per iteration, outside `DeviceContext`; on CUDA the planned allocator of Level 2 serves them).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from agent.allocator.slots import plan_slots
from agent.runtime.device import DeviceContext, element_size
from agent.runtime.layout import ChunkLayout
from client.contract import (
    AllocationCategory,
    AllocationEvent,
    AllocationPlan,
    AllocationTrace,
    Phase,
)


class ArenaMismatchError(RuntimeError):
    """A runtime buffer request matched no planned buffer (raised only with `strict=True`)."""


@dataclass(frozen=True)
class RuntimeBuffer:
    """One device buffer of the runtime: `name` says whose (e.g. 'chunk3.grad', 'buffer1.params')."""

    name: str
    numel: int
    dtype: torch.dtype
    category: AllocationCategory

    @property
    def nbytes(self) -> int:
        return self.numel * element_size(self.dtype)


@dataclass(frozen=True)
class RuntimeArenaPlan:
    """The runtime's buffers, their allocation trace (event id k = buffers[k]) and the planned offsets."""

    buffers: list[RuntimeBuffer]
    trace: AllocationTrace
    allocation: AllocationPlan


@dataclass
class ArenaStats:
    """What the arena served and what went around it; host allocations are counted for completeness."""

    arena_bytes: int = 0
    served: int = 0
    served_bytes: int = 0
    outside: int = 0
    outside_bytes: int = 0
    host_allocs: int = 0
    host_bytes: int = 0
    mismatches: list[str] = field(default_factory=list)

    @property
    def device_allocs(self) -> int:
        """Every device buffer request the runtime made (served or not)."""
        return self.served + self.outside


def runtime_buffers(layout: ChunkLayout) -> list[RuntimeBuffer]:
    """The device buffers `ModelStateManager` requests, in its order (chunks, then the buffer pool)."""
    mixed = layout.compute_dtype != torch.float32
    out: list[RuntimeBuffer] = []
    for spec in layout.chunks:
        n = spec.used_numel
        if spec.offloaded or n == 0:
            continue
        out.append(
            RuntimeBuffer(f"chunk{spec.index}.params", n, layout.compute_dtype, AllocationCategory.param)
        )
        out.append(RuntimeBuffer(f"chunk{spec.index}.grad", n, layout.compute_dtype, AllocationCategory.grad))
        if mixed:
            out.append(
                RuntimeBuffer(f"chunk{spec.index}.master", n, torch.float32, AllocationCategory.optimizer)
            )
    if layout.offloaded and layout.chunk_numel > 0:
        n = layout.buffer_numel  # a sharded chunk's zero-padded size where that exceeds the capacity
        for i in range(layout.n_buffers):
            out.append(RuntimeBuffer(f"buffer{i}.params", n, layout.compute_dtype, AllocationCategory.param))
            out.append(RuntimeBuffer(f"buffer{i}.grad", n, layout.compute_dtype, AllocationCategory.grad))
    return out


def runtime_allocation_trace(buffers: Sequence[RuntimeBuffer]) -> AllocationTrace:
    """The buffers as an allocation trace: made in order at construction, alive for the whole run."""
    events = [
        AllocationEvent(
            id=k,
            size_bytes=b.nbytes,
            alloc_index=k,
            free_index=None,
            category=b.category,
            phase=Phase.forward,
        )
        for k, b in enumerate(buffers)
    ]
    # `events=` is taken by the contract's "before" validator (packed on arrival), which mypy cannot see
    return AllocationTrace(source="dispatch_tracker", horizon=max(1, len(events)), events=events)  # type: ignore[call-arg]


def plan_runtime_arena(layout: ChunkLayout, *, alignment_bytes: int = 512) -> RuntimeArenaPlan:
    """Plan the runtime's arena with the allocation planner (embedded, in-process)."""
    # local import: the allocation planner loads ortools and numba; only `allocation="planned"` needs it
    from planner_service.solver.allocation import plan_allocation

    buffers = runtime_buffers(layout)
    trace = runtime_allocation_trace(buffers)
    allocation = plan_allocation(trace, alignment_bytes=alignment_bytes)
    return RuntimeArenaPlan(buffers=buffers, trace=trace, allocation=allocation)


def _aliasing_tensor(arena: torch.Tensor, offset: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A 1-D tensor over arena bytes [offset, offset + numel * size) with a storage of its own."""
    nbytes = numel * element_size(dtype)
    storage = torch._C._construct_storage_from_data_pointer(arena.data_ptr() + offset, arena.device, nbytes)
    return torch.empty(0, dtype=dtype, device=arena.device).set_(storage, 0, (numel,), (1,))


class ArenaDeviceContext(DeviceContext):
    """A DeviceContext whose `device_empty` serves the planned buffers from one pre-allocated arena."""

    def __init__(
        self,
        device: torch.device,
        allocation: AllocationPlan,
        events: Sequence[AllocationEvent],
        *,
        strict: bool = False,
    ) -> None:
        super().__init__(device)

        slots = plan_slots(allocation, events)  # validates offsets, alignment and the arena bound
        self.strict = strict
        self._sizes = slots.sizes
        self._offsets = slots.offsets
        self._used = [False] * len(slots.sizes)
        self._cursor = 0
        extent = -(-allocation.arena_bytes // allocation.alignment_bytes) * allocation.alignment_bytes
        self.stats = ArenaStats(arena_bytes=extent)
        self._aliasing = hasattr(torch._C, "_construct_storage_from_data_pointer")
        if not self._aliasing:
            self.stats.mismatches.append(
                "this PyTorch has no torch._C._construct_storage_from_data_pointer: every buffer is allocated "
                "outside the arena"
            )
        # the one device allocation of the runtime's buffers
        self.arena = torch.empty(extent, dtype=torch.uint8, device=device)

    def _match(self, nbytes: int) -> int | None:
        """The planned buffer for a request of `nbytes`: the next in order, else any unused one that size."""
        while self._cursor < len(self._sizes) and self._used[self._cursor]:
            self._cursor += 1
        if self._cursor < len(self._sizes) and self._sizes[self._cursor] == nbytes:
            return self._cursor
        candidates = [k for k, s in enumerate(self._sizes) if s == nbytes and not self._used[k]]
        return min(candidates, key=lambda k: self._offsets[k]) if candidates else None

    def device_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        nbytes = numel * element_size(dtype)
        if nbytes == 0:
            return torch.empty(0, dtype=dtype, device=self.device)
        k = self._match(nbytes) if self._aliasing else None
        if k is None:
            why = f"device_empty({numel}, {dtype}): {nbytes} B matches no unused planned buffer"
            if self.strict:
                raise ArenaMismatchError(f"runtime arena: {why}")
            self.stats.outside += 1
            self.stats.outside_bytes += nbytes
            self.stats.mismatches.append(why)
            return super().device_empty(numel, dtype)
        self._used[k] = True
        self.stats.served += 1
        self.stats.served_bytes += nbytes
        return _aliasing_tensor(self.arena, self._offsets[k], numel, dtype)

    def host_empty(self, numel: int, dtype: torch.dtype, *, pinned: bool) -> torch.Tensor:
        self.stats.host_allocs += 1
        self.stats.host_bytes += numel * element_size(dtype)
        return super().host_empty(numel, dtype, pinned=pinned)

    def contains(self, t: torch.Tensor) -> bool:
        """Whether `t`'s bytes lie inside the arena."""
        base = self.arena.data_ptr()
        start = t.untyped_storage().data_ptr()
        return (
            t.device == self.arena.device
            and base <= start
            and start + t.untyped_storage().nbytes() <= base + self.arena.numel()
        )


def runtime_arena_context(
    device: torch.device, layout: ChunkLayout, *, strict: bool = False, alignment_bytes: int = 512
) -> ArenaDeviceContext:
    """Plan the runtime's buffers for `layout` and reserve their arena on `device`."""
    planned = plan_runtime_arena(layout, alignment_bytes=alignment_bytes)
    return ArenaDeviceContext(device, planned.allocation, planned.trace.events, strict=strict)
