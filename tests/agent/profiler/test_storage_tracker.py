"""The CPU storage tracker: a collective's in/out tensors are not allocations (issue 20).

torch.distributed's collectives are dispatcher ops whose schemas return their in/out arguments with no alias
annotation (`c10d::allreduce_(Tensor[] tensors, ...) -> (Tensor[], Work)`). The tracker read those outputs as
new storages: a collective on a tensor the window had not registered (an offloaded chunk's host gradient or
compute copy) was counted as device memory for the rest of the window. One-rank gloo group, in process.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from agent.profiler.storage_tracker import StorageTracker
from agent.runtime.process_group import all_gather_single, reduce_scatter_single


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def one_rank_group() -> Iterator[None]:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_collectives_on_existing_tensors_allocate_nothing(one_rank_group: None) -> None:
    host_grad = torch.ones(1024)
    full = torch.zeros(1024)
    shard = torch.zeros(1024)
    tracker = StorageTracker()
    with tracker:
        dist.all_reduce(host_grad)
        all_gather_single(full, host_grad)
        reduce_scatter_single(shard, full)
        dist.broadcast(full, src=0)
    assert tracker.records == [] and tracker.peak_bytes == 0
    assert torch.equal(shard, torch.ones(1024))


def test_a_fresh_tensor_next_to_a_collective_is_still_an_allocation(one_rank_group: None) -> None:
    x = torch.ones(256)
    tracker = StorageTracker()
    with tracker:
        dist.all_reduce(x)
        y = x * 2  # a new storage: 1 KiB
        z = torch.add(x, y, out=torch.empty(256))  # out= aliases its argument, made just before: 1 KiB
    assert [r.nbytes for r in tracker.records] == [1024, 1024]
    assert tracker.peak_bytes == 2048 and z.sum().item() == 768.0
