"""The managed iteration from the job's own metered step (issue 16): a memory-history snapshot -> the plan's events.

No GPU here, so the CUDA snapshot is (a) written out in `torch.cuda.memory._snapshot()`'s documented layout
(`Snapshot` / `Segment` / `Block` / `TraceEntry` in the installed torch's `torch/cuda/memory.py`), and (b)
made by torch itself from a real CPU training step: `torch.cuda._memory_viz._profile_to_snapshot` turns a
`torch.profiler` memory profile into that same layout (what `_memory_viz profile_plot` draws). The
conversion, placement and sending are the code the CUDA path runs; only turning the history on and taking
the snapshot (`ManagedStepRecorder._start_history` / `_cuda_events`) need a GPU.
"""

from __future__ import annotations

import collections
import logging
from typing import Any

import pytest
import torch
from torch.cuda._memory_viz import _profile_to_snapshot

from agent.allocator.managed_step import ManagedStepError, ManagedStepRecorder, managed_events_from_history
from agent.allocator.publish import place_and_publish
from agent.feedback import StepMonitor
from agent.measure import DevicePeakMeter, device_state_tensors
from agent.planning import PlanSource
from agent.profiler.allocation_trace import build_allocation_trace
from agent.profiler.cuda_history import snapshot_trace
from agent.runtime import manual_plan
from client.contract import AllocationCategory, AllocationEvent
from planner_service.solver.allocation import validate_allocation

GRAD_ADDR = 0x7F00_0020_0000


def _frames(name: str) -> list[dict[str, Any]]:
    return [{"filename": "train.py", "line": 12, "name": name}]


def _entry(action: str, addr: int, size: int, name: str = "forward") -> dict[str, Any]:
    return {
        "action": action,
        "addr": addr,
        "size": size,
        "stream": 0,
        "frames": _frames(name),
        "pool_id": (0, 0),
    }


def _snapshot() -> dict[str, Any]:
    """Two devices' histories (the job runs on device 1), segments and blocks as `_snapshot()` returns them."""
    seg = 0x7F00_0000_0000
    return {
        "segments": [
            {
                "device": 1,
                "address": seg,
                "total_size": 4 << 20,
                "stream": 0,
                "segment_type": "large",
                "segment_pool_id": (0, 0),
                "allocated_size": 4096,
                "active_size": 4096,
                "blocks": [
                    {
                        "size": 4096,
                        "requested_size": 4096,
                        "address": GRAD_ADDR,
                        "state": "active_allocated",
                        "frames": _frames("backward"),
                    },
                    {
                        "size": (4 << 20) - 4096,
                        "requested_size": 0,
                        "address": GRAD_ADDR + 4096,
                        "state": "inactive",
                        "frames": [],
                    },
                ],
            }
        ],
        "device_traces": [
            [_entry("alloc", 0x10, 999)],  # device 0: another job's device, not ours
            [
                _entry("segment_alloc", seg, 4 << 20),  # cudaMalloc of a segment: not a tensor
                _entry("alloc", seg, 2048),  # 0: activation of the forward
                _entry("alloc", seg + 2048, 1000),  # 1: a temporary (requested size, not the 512-rounded)
                _entry("free_requested", seg + 2048, 1000),
                _entry("free_completed", seg + 2048, 1000),  # 1 freed at event 2
                _entry("free_completed", 0x7F00_9000_0000, 8192, "zero_grad"),  # allocated before the step
                {"action": "snapshot", "addr": 0, "size": 0, "stream": 0, "frames": []},
                {"action": "oom", "size": 1 << 40, "stream": 0, "device_free": 1 << 20, "frames": []},
                _entry("alloc", GRAD_ADDR, 4096, "backward"),  # 3: the parameter's gradient
                _entry("free_requested", seg, 2048, "backward"),
                _entry("free_completed", seg, 2048, "backward"),  # 0 freed at event 4
                _entry("alloc", seg, 512, "step"),  # 5: address reused by a new tensor, alive at the end
                _entry("segment_free", seg + (2 << 20), 2 << 20, "empty_cache"),
            ],
        ],
    }


