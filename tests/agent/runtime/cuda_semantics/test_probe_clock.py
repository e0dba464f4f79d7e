"""The profiler's probes time device work with CUDA events on the streams the work runs on, read after a
synchronisation (issue 19 item 10b), checked on CPU under the stream-ordering checker's stand-in for
`torch.cuda` (a test double: no GPU runs here); on CPU they keep the wall clock.

Under `simulated_cuda` the runtime takes its CUDA code paths (side streams, events), so the probes' clocks
record timing events; the checker notes the stream of each and refuses an `elapsed_time` read before the host
waited for both events (CUDA's `cudaErrorNotReady`).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from agent.profiler import device_clock
from agent.profiler.device_clock import DeviceClock, Mark, SectionSpans
from agent.profiler.parameters import OrderedParameter
from agent.profiler.persistent_probe import probe_persistent
from agent.profiler.runtime_probe import probe_block
from agent.runtime.timing import EVICT, FLUSH, SWAP_IN, SWAP_OUT, SWAP_PREFETCH, UPLOAD
from agent.testing.model_zoo import build
from tests.agent.runtime.cuda_semantics.checker import SimulatedCuda, StreamOrderError, simulated_cuda

pytestmark = pytest.mark.cuda_semantics

COMPUTE = "compute (default stream)"
CPU = torch.device("cpu")


def llama_block() -> tuple[torch.nn.Module, torch.nn.Module, tuple[Any, ...], dict[str, Any]]:
    """A Hugging Face Llama (random weights) and its first decoder layer with the inputs it was called with."""
    model, _ = build("llama", layers=2, hidden=64, vocab=128, seq=16, seed=0)
    block = model.model.layers[0]
    seen: dict[str, Any] = {}

    def capture(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        seen["args"] = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
        seen["kwargs"] = kwargs

    handle = block.register_forward_pre_hook(capture, with_kwargs=True)
    with torch.no_grad():
        model(torch.randint(0, 128, (2, 16)))
    handle.remove()
    return model, block, seen["args"], seen["kwargs"]


class SpanLog:
    """Every section span any probe's `SectionSpans` keeps (the probes' own collectors, observed)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.spans: list[tuple[str, Mark, Mark]] = []
        original = SectionSpans.__call__

        def observe(spans: SectionSpans, name: str, start: Mark, end: Mark, depth: int) -> None:
            before = len(spans.spans)
            original(spans, name, start, end, depth)
            if len(spans.spans) > before:
                self.spans.append((name, start, end))

        monkeypatch.setattr(device_clock.SectionSpans, "__call__", observe)

    def kernels_in(self, sim: SimulatedCuda, names: set[str], stream: str) -> int:
        """Kernels that ran on `stream` between the two marks of the kept spans called one of `names`."""
        total = 0
        for name, start, end in self.spans:
            if name not in names:
                continue
            pairs = [
                (s, e) for s, e in zip(start.events, end.events, strict=True) if sim.stream_name(s) == stream
            ]
            assert len(pairs) == 1, f"{name}: no event on the {stream}"
            total += pairs[0][1].kernels - pairs[0][0].kernels
        return total


def test_the_checker_refuses_elapsed_time_before_a_synchronisation() -> None:
    with simulated_cuda(runtime=False) as sim:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(side)
        with torch.cuda.stream(side):
            x = torch.ones(4096) * 2  # a kernel on the side stream
        end.record(side)
        with pytest.raises(StreamOrderError, match="before the host waited"):
            start.elapsed_time(end)
        torch.cuda.synchronize()
        assert start.elapsed_time(end) >= 0.0
        untimed = torch.cuda.Event()
        untimed.record(side)
        torch.cuda.synchronize()
        with pytest.raises(StreamOrderError, match="enable_timing"):
            start.elapsed_time(untimed)
    assert len(sim.violations) == 2
    del x


def test_a_device_clock_is_read_only_after_the_window_is_synchronised() -> None:
    with simulated_cuda(runtime=False) as sim:
        side = torch.cuda.Stream()
        clock = DeviceClock.with_side_streams(CPU, [side], cuda=True)
        a = clock.mark()
        torch.ones(1024).mul_(3)
        b = clock.mark()
        assert [sim.stream_name(e) for e in a.events] == [COMPUTE, "side stream 1"]
        with pytest.raises(RuntimeError, match="before the device was synchronised"):
            clock.seconds(a, b)
        clock.synchronize()
        assert clock.seconds(a, b) >= 0.0 and len(clock.spans(a, b)) == 2
    sim.check()


