"""The runtime's pinned host arena (`agent/runtime/host_arena.py`, issue 19 defect 8) under the stream-ordering
checker (`checker.simulated_cuda`, a test double: no GPU runs here): chunk buffers are arena views, swap copies are
ranges of its swap region that are handed out again every iteration, and every access stays ordered."""

from __future__ import annotations

import gc

import pytest
import torch

from agent.runtime import RuntimeOptions
from agent.runtime.host_arena import HostArena
from agent.runtime.manual import manual_policy
from agent.wrapping import unwrap, wrap
from client.contract import (
    Constraints,
    Plan,
    Predictions,
    SolverReport,
    SolverStatus,
    offloaded_chunk_pinned_bytes,
)
from tests.agent.runtime.activations.activation_helpers import policy_for
from tests.agent.runtime.cuda_semantics.checker import simulated_cuda
from tests.agent.runtime.runtime_helpers import Trainer, batches, chunk_bytes_for, tiny_model, train

pytestmark = pytest.mark.cuda_semantics

MiB = 2**20


def plan_with_swap(model: torch.nn.Module, dtype: torch.dtype, swap_bytes: int) -> Plan:
    """Every chunk offloaded, blocks 1 and 3 of 4 swapped; its predictions count `swap_bytes` swapped bytes."""
    policy = manual_policy(
        model,
        chunk_size_bytes=-(-chunk_bytes_for(model, 6) // 16) * 16,
        offload="all",
        n_buffers=2,
        compute_dtype=dtype,
    )
    policy = policy.model_copy(update={"blocks": policy_for(model, "transformer.h", "SKSK").blocks})
    separate = dtype != torch.float32
    pinned = sum(offloaded_chunk_pinned_bytes(c.used_bytes, separate_master=separate) for c in policy.chunks)
    zero = dict(iteration_s=0.0, forward_s=0.0, backward_s=0.0, device_optimizer_s=0.0, host_optimizer_s=0.0)
    return Plan(
        trace_hash="hand-built",
        constraints=Constraints(device_memory_bytes=2**40),
        policy=policy,
        predictions=Predictions(
            **zero,
            peak_device_bytes=0,
            peak_host_bytes=pinned + swap_bytes,
            pinned_host_bytes=pinned + swap_bytes,
        ),
        solver=SolverReport(
            solver="manual", solver_version="0", status=SolverStatus.unknown, solve_s=0.0, message="test plan"
        ),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16-mixed"])
def test_chunk_buffers_and_swap_copies_from_the_arena_keep_every_access_ordered(dtype: torch.dtype) -> None:
    model = tiny_model("gpt2")
    plan = plan_with_swap(model, dtype, 8 * MiB)
    with simulated_cuda("caching") as sim:
        w = wrap(
            model,
            torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True),
            plan=plan,
            options=RuntimeOptions(compute_dtype=dtype),
        )
        arena = w.runtime.ctx.host_arena
        assert arena is not None and arena.nbytes == plan.predictions.pinned_host_bytes  # type: ignore[union-attr]
        losses = train(Trainer(w.model, w.optimizer), batches(4))
        store = w.activations.store if w.activations is not None else None
        assert store is not None and store.host_arena is arena
        assert arena.stats.swap_served > 0 and store.counters.arena_fallbacks == 0
        assert arena.stats.chunk_fallbacks == 0
        assert sim.kernels_on("swap-out stream") > 0 and sim.kernels_on("upload stream") > 0
        w.synchronize()
        unwrap(w)
        gc.collect()
    assert all(x == x for x in losses)
    sim.check()


def test_the_checker_sees_a_reused_swap_range_written_before_its_last_reader_is_ordered() -> None:
    # the checker tracks the arena's swap region as one host storage: a range freed and handed out again is the
    # same bytes, so a copy into it that is not ordered after the copy that read it before is caught
    with simulated_cuda("caching", runtime=True) as sim:
        arena = HostArena(0, 4096, torch.device("cpu"))
        sim.mark_host(arena.swap_region, pinned=True)
        reader, writer = torch.cuda.Stream(), torch.cuda.Stream()
        got = arena.swap_take(1024)
        assert got is not None
        offset, host = got
        dev = torch.empty(1024, dtype=torch.uint8)
        with torch.cuda.stream(reader):
            dev.copy_(host, non_blocking=True)  # an H2D copy reads the range on one stream
        arena.swap_free(offset)
        again = arena.swap_take(1024)
        assert again is not None and again[0] == offset  # first fit: the same range
        with torch.cuda.stream(writer):
            again[1].copy_(torch.zeros(1024, dtype=torch.uint8), non_blocking=True)  # no wait for the reader
    assert len(sim.violations) >= 1 and "host buffer" in sim.violations[0].message