def test_a_memory_history_snapshot_becomes_the_managed_iterations_events() -> None:
    param, exp_avg = torch.zeros(1024), torch.zeros(2048)  # the long-lived state (4 KiB, 8 KiB)
    entries = snapshot_trace(_snapshot(), 1)
    assert len(entries) == 13 and snapshot_trace(_snapshot(), 2) == []

    trace = managed_events_from_history(
        entries,
        [(param, AllocationCategory.param, None), (exp_avg, AllocationCategory.optimizer, None)],
        {GRAD_ADDR: None},
        max_entries=1000,
    )

    assert trace.source == "cuda_caching_allocator"

    def ev(id: int, size: int, alloc: int, free: int | None, category: str) -> AllocationEvent:
        return AllocationEvent(
            id=id, size_bytes=size, alloc_index=alloc, free_index=free, category=category, phase="forward"
        )

    assert trace.events == [
        ev(0, 4096, 0, None, "param"),
        ev(1, 8192, 1, None, "optimizer"),
        ev(2, 2048, 2, 6, "temp"),
        ev(3, 1000, 3, 4, "temp"),
        ev(4, 4096, 5, None, "grad"),  # found by its address: long-lived, never freed in the window
        ev(5, 512, 7, 8, "temp"),  # alive when the window closed: freed at the horizon
    ]
    assert trace.horizon == 8


def test_a_history_whose_ring_buffer_filled_is_refused() -> None:
    """The allocator keeps the last `max_entries` entries: a full buffer lost the step's first allocations."""
    entries = snapshot_trace(_snapshot(), 1)
    with pytest.raises(ManagedStepError, match="filled its 13 entries"):
        managed_events_from_history(entries, [], {}, max_entries=len(entries))


def _peak(events: list[AllocationEvent]) -> int:
    delta: collections.Counter[int] = collections.Counter()
    for e in events:
        delta[e.alloc_index] += e.size_bytes
        if e.free_index is not None:
            delta[e.free_index] -= e.size_bytes
    live = peak = 0
    for k in sorted(delta):
        live += delta[k]
        peak = max(peak, live)
    return peak


def test_torchs_own_snapshot_of_a_training_step_gives_the_storage_trackers_iteration() -> None:
    """A snapshot torch made of a real step (CPU, through its memory profiler) converts to the iteration the
    CPU path records with the storage tracker: same live-bytes peak, same gradients, same model state."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 128), torch.nn.LayerNorm(128)
    )
    x = torch.randn(16, 64)

    def step() -> None:
        loss = model(x).square().mean()
        loss.backward()
        del loss

    for _ in range(2):
        step()
        model.zero_grad()
    state = device_state_tensors(model, None)
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU],
        profile_memory=True,
        record_shapes=True,
        with_stack=True,
    ) as prof:
        step()
    snapshot = _profile_to_snapshot(prof)
    assert set(snapshot) == {"segments", "device_traces"}
    from_history = managed_events_from_history(
        snapshot_trace(snapshot, 0),  # no GPU: the CPU's history is device_traces[device_count()]
        [(t, c, None) for t, c in state],
        {p.grad.untyped_storage().data_ptr(): None for p in model.parameters() if p.grad is not None},
        max_entries=1 << 20,
    ).events

    model.zero_grad()
    meter = DevicePeakMeter(torch.device("cpu"))
    meter.start(state, x)
    step()
    tracked_peak = meter.stop()
    window = meter.window
    assert window is not None
    grads = {r.sid for p in model.parameters() if p.grad is not None for r in [window.record_of(p.grad)] if r}
    tracked = build_allocation_trace(
        window.records, window.n_events, grad_sids=grads, grad_blocks={}, source="dispatch_tracker"
    ).events

    assert _peak(from_history) == _peak(tracked) == tracked_peak
    for category in ("param", "grad"):
        assert sorted(e.size_bytes for e in from_history if e.category.value == category) == sorted(
            e.size_bytes for e in tracked if e.category.value == category
        )
    assert sum(e.category.value == "grad" for e in from_history) == len(list(model.parameters()))
    # the profiler's history also lists a few scalars the tracker does not see; every tracked buffer is in it
    missing = collections.Counter(e.size_bytes for e in tracked) - collections.Counter(
        e.size_bytes for e in from_history
    )
    assert not missing


def test_events_from_a_snapshot_take_the_shared_placement_path() -> None:
    """`place_and_publish` (the path of every managed recording) places the CUDA step's events, validated."""
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 32))
    source = PlanSource(
        manual_plan(model, chunk_size_bytes=1 << 16), "embedded", message="test"
    )  # no service: placed, not sent
    trace = managed_events_from_history(
        snapshot_trace(_snapshot(), 1),
        [(p, AllocationCategory.param, None) for p in model.parameters()],
        {GRAD_ADDR: None},
        max_entries=1000,
    )
    placed = place_and_publish(source, trace)
    a = placed.plan.allocation
    assert a is not None and a.iteration == "managed" and a.events == trace
    validate_allocation(trace, a)
    assert placed.plan.policy == source.plan.policy


