"""Planned allocator: serve an iteration's allocations at the allocation plan's offsets, with safe fallbacks.

A C++ core (`csrc/`) replays the plan (the k-th allocation of the iteration at its planned offset when
order and size match), falls back to a best-fit pool in the arena's free gaps and then to a plain
allocation, never hands out overlapping live ranges (a debug mode checks), and counts everything.
Backends: host memory (`PlannedAllocator`, CPU tests and trace replay) and CUDA
(`install_cuda_planned_allocator`, PyTorch's CUDAPluggableAllocator). `select` is the entry point of
`agent.wrap(..., allocation=...)`. The library is built from source with the system C++ compiler on
first use; importing this package builds nothing and imports no torch.
"""

from agent.allocator.build import AllocatorBuildError
from agent.allocator.core import AllocatorInvariantError, MatchRules, ReplayError
from agent.allocator.cuda import (
    AllocatorSwitchError,
    CudaPlannedAllocator,
    check_can_install,
    install_cuda_planned_allocator,
    installed,
)
from agent.allocator.host import PlannedAllocator
from agent.allocator.select import AllocationMode, AllocatorSelection, select
from agent.allocator.slots import PlanReplayError, ReplayOps, Slots, iteration_ops, plan_slots
from agent.allocator.stats import AllocatorStats, ServedFrom

__all__ = [
    "AllocationMode",
    "AllocatorBuildError",
    "AllocatorInvariantError",
    "AllocatorSelection",
    "AllocatorStats",
    "AllocatorSwitchError",
    "ServedFrom",
    "CudaPlannedAllocator",
    "MatchRules",
    "PlanReplayError",
    "PlannedAllocator",
    "ReplayError",
    "ReplayOps",
    "Slots",
    "check_can_install",
    "install_cuda_planned_allocator",
    "installed",
    "iteration_ops",
    "plan_slots",
    "select",
]
