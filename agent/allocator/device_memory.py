"""Device memory figures (allocated bytes, the peak, its reset) from whichever allocator serves the device.

Under PyTorch's caching allocator: `torch.cuda.memory_allocated` / `max_memory_allocated` /
`reset_peak_memory_stats`. Under the planned allocator (`CUDAPluggableAllocator`) those calls, and the
allocator's memory history, raise (`TORCH_CHECK(false)` in PyTorch's pluggable allocator): the figures come
from the C++ core's own statistics instead (`AllocatorStats.allocated_bytes` / `peak_allocated_bytes`,
aligned to the plan's alignment as PyTorch's are to its 512-byte blocks). Every caller in the agent that
reads CUDA memory figures goes through here (`DevicePeakMeter`, the profiler's gauge).

The selection is tested on CPU with the C++ core behind the fake CUDA runtime; the real pluggable
allocator was not run (no GPU where this was written).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from agent.allocator.cuda import installed

if TYPE_CHECKING:
    from agent.allocator.cuda import CudaPlannedAllocator


class AllocatorHistoryUnavailable(RuntimeError):
    """The CUDA allocator's history (profiling's allocation trace) cannot be recorded under the planned allocator."""


def planned_allocator(device: torch.device) -> CudaPlannedAllocator | None:
    """The planned allocator serving `device`'s memory, if one is installed in this process."""

    handle = installed()
    if handle is None or device.type != "cuda":
        return None
    return handle


def reset_peak(device: torch.device) -> None:
    """Start a new peak window on `device`."""
    handle = planned_allocator(device)
    if handle is not None:
        handle.reset_peaks()
        return

    torch.cuda.reset_peak_memory_stats(device)


def peak_allocated(device: torch.device) -> int:
    """Peak bytes allocated on `device` since the last `reset_peak`."""
    handle = planned_allocator(device)
    if handle is not None:
        return handle.stats().peak_allocated_bytes

    return int(torch.cuda.max_memory_allocated(device))


def allocated(device: torch.device) -> int:
    """Bytes allocated on `device` now."""
    handle = planned_allocator(device)
    if handle is not None:
        return handle.stats().allocated_bytes

    return int(torch.cuda.memory_allocated(device))


def check_history_available(device: torch.device) -> None:
    """Raise AllocatorHistoryUnavailable when the planned allocator serves `device` (no memory history there)."""
    if planned_allocator(device) is not None:
        raise AllocatorHistoryUnavailable(
            "the planned CUDA allocator is installed in this process: PyTorch's pluggable allocator records "
            "no memory history and no memory_stats, so the job cannot be profiled on the GPU here. Profile "
            "(or let wrap plan) before installing it: wrap(..., allocation='planned') plans in a child "
            "process, and agent.plan_with_allocation(...) saves a plan for agent.install_allocator(...)"
        )
