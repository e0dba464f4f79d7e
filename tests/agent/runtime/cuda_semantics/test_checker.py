"""The stream-ordering checker itself: it catches a missing wait and accepts a correct one.

Each test writes the small CUDA program it checks with the real torch.cuda names (patched by
`simulated_cuda` to the checker's test doubles; no GPU runs here).
"""

from __future__ import annotations

import gc

import pytest
import torch

from tests.agent.runtime.cuda_semantics.checker import StreamOrderError, simulated_cuda

pytestmark = pytest.mark.cuda_semantics


def test_a_side_stream_reading_what_compute_wrote_without_a_wait_is_caught_with_both_stacks() -> None:
    with simulated_cuda(runtime=False) as sim:
        side = torch.cuda.Stream()
        x = torch.ones(1024)  # written by a kernel on the compute stream
        with torch.cuda.stream(side):
            y = x * 2  # reads x on the side stream: nothing orders it after the write
    assert len(sim.violations) == 1
    v = sim.violations[0]
    assert "side stream" in v.message and "reads" in v.message and "compute" in v.message
    assert "test_checker.py" in v.this_stack and "test_checker.py" in v.other_stack
    assert "x * 2" not in v.other_stack  # two different places
    with pytest.raises(StreamOrderError, match="1 stream-order violation"):
        sim.check()
    del y


def test_wait_stream_and_wait_event_order_the_access() -> None:
    with simulated_cuda(runtime=False) as sim:
        side = torch.cuda.Stream()
        x = torch.ones(1024)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            y = x * 2
        done = torch.cuda.Event()
        done.record(side)
        torch.cuda.current_stream().wait_event(done)
        x.add_(y)  # compute writes x after the side stream's read: ordered by the event
    sim.check()


def test_an_event_recorded_before_the_write_does_not_order_it() -> None:
    with simulated_cuda(runtime=False) as sim:
        side = torch.cuda.Stream()
        x = torch.zeros(256)
        too_early = torch.cuda.current_stream().record_event()
        x.fill_(3.0)
        side.wait_event(too_early)
        with torch.cuda.stream(side):
            _ = x.sum()
    assert len(sim.violations) == 1 and "reads" in sim.violations[0].message


def test_a_write_after_a_read_on_another_stream_needs_a_wait_too() -> None:
    with simulated_cuda(runtime=False) as sim:
        side = torch.cuda.Stream()
        x = torch.ones(256)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            _ = x.sum()  # side reads
        x.zero_()  # compute overwrites while the read may still run
    assert len(sim.violations) == 1 and "writes" in sim.violations[0].message


def test_the_host_reading_a_pinned_buffer_needs_the_copy_event_synchronised() -> None:
    for synchronise in (False, True):
        with simulated_cuda(runtime=False) as sim:
            side = torch.cuda.Stream()
            x = torch.ones(256)
            host = sim.mark_host(torch.empty(256), pinned=True)
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                host.copy_(x, non_blocking=True)  # D2H on the side stream, the host does not wait
                copied = side.record_event()
            if synchronise:
                copied.synchronize()
            _ = host.sum()  # a host op on the pinned buffer
        assert len(sim.violations) == (0 if synchronise else 1), [str(v) for v in sim.violations]


def test_a_blocking_copy_to_pageable_host_memory_orders_the_host_after_it() -> None:
    with simulated_cuda(runtime=False) as sim:
        x = torch.ones(256)
        host = sim.mark_host(torch.empty(256), pinned=False)
        host.copy_(x, non_blocking=True)  # pageable memory: CUDA copies synchronously anyway
        host.mul_(2)
    sim.check()


def test_a_freed_buffer_whose_copy_may_still_read_it_is_caught_unless_record_stream_covers_it() -> None:
    """The caching allocator honours record_stream; the planned (pluggable) allocator ignores it."""
    results = {}
    for allocator, record in (("caching", False), ("caching", True), ("planned", True)):
        with simulated_cuda(allocator, runtime=False) as sim:  # type: ignore[arg-type]
            side = torch.cuda.Stream()
            host = sim.mark_host(torch.empty(4096), pinned=True)
            x = torch.ones(4096) * 3  # allocated on the compute stream
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                host.copy_(x, non_blocking=True)  # the side stream reads x
            if record:
                x.record_stream(side)
            del x  # freed on compute while the copy may still read it
            gc.collect()
        results[(allocator, record)] = [v.message for v in sim.violations]
    assert len(results[("caching", False)]) == 1 and "is freed while" in results[("caching", False)][0]
    assert results[("caching", True)] == []
    assert len(results[("planned", True)]) == 1 and "planned allocator" in results[("planned", True)][0]


def test_a_freed_buffer_is_fine_once_its_stream_waited_for_the_reader() -> None:
    with simulated_cuda("planned", runtime=False) as sim:
        side = torch.cuda.Stream()
        host = sim.mark_host(torch.empty(4096), pinned=True)
        x = torch.ones(4096) * 3
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            host.copy_(x, non_blocking=True)
        torch.cuda.current_stream().wait_stream(side)
        del x
        gc.collect()
    sim.check()


def test_autograd_backward_is_recorded_on_the_current_stream() -> None:
    with simulated_cuda(runtime=False) as sim:
        side = torch.cuda.Stream()
        w = torch.ones(64, requires_grad=True)
        (w * w).sum().backward()  # the gradient is written on the compute stream
        with torch.cuda.stream(side):
            _ = w.grad.sum()  # type: ignore[union-attr]
    assert len(sim.violations) == 1 and "side stream 1 reads" in sim.violations[0].message


def test_everything_is_restored_after_the_simulation() -> None:
    real_stream, real_record = torch.cuda.Stream, torch.Tensor.record_stream
    with simulated_cuda(runtime=True):
        assert torch.cuda.Stream is not real_stream
    assert torch.cuda.Stream is real_stream and torch.Tensor.record_stream is real_record
