"""`select(allocation, plan, events, device)`: the allocator choice `agent.wrap(..., allocation=...)` makes.

"caching" (the default) leaves PyTorch's allocator alone. "planned" installs the planned CUDA
allocator on a CUDA device (refusing late switches), and on a device without a pluggable allocator
(CPU) reports that only the runtime's own arena is planned there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from agent.allocator import cuda as cuda_allocator
from agent.allocator.core import MatchRules
from agent.allocator.stats import AllocatorStats
from client.contract import AllocationEvent, AllocationTrace, Plan

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.utils.hooks import RemovableHandle

    from agent.allocator.cuda import CudaPlannedAllocator

AllocationMode = Literal["planned", "caching"]
MODES: tuple[str, ...] = ("planned", "caching")


@dataclass
class AllocatorSelection:
    """What `select` chose: the mode in effect, why, and the installed allocator (planned on CUDA)."""

    requested: AllocationMode
    mode: AllocationMode
    reason: str
    allocator: CudaPlannedAllocator | None = None

    def attach(self, model: nn.Module) -> RemovableHandle | None:
        """Mark iteration boundaries at each training forward of `model` (planned mode only)."""
        return None if self.allocator is None else self.allocator.attach(model)

    def begin_iteration(self) -> None:
        if self.allocator is not None:
            self.allocator.begin_iteration()

    def stats(self) -> AllocatorStats | None:
        return None if self.allocator is None else self.allocator.stats()


def select(
    allocation: str,
    plan: Plan | None = None,
    events: AllocationTrace | Sequence[AllocationEvent] | None = None,
    *,
    device: torch.device | str | int = "cuda",
    debug: bool = False,
    **rules: Any,
) -> AllocatorSelection:
    """Apply the allocation mode; "planned" needs `plan.allocation` and the events it places (`events`, else
    the plan's own `allocation.events`)."""
    if allocation not in MODES:
        raise ValueError(f"allocation: must be one of {', '.join(MODES)}, got {allocation!r}")
    if allocation == "caching":
        return AllocatorSelection("caching", "caching", "PyTorch's caching allocator (the default)")
    if plan is None or plan.allocation is None:
        raise ValueError(
            "plan.allocation: allocation='planned' needs a plan with an allocation section "
            "(solve it from a trace profiled with allocation_trace=True)"
        )
    if events is None:
        events = plan.allocation.events
    if events is None:
        raise ValueError(
            "events: allocation='planned' needs the allocation events the plan places (plan.allocation.events, "
            "carried by plans since issue 19, or the trace's allocation_trace)"
        )
    evs = events.events if isinstance(events, AllocationTrace) else events
    # local import: importing `agent.allocator` loads no torch (its docstring)
    import torch

    dev = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    if dev.type != "cuda":
        return AllocatorSelection(
            "planned",
            "caching",
            f"allocation='planned' replaces PyTorch's CUDA allocator; {dev.type} has no pluggable allocator, "
            "so only the runtime's own buffers use the planned arena there (agent.runtime.arena)",
        )
    index = dev.index if dev.index is not None else 0
    allocator = cuda_allocator.install_cuda_planned_allocator(  # module attribute: tests replace it
        plan.allocation, evs, device=index, debug=debug, rules=MatchRules(**rules)
    )
    allocator.plan_key = plan_key(plan)
    return AllocatorSelection("planned", "planned", f"planned CUDA allocator on cuda:{index}", allocator)


def plan_key(plan: Plan) -> tuple[str, int, int]:
    """What identifies a plan's allocation: the trace it was solved for, its arena and its number of slots."""
    a = plan.allocation
    return (plan.trace_hash, a.arena_bytes if a else 0, len(a.offsets) if a else 0)
