"""Level 1: the chunk runtime's own device buffers live in one planned arena; none is allocated after warm-up."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from agent.runtime import ChunkedOptimizer, ChunkLayout, RuntimeOptions, manual_plan
from agent.runtime.arena import (
    ArenaDeviceContext,
    ArenaMismatchError,
    plan_runtime_arena,
    runtime_arena_context,
    runtime_buffers,
)
from agent.runtime.device import DeviceContext
from agent.runtime.manager import ModelStateManager
from agent.testing.model_zoo import build
from client.contract import Placement

VOCAB, SEQ = 128, 16


def _alternate(i: int, n: int) -> Placement:
    return Placement.offloaded if i % 2 else Placement.persistent


def _setup(model: nn.Module, ctx_factory, compute_dtype: torch.dtype | None):
    """What agent.wrap does, with the DeviceContext chosen by `ctx_factory(layout)`."""
    sizes = [p.numel() * p.element_size() for p in model.parameters()]
    chunk = max(max(sizes), -(-sum(sizes) // 6))
    plan = manual_plan(
        model, chunk_size_bytes=chunk, offload=_alternate, n_buffers=2, compute_dtype=compute_dtype
    )
    assert plan.policy is not None
    layout = ChunkLayout.from_policy(plan.policy, model, compute_dtype or torch.float32)
    ctx = ctx_factory(layout)
    opts = RuntimeOptions(device="cpu", compute_dtype=compute_dtype)
    manager = ModelStateManager(model, layout, ctx, opts)
    optimizer = ChunkedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), layout, manager)
    manager.attach_optimizer(optimizer)
    return manager, optimizer, ctx, layout


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int, seed: int = 3) -> list[float]:
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)  # the same dropout masks in both runs
    losses = []
    for _ in range(steps):
        x = torch.randint(0, VOCAB, (2, SEQ), generator=g)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("compute_dtype", [None, torch.bfloat16], ids=["fp32", "bf16-mixed"])
def test_runtime_buffers_live_in_the_arena_and_none_is_allocated_after_warm_up(compute_dtype) -> None:
    base, _ = build("gpt2", layers=3, hidden=64, vocab=VOCAB, seq=32, seed=0)
    ref_model = copy.deepcopy(base)
    cpu = torch.device("cpu")

    model = copy.deepcopy(base)
    manager, optimizer, ctx, layout = _setup(
        model, lambda lay: runtime_arena_context(cpu, lay), compute_dtype
    )
    assert isinstance(ctx, ArenaDeviceContext)
    buffers = runtime_buffers(layout)
    assert ctx.stats.served == len(buffers) and ctx.stats.outside == 0
    assert any(b.name.startswith("buffer") for b in buffers) and any(
        b.name.startswith("chunk") for b in buffers
    )

    losses = _train(model, optimizer, 1)  # warm-up
    after_warm_up = copy.deepcopy(ctx.stats)
    losses += _train(model, optimizer, 3, seed=4)
    assert (
        ctx.stats.device_allocs == after_warm_up.device_allocs
    )  # no device buffer requested in steady state
    assert ctx.stats.host_allocs == after_warm_up.host_allocs
    assert ctx.stats.outside == 0 and ctx.stats.mismatches == []
    for st in manager.states:
        if not st.offloaded:
            assert ctx.contains(st.params) and ctx.contains(st.grad)
    assert manager.pool is not None
    for slot in manager.pool.slots:
        assert ctx.contains(slot.params) and ctx.contains(slot.grad)
    # the arena is exactly the runtime's buffers, aligned: no gap, nothing else
    assert ctx.stats.arena_bytes == sum(-(-b.nbytes // 512) * 512 for b in buffers)

    # the same training with ordinary device allocations gives the same losses, bit for bit
    ref_manager, ref_optimizer, _, _ = _setup(ref_model, lambda lay: DeviceContext(cpu), compute_dtype)
    ref = _train(ref_model, ref_optimizer, 1) + _train(ref_model, ref_optimizer, 3, seed=4)
    manager.synchronize()
    ref_manager.synchronize()
    assert losses == ref


def test_a_buffer_the_plan_does_not_know_is_allocated_outside_and_reported() -> None:
    model, _ = build("llama", layers=2, hidden=64, vocab=VOCAB, seq=32, seed=0)
    plan = manual_plan(model, chunk_size_bytes=10**6, offload="none")
    assert plan.policy is not None
    layout = ChunkLayout.from_policy(plan.policy, model, torch.float32)
    planned = plan_runtime_arena(layout)
    ctx = ArenaDeviceContext(torch.device("cpu"), planned.allocation, planned.trace.events)
    odd = ctx.device_empty(12345, torch.float32)
    assert not ctx.contains(odd)
    assert ctx.stats.outside == 1 and "12345" in ctx.stats.mismatches[0]
    strict = ArenaDeviceContext(torch.device("cpu"), planned.allocation, planned.trace.events, strict=True)
    with pytest.raises(ArenaMismatchError, match=r"device_empty\(12345, torch.float32\)"):
        strict.device_empty(12345, torch.float32)


def test_served_buffers_do_not_share_bytes_and_have_their_own_storage() -> None:
    model, _ = build("gpt2", layers=2, hidden=64, vocab=VOCAB, seq=32, seed=0)
    plan = manual_plan(model, chunk_size_bytes=10**5, offload="none")
    assert plan.policy is not None
    layout = ChunkLayout.from_policy(plan.policy, model, torch.float32)
    ctx = runtime_arena_context(torch.device("cpu"), layout)
    tensors = [ctx.device_empty(b.numel, b.dtype) for b in runtime_buffers(layout)]
    ranges = sorted((t.data_ptr(), t.data_ptr() + t.nbytes) for t in tensors)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(ranges, ranges[1:], strict=False))
    assert len({t.untyped_storage().data_ptr() for t in tensors}) == len(tensors)
    for i, t in enumerate(tensors):
        t.fill_(float(i))
    assert all(bool((t == float(i)).all()) for i, t in enumerate(tensors))