def test_a_recording_that_fails_is_a_warning_and_never_reaches_the_training_loop(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A CUDA job where no history could be recorded (here: no GPU, so no history was started)."""
    model = torch.nn.Linear(8, 8)
    placed: list[PlanSource] = []
    recorder = ManagedStepRecorder(
        model,
        None,
        torch.device("cuda", 0),
        PlanSource(manual_plan(model, chunk_size_bytes=1 << 16), "embedded", message="test"),
        on_placed=placed.append,
    )
    with caplog.at_level(logging.WARNING, logger="agent.allocator.managed_step"):
        recorder.start()
        recorder.finish(None)
        recorder.publish()
        recorder.wait(5.0)
    assert recorder.failure is not None and "no recording of the metered step on cuda:0" in recorder.failure
    assert not placed and "keeps the allocation of the profiled iteration" in caplog.text
    assert not torch.cuda.is_initialized()


def _monitored() -> tuple[torch.nn.Module, torch.optim.Optimizer, ManagedStepRecorder, list[PlanSource]]:
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    placed: list[PlanSource] = []
    recorder = ManagedStepRecorder(
        model,
        None,
        torch.device("cpu"),
        PlanSource(manual_plan(model, chunk_size_bytes=1 << 16), "embedded", message="test"),
        on_placed=placed.append,
    )
    return model, torch.optim.SGD(model.parameters(), lr=0.1), recorder, placed


def test_the_monitor_records_its_metered_step_and_sends_it_with_the_feedback() -> None:
    model, opt, recorder, placed = _monitored()
    monitor = StepMonitor(
        model, opt, torch.device("cpu"), manager=None, activations=None, sink=None, steps=4, recorder=recorder
    )
    x = torch.randn(8, 16)
    try:
        for step in range(4):
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
            if step < monitor.meter_step:
                assert recorder.events is None
            elif step < 3:
                assert recorder.events is not None and not recorder.sending  # no placement in timed steps
        monitor.wait_sent(60.0)
        assert monitor.measured.sent is not None and recorder.failure is None
        assert len(placed) == 1 and recorder.placed is placed[0]
        a = placed[0].plan.allocation
        assert a is not None and a.iteration == "managed" and a.events == recorder.events
        validate_allocation(a.events, a)
        grads = [e for e in a.events.events if e.category.value == "grad"]
        assert sorted(e.size_bytes for e in grads) == sorted(p.numel() * 4 for p in model.parameters())
    finally:
        monitor.close()


def test_a_monitor_closed_during_the_metered_step_sends_nothing() -> None:
    model, opt, recorder, placed = _monitored()
    monitor = StepMonitor(
        model, opt, torch.device("cpu"), manager=None, activations=None, sink=None, steps=4, recorder=recorder
    )
    x = torch.randn(8, 16)
    for _ in range(monitor.meter_step):
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
    model(x).sum().backward()  # the metered step's forward and backward, and no optimizer step
    monitor.close()
    assert recorder.failure == "the metered step did not finish" and recorder.events is None
    recorder.publish()
    assert not recorder.sending and not placed
