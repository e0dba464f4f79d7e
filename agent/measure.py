"""Peak device memory of one managed training iteration, measured with the profiler's semantics.

CPU: the profiler's `StorageTracker` (a TorchDispatchMode counting tensor storages) over one iteration,
with the same registration rules as the profiler's tracked iteration: long-lived device state (here: the
runtime's persistent chunks, their gradients, fp32 masters and optimizer state, the device buffers of
offloaded chunks, the model's buffers) is registered up front, the batch is external (not counted), and
everything the iteration allocates is counted while it lives. Host memory is not device memory: the
runtime's host copies (offloaded chunks) are allocated before the window and not registered, and swap
buffers are allocated with dispatch modes switched off (see `runtime/swap.py`), the host worker's inline
work (CPU device) runs with them off (`runtime/host_worker.py`), and a collective writing into a host tensor
(gradient averaging, a sharded chunk's reduce-scatter and all-gathers) is not an allocation (the tracker
skips outputs on the op's own arguments' storages). So the figure compares with the trace's
`peak_device_bytes` and with the plan's `predictions.peak_device_bytes`.

CUDA: the peak allocated bytes over the iteration (what the profiler reports on CUDA); it counts every
tensor on the device, so it needs no registration. Read through `agent.allocator.device_memory`: PyTorch's
`max_memory_allocated` under its caching allocator, the planned allocator's own statistics when
`allocation="planned"` installed it (PyTorch's pluggable allocator refuses peak statistics). Written for
CUDA, not run here (no GPU in the session that wrote it); the selection is tested on CPU against the C++
core driven through the fake CUDA runtime.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from agent.allocator import device_memory
from agent.profiler.storage_tracker import StorageTracker
from agent.profiler.tensors import iter_tensors
from client.contract import AllocationCategory

if TYPE_CHECKING:
    from agent.runtime.manager import ModelStateManager


def device_state_tensors(
    model: nn.Module, manager: ModelStateManager | None
) -> list[tuple[torch.Tensor, AllocationCategory]]:
    """Long-lived tensors that sit in device memory while the plan runs (what the profiler registers)."""
    out: list[tuple[torch.Tensor, AllocationCategory]] = []
    if manager is None:
        out += [(p, AllocationCategory.param) for p in model.parameters()]
        out += [(p.grad, AllocationCategory.grad) for p in model.parameters() if p.grad is not None]
    else:
        for st in manager.states:
            if st.offloaded:
                continue
            # a device-sharded chunk (`runtime/device_shards.py`): its own compute shard too; its whole copy
            # (`params`) is registered at its size now (0 bytes while released): the tracker does not see a
            # storage resized in place, so the gathered copies are not counted (the runtime counts them:
            # `DeviceShards.max_gathered_bytes`)
            out += [(t, AllocationCategory.param) for t in (st.params, st.master, st.own) if t is not None]
            if st.grad is not None:
                out.append((st.grad, AllocationCategory.grad))
            stepper = manager.steppers[st.index] if manager.steppers else None
            if stepper is not None and stepper.inner is not None:
                for s in stepper.inner.state.values():
                    out += [
                        (v, AllocationCategory.optimizer)
                        for v in s.values()
                        if isinstance(v, torch.Tensor) and v.dim() > 0
                    ]
        if manager.pool is not None:
            for slot in manager.pool.slots:
                out += [(slot.params, AllocationCategory.param), (slot.grad, AllocationCategory.grad)]
    out += [(b, AllocationCategory.param) for b in model.buffers()]
    return out


class DevicePeakMeter:
    """Measures the peak device bytes of a window (one iteration): `start(...)`, run, `stop() -> bytes`."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._tracker: StorageTracker | None = None
        self.window: StorageTracker | None = (
            None  # the last window's tracker (CPU): its records are the step's
        )

    @property
    def running(self) -> bool:
        return self._tracker is not None or (self.device.type == "cuda" and self._cuda_running)

    _cuda_running = False

    def start(self, state: Iterable[tuple[torch.Tensor, AllocationCategory]], external: Any) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            device_memory.reset_peak(self.device)
            self._cuda_running = True
            return
        tracker = StorageTracker()
        for t, cat in state:
            tracker.register_existing(t, cat, None)
        for t in iter_tensors(external):
            tracker.register_external(t)
        tracker.__enter__()
        self._tracker = tracker

    def stop(self) -> int:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self._cuda_running = False
            return device_memory.peak_allocated(self.device)
        tracker = self._tracker
        assert tracker is not None, "stop() without start()"
        self._tracker = None
        tracker.__exit__(None, None, None)
        self.window = tracker
        return int(tracker.peak_bytes)