def test_runtime_probe_times_the_block_and_the_runtime_with_events_on_their_streams(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    log = SpanLog(monkeypatch)
    model, block, args, kwargs = llama_block()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with simulated_cuda("caching") as sim:
        probe = probe_block(block, args, kwargs, CPU, index=1, optimizer=opt)
        streams = {sim.stream_name(e) for e in sim.timing_events}
    assert probe is not None
    # the block runs on compute; swap copies on the swap store's streams; the chunk's moves on the runtime's
    assert {COMPUTE, "swap-out stream", "swap-in stream", "upload stream", "offload stream"} <= streams
    # each copy section is marked on the stream its copy runs on, around the copy: every kernel of the swap
    # store's and the runtime's copy streams ran between the marks of a section that issued it
    for names, stream in (
        ({SWAP_OUT}, "swap-out stream"),
        ({SWAP_IN, SWAP_PREFETCH}, "swap-in stream"),
        ({UPLOAD}, "upload stream"),
        ({EVICT}, "offload stream"),  # a release's gradient flush runs inside it
    ):
        assert log.kernels_in(sim, names, stream) == sim.kernels_on(stream) > 0, stream
    assert log.kernels_in(sim, {FLUSH}, "offload stream") > 0
    # every event read came after a synchronisation (a read before one raises and is a violation), and the
    # runtime's own copies kept their stream order
    sim.check()
    assert probe.plain_s > 0 and probe.swap_out_s > 0 and probe.swap_in_s > 0
    assert probe.offload_s > 0 and probe.upload_s > 0
    # the offloaded block's cost outside the runtime's hooks is a CPU (wall-clock) figure: on CUDA a kernel
    # waiting on an upload would charge the copy twice, so it is not measured there
    assert probe.offload_outside_s == 0.0


def test_persistent_probe_times_the_runtime_path_with_events(monkeypatch: pytest.MonkeyPatch) -> None:
    log = SpanLog(monkeypatch)
    model, _ = build("llama", layers=2, hidden=32, vocab=64, seq=16, seed=0)
    named = list(model.named_parameters())
    ordered = [
        OrderedParameter(param=p, name=n, module_path=n.rsplit(".", 1)[0], block=i // 4, aliases=(n,))
        for i, (n, p) in enumerate(named)
    ]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with simulated_cuda("caching") as sim:
        probe = probe_persistent(model, ordered, opt, CPU)
    assert probe is not None and probe.step_s > 0 and probe.grad_hooks_s > 0
    assert log.spans and all(len(s.events) == 3 for _, s, _ in log.spans)  # compute, upload, offload
    sim.check()


def test_on_cpu_the_clock_is_the_wall_clock_around_each_section() -> None:
    # no events, nothing to synchronise; a section's marks bracket the wall time the plain listener gets
    from agent.runtime.timing import RuntimeTiming

    timing = RuntimeTiming()
    clock = DeviceClock(CPU)
    spans = SectionSpans(clock)
    wall: list[float] = []
    timing.add_listener(lambda name, seconds, depth: wall.append(seconds))
    timing.add_marks(clock, spans)
    timing.run("upload", torch.mm, torch.ones(64, 64), torch.ones(64, 64))
    (_, start, end), seconds = spans.spans[0], wall[0]
    assert start.events == () and end.events == ()
    assert clock.seconds(start, end) == end.host_s - start.host_s >= seconds > 0


def test_a_window_runs_from_the_latest_start_to_the_latest_end_across_its_streams() -> None:
    # mid-iteration a copy stream's start event completes when its backlog is done, the compute stream's when
    # compute reaches the mark: the section's work runs from the later of the two to the last end
    with simulated_cuda(runtime=False) as sim:
        side = torch.cuda.Stream()
        clock = DeviceClock.with_side_streams(CPU, [side], cuda=True)
        start, end = clock.mark(), clock.mark()
        clock.synchronize()
        (s_compute, s_side), (e_compute, e_side) = start.events, end.events
        s_compute.at, s_side.at, e_compute.at, e_side.at = 0.000, 0.005, 0.006, 0.009  # seconds
        assert clock.seconds(start, end) == pytest.approx(0.004)  # 9 ms - 5 ms
        assert clock.spans(start, end) == pytest.approx((0.006, 0.004))
    sim.check()


def test_the_copy_probe_times_each_direction_on_its_own_stream_both_at_once() -> None:
    from agent.profiler.hardware import _time_duplex

    with simulated_cuda(runtime=False) as sim:
        dev_dst, dev_src = torch.empty(1 << 20, dtype=torch.uint8), torch.ones(1 << 20, dtype=torch.uint8)
        host_src = sim.mark_host(torch.full((1 << 20,), 2, dtype=torch.uint8), pinned=True)
        host_dst = sim.mark_host(torch.empty(1 << 20, dtype=torch.uint8), pinned=True)
        dev_src.add_(1)  # a kernel on the compute stream writes it before the copies read it
        up, down = _time_duplex(dev_dst, host_src, host_dst, dev_src, reps=3, cuda=True)
        events = list(sim.timing_events)
        torch.cuda.synchronize()
        assert torch.equal(dev_dst, host_src) and torch.equal(host_dst, dev_src)
    assert up > 0 and down > 0
    # marks on two side streams only (one per direction), 4 pairs of marks (warm-up + 3), one copy each between
    assert {sim.stream_name(e) for e in events} == {"side stream 1", "side stream 2"}
    assert len(events) == 4 * 2 * 2
    for i in range(0, len(events), 4):
        s_up, s_down, e_up, e_down = events[i : i + 4]
        assert e_up.kernels - s_up.kernels == 1 and e_down.kernels - s_down.kernels == 1
    sim.check()  # both copies ordered after the write they read; every read of an event after a synchronise
