"""Swap store details on CPU (host buffers reused, storages that outlive a backward) and the inline host worker."""

from __future__ import annotations

import pytest
import torch

from agent.runtime.host_worker import HostWorker
from agent.runtime.swap import SwapStore


def _iteration(store: SwapStore, w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    with store.swapping(1):
        y = (w * x).tanh().sum()
    store.prefetch(1)
    y.backward()
    g = w.grad
    assert g is not None
    w.grad = None
    return g


def test_a_saved_storage_that_outlives_its_backward_is_swapped_again_next_iteration():
    # `x` lives across iterations (like a batch tensor a block saves): its released entry must not be
    # found again by the next iteration's pack (it used to raise "unpacked after its host copy was released")
    store = SwapStore(torch.device("cpu"), lambda t: False)
    x = torch.randn(4096)
    w = torch.randn(4096, requires_grad=True)
    (w * x).tanh().sum().backward()  # the same iteration without swapping
    expected, w.grad = w.grad, None
    for _ in range(3):
        assert torch.equal(_iteration(store, w, x), expected)
    assert store.counters.host_bytes_live == 0


def test_host_buffers_are_kept_for_the_next_iteration_on_cpu():
    store = SwapStore(torch.device("cpu"), lambda t: False)
    x = torch.randn(4096)
    w = torch.randn(4096, requires_grad=True)
    _iteration(store, w, x)
    kept = {n: [t.data_ptr() for t in ts] for n, ts in store._host_free.items()}
    assert kept and store.counters.swapped_out_bytes > 0
    _iteration(store, w, x)  # the same sizes again: the copies land in the kept buffers
    assert {n: sorted(t.data_ptr() for t in ts) for n, ts in store._host_free.items()} == {
        n: sorted(p) for n, p in kept.items()
    }
    store.end_iteration()
    assert not store._host_free


def test_inline_host_worker_runs_at_once_and_keeps_errors_for_the_waiter():
    worker = HostWorker(inline=True)
    ran: list[int] = []
    done = worker.submit(ran.append, 1)
    assert ran == [1] and done.done()

    def fail() -> None:
        raise ValueError("host step failed")

    failed = worker.submit(fail)
    with pytest.raises(ValueError, match="host step failed"):
        failed.result()
    worker.shutdown()


def test_threaded_host_worker_keeps_submission_order():
    worker = HostWorker()
    ran: list[int] = []
    futures = [worker.submit(ran.append, i) for i in range(20)]
    for f in futures:
        f.result()
    assert ran == list(range(20))
    worker.shutdown()


def test_inline_host_work_is_host_memory_the_device_meter_does_not_count():
    # on a CPU device the host worker runs inline on the training thread, under the meter's dispatch mode
    # (`agent.measure`): its temporaries (a sharded chunk's shard copy before an all-gather, issue 20) are
    # host memory, as they are when the worker is a thread the mode does not see
    from agent.profiler.storage_tracker import StorageTracker  # local import: the meter's tracker

    worker = HostWorker(inline=True)
    kept: list[torch.Tensor] = []
    tracker = StorageTracker()
    with tracker:
        worker.submit(lambda: kept.append(torch.ones(4096))).result()
        on_device = torch.ones(1024)
    assert [r.nbytes for r in tracker.records] == [on_device.nbytes]
    assert kept[0].sum().item() == 4096.0
    seen = HostWorker(inline=True, modes_see_inline_work=True)  # the CUDA-semantics checker's simulation
    tracker = StorageTracker()
    with tracker:
        seen.submit(lambda: kept.append(torch.ones(4096))).result()
    assert [r.nbytes for r in tracker.records] == [4096 * 4]
