"""The managed iteration recorded from the job's own metered step (issue 16), placed and sent in the background.

The feedback monitor (`agent.feedback.StepMonitor`) already runs one real training step of the wrapped job
under its device-memory meter. That step *is* the managed iteration: the plan's runtime, activation modes
and optimizer, on the job's device. `ManagedStepRecorder` turns that step's allocations into the plan's
allocation events, with no copy of the model and no extra iteration:

* CPU: the meter's own storage tracker (`agent.measure.DevicePeakMeter`) registers the long-lived state as
  `record_managed_trace` does, so its records are the events (source "dispatch_tracker");
* CUDA on PyTorch's caching allocator: `torch.cuda.memory._record_memory_history` is on for the step
  (`agent.profiler.cuda_history.CudaAllocatorHistory`), and the snapshot's `device_traces` become records
  after the long-lived state (`state_records` of `agent.measure.device_state_tensors`), with the
  gradients found by address (source "cuda_caching_allocator").

When the monitor sends its feedback (after the timed steps, so the placement's CPU time is in none of
them), a background thread runs `agent.allocator.publish.place_and_publish` (the same function the CPU copy
at `wrap` uses): it places the events with the service's planner and validator and sends them with
`PUT /v1/plans/{id}/allocation`; `on_placed` hands the placed plan back to `Wrapped`. No feedback sent (the
job stopped before `feedback_steps`), nothing placed or sent. Nothing here raises
into the training loop: every failure (history unavailable, its ring buffer full, an invalid trace, the
service down) is one warning, and the plan keeps the placement of the profiled iteration.

The CUDA lines (`_start_history`, `_cuda_events`) need a GPU and were NOT run where this was written (no
GPU); the conversion they call is tested on CPU with snapshots in torch's documented layout, and the rest
(the hand-off, the background placement and the PUT) runs in the CPU tests.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from agent.allocator.publish import place_and_publish
from agent.measure import device_state_tensors
from agent.profiler.allocation_trace import build_allocation_trace
from agent.profiler.cuda_history import CudaAllocatorHistory, history_records, state_records
from client.contract import AllocationCategory, AllocationTrace

if TYPE_CHECKING:
    from torch import nn

    from agent.planning import PlanSource
    from agent.profiler.storage_tracker import StorageTracker
    from agent.runtime.manager import ModelStateManager

log = logging.getLogger(__name__)

HISTORY_MAX_ENTRIES = 2_000_000
"""Ring-buffer size of the CUDA memory history for the step; a step that fills it is not sent (incomplete)."""


class ManagedStepError(RuntimeError):
    """The metered step's allocations cannot be the managed iteration's events (message says why)."""


def cuda_history_wanted(device: torch.device) -> bool:
    """Whether the step is recorded from the CUDA caching allocator's history: the job's device is CUDA
    and this process has a GPU."""
    return device.type == "cuda" and torch.cuda.is_available()


class ManagedStepRecorder:
    """Records the metered step as the managed iteration and places and sends it off the training thread."""

    def __init__(
        self,
        model: nn.Module,
        manager: ModelStateManager | None,
        device: torch.device,
        source: PlanSource,
        on_placed: Callable[[PlanSource], None],
    ) -> None:
        self.model = model
        self.manager = manager
        self.device = device
        self.source = source
        self.on_placed = on_placed
        self.events: AllocationTrace | None = None  # the metered step's, once it finished
        self.placed: PlanSource | None = None
        self.failure: str | None = None  # why no managed allocation came of the step
        self._history: CudaAllocatorHistory | None = None
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ the monitor's calls
    def start(self) -> None:
        """At the metered step's first forward (CUDA: turn the allocator's history on)."""
        if not cuda_history_wanted(self.device):
            return  # CPU: the meter's storage tracker records the step
        try:
            self._history = self._start_history()
        except Exception as exc:  # noqa: BLE001 - the training job must not fail for this
            self._fail(exc)

    def finish(self, window: StorageTracker | None) -> None:
        """After the metered step's optimizer step (an untimed step): its events.
        `window`: the meter's storage tracker of the step (CPU), None on CUDA."""
        if self.failure is not None:
            return
        try:
            self.events = self._events(window)
        except Exception as exc:  # noqa: BLE001 - the training job must not fail for this
            self._fail(exc)

    def publish(self) -> None:
        """The feedback went out: place the events and send them, on a background thread (once)."""
        if self.events is None or self._thread is not None:
            return
        self._thread = threading.Thread(
            target=self._place, args=(self.events,), name="memplan-managed-allocation", daemon=True
        )
        self._thread.start()

    def abort(self) -> None:
        """The metered step did not finish (the monitor closed): turn the history off, send nothing."""
        history, self._history = self._history, None
        if history is not None:
            history.__exit__(RuntimeError, None, None)  # recording off, no snapshot
        if self.failure is None:
            self.failure = "the metered step did not finish"

    @property
    def sending(self) -> bool:
        """The placement and PUT were started (after the feedback went out)."""
        return self._thread is not None

    @property
    def running(self) -> bool:
        """The placement and PUT are in flight."""
        return self._thread is not None and self._thread.is_alive()

    def wait(self, timeout_s: float) -> None:
        """Wait (at most `timeout_s`) for the placement and PUT in flight."""
        if self._thread is not None:
            self._thread.join(timeout_s)

    # ------------------------------------------------------------------ the step's events
    def _events(self, window: StorageTracker | None) -> AllocationTrace:
        if self._history is not None:
            return self._cuda_events()
        if window is None:
            raise ManagedStepError(f"no recording of the metered step on {self.device}")
        grad_sids = {
            rec.sid
            for p in self.model.parameters()
            if p.grad is not None
            for rec in [window.record_of(p.grad)]
            if rec is not None
        }
        return build_allocation_trace(
            window.records, window.n_events, grad_sids=grad_sids, grad_blocks={}, source="dispatch_tracker"
        )

    def _start_history(self) -> CudaAllocatorHistory:  # CUDA only: not run without a GPU
        history = CudaAllocatorHistory(self.device, max_entries=HISTORY_MAX_ENTRIES)
        history.__enter__()
        return history

    def _cuda_events(self) -> AllocationTrace:  # CUDA only: not run without a GPU
        history, self._history = self._history, None
        assert history is not None
        history.__exit__(None, None, None)  # the snapshot, and recording off
        return managed_events_from_history(
            history.entries,
            [(t, cat, None) for t, cat in device_state_tensors(self.model, self.manager)],
            {
                p.grad.untyped_storage().data_ptr(): None
                for p in self.model.parameters()
                if p.grad is not None and p.grad.device.type == "cuda"
            },
            max_entries=history.max_entries,
        )

    # ------------------------------------------------------------------ background
    def _place(self, events: AllocationTrace) -> None:
        try:
            placed = place_and_publish(self.source, events)
        except Exception as exc:  # noqa: BLE001 - a background extra: warn, never raise
            self._fail(exc)
            return
        self.placed = placed
        self.on_placed(placed)
        log.info("memplan: the plan's allocation is now that of its managed iteration (the metered step)")

    def _fail(self, exc: BaseException) -> None:
        self.failure = f"{type(exc).__name__}: {exc}"
        log.warning(
            "memplan: the managed iteration was not recorded from the metered step (%s); the plan keeps the "
            "allocation of the profiled iteration",
            self.failure,
        )


def managed_events_from_history(
    entries: Sequence[Mapping[str, Any]],
    state: Iterable[tuple[torch.Tensor, AllocationCategory, int | None]],
    grad_addrs: Mapping[int, int | None],
    *,
    max_entries: int,
) -> AllocationTrace:
    """The managed iteration's events from the CUDA memory history of one step (`snapshot_trace`'s entries):
    the long-lived `state` first, then the step's allocations, gradients found at `grad_addrs`. Raises
    ManagedStepError when the history's ring buffer filled (its oldest entries were overwritten)."""
    if len(entries) >= max_entries:
        raise ManagedStepError(
            f"the CUDA memory history filled its {max_entries} entries during the step: its first "
            "allocations were overwritten"
        )
    records, n_events, grad_sids, grad_blocks = history_records(state_records(state), entries, grad_addrs)
    return build_allocation_trace(
        records, n_events, grad_sids=grad_sids, grad_blocks=grad_blocks, source="cuda_caching_allocator"
    )
