"""Install the planned allocator as PyTorch's CUDA allocator (`CUDAPluggableAllocator`, 4-argument ABI).

PyTorch can swap its CUDA allocator only before the first CUDA allocation and never back, so this is
a one-way, once-per-process switch: `install_cuda_planned_allocator` refuses with `AllocatorSwitchError`
once CUDA is initialised. Written for CUDA machines; the session that wrote it had no GPU, so only the
refusal logic and the host backend of the same core were run (see docs/architecture/allocator.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from agent.allocator.core import MatchRules, PlannedCore
from agent.allocator.library import load_library
from agent.allocator.slots import plan_slots
from agent.allocator.stats import AllocatorStats
from client.contract import AllocationEvent, AllocationPlan

if TYPE_CHECKING:
    from torch import nn
    from torch.utils.hooks import RemovableHandle


class AllocatorSwitchError(RuntimeError):
    """The planned CUDA allocator cannot be installed now (no CUDA, CUDA already initialised, installed twice)."""


def check_can_install(*, cuda_available: bool, cuda_initialized: bool, already_installed: bool) -> None:
    """Raise AllocatorSwitchError with the reason the allocator cannot be swapped in; None when it can."""
    if already_installed:
        raise AllocatorSwitchError(
            "the planned CUDA allocator is already installed in this process; PyTorch cannot swap its "
            "allocator twice, so reuse the handle the first install returned"
        )
    if cuda_initialized:
        raise AllocatorSwitchError(
            "allocation='planned' must be chosen before the first CUDA allocation, and CUDA is already "
            "initialised in this process (torch.cuda.is_initialized() is True): PyTorch cannot unload its "
            "caching allocator once it has been used. Call agent.wrap(..., allocation='planned') or "
            "agent.allocator.install_cuda_planned_allocator(...) at the start of the program, before any "
            "tensor or model is moved to the GPU, or keep allocation='caching'"
        )
    if not cuda_available:
        raise AllocatorSwitchError(
            "the planned CUDA allocator needs a CUDA build of PyTorch and a visible GPU "
            "(torch.cuda.is_available() is False); use allocation='caching'"
        )


class CudaPlannedAllocator:
    """Handle on the installed allocator: iteration boundaries, statistics, the debug check."""

    def __init__(self, core: PlannedCore, pluggable: Any, device: int) -> None:
        self._core = core
        self._pluggable = pluggable  # keeps the library loaded as long as PyTorch may call it
        self.device = device
        self.plan_key: tuple[str, int, int] | None = None  # the plan it replays (`select.plan_key`)

    def begin_iteration(self) -> None:
        """A training iteration starts: replay the plan from its first slot."""
        self._core.begin_iteration()

    def attach(self, model: nn.Module) -> RemovableHandle:
        """Call `begin_iteration` at every training forward of `model` (root module pre-hook)."""
        # local import: importing `agent.allocator` loads no torch (its docstring)
        import torch

        def _pre_hook(module: nn.Module, args: Any) -> None:
            if module.training and torch.is_grad_enabled():
                self._core.begin_iteration()

        # local import: agent.runtime.eager imports torch, which importing `agent.allocator` does not
        from agent.runtime.eager import eager

        return model.register_forward_pre_hook(eager(_pre_hook))

    def stats(self) -> AllocatorStats:
        """Reserved, allocated, peaks, planned hits and fallbacks (torch.cuda.memory_stats is unavailable)."""
        return self._core.stats()

    def reset_peaks(self) -> None:
        self._core.reset_peaks()

    def check(self) -> None:
        """Debug check of every live range and counter (AllocatorInvariantError on a problem)."""
        self._core.check()


_installed: CudaPlannedAllocator | None = None  # process-wide by nature: PyTorch has one CUDA allocator


def install_cuda_planned_allocator(
    plan: AllocationPlan,
    events: Sequence[AllocationEvent],
    *,
    device: int = 0,
    debug: bool = False,
    rules: MatchRules | None = None,
) -> CudaPlannedAllocator:
    """Build (first use) the CUDA library, create the core for `plan`, and make it PyTorch's CUDA allocator."""
    global _installed
    # local import: importing `agent.allocator` loads no torch (its docstring)
    import torch

    check_can_install(
        cuda_available=torch.cuda.is_available(),
        cuda_initialized=torch.cuda.is_initialized(),
        already_installed=_installed is not None,
    )
    slots = plan_slots(plan, events)  # bad plans fail before anything is built or swapped
    lib = load_library("cuda")
    core = PlannedCore(lib, slots, device=device, debug=debug, rules=rules or MatchRules())
    lib.mp_cuda_install(core.handle, device)  # type: ignore[attr-defined]
    pluggable = torch.cuda.memory.CUDAPluggableAllocator(str(lib.path), "mp_cuda_malloc", "mp_cuda_free")
    torch.cuda.memory.change_current_allocator(pluggable)
    _installed = CudaPlannedAllocator(core, pluggable, device)
    return _installed


def installed() -> CudaPlannedAllocator | None:
    """The planned CUDA allocator of this process, if one was installed."""
    return _installed
