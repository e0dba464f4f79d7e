"""When `wrap` records the managed iteration (`agent.allocator.install.attach_managed_allocation`).

The recording runs a CPU copy of the job: cheap for a job that trains on the CPU, needed for the planned
arena, and too costly for a CUDA job with PyTorch's caching allocator (a host copy of its model and
optimizer, and CPU iterations, for a chart). Where a feedback monitor meters a step of the job (`metered`),
that step is recorded instead (`agent.allocator.managed_step`) and nothing is copied. The CUDA case is decided from `RuntimeOptions.device`, which
names the device without initialising CUDA, so it is checked here on the CPU.
"""

from __future__ import annotations

import logging

import pytest
import torch

from agent.allocator.install import attach_managed_allocation
from agent.allocator.managed import has_managed_allocation
from agent.planning import PlanSource
from agent.runtime import RuntimeOptions, manual_plan
from agent.testing.model_zoo import build


def _job() -> tuple[torch.nn.Module, torch.optim.Optimizer, dict[str, torch.Tensor], PlanSource]:
    model, _ = build("llama", layers=2, hidden=64, vocab=128, seq=16, seed=0)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    plan = manual_plan(model, offload="all", chunk_size_bytes=1 << 16)
    return model, torch.optim.AdamW(model.parameters()), batch, PlanSource(plan, "embedded", message="test")


def test_a_cuda_job_with_the_caching_allocator_is_not_recorded() -> None:
    model, opt, batch, source = _job()
    got = attach_managed_allocation(
        source, model, opt, batch, loss_fn=None, options=RuntimeOptions(device="cuda:0"), arena=False
    )
    assert got is source  # nothing recorded, nothing copied
    assert not torch.cuda.is_initialized()


def test_a_cpu_job_gets_the_allocation_of_its_managed_iteration() -> None:
    model, opt, batch, source = _job()
    got = attach_managed_allocation(source, model, opt, batch, loss_fn=None, options=None, arena=False)
    assert has_managed_allocation(got.plan)
    assert got.plan.allocation is not None and got.plan.allocation.iteration == "managed"


def test_a_plan_with_sharded_chunks_is_not_recorded_in_one_process(caplog: pytest.LogCaptureFixture) -> None:
    # a 2-rank plan that shards its offloaded chunks (issue 20): the one-process recording cannot run it, so it
    # is not tried (before: tried, refused by the runtime, and a warning on every multi-rank CPU job)
    model, opt, batch, source = _job()
    policy = source.plan.policy
    assert policy is not None
    sharded = policy.model_copy(
        update={"world_size": 2, "chunks": [c.model_copy(update={"sharded": True}) for c in policy.chunks]}
    )
    source = PlanSource(source.plan.model_copy(update={"policy": sharded}), "embedded", message="test")
    with caplog.at_level(logging.INFO, logger="agent.allocator.install"):
        got = attach_managed_allocation(source, model, opt, batch, loss_fn=None, options=None, arena=False)
    assert got is source
    assert [r.levelno for r in caplog.records] == [logging.INFO]
    assert "sharded across 2 ranks is not recorded" in caplog.records[0].getMessage()


def test_a_job_whose_metered_step_is_recorded_is_not_copied() -> None:
    model, opt, batch, source = _job()
    for options in (None, RuntimeOptions(device="cuda:0")):
        got = attach_managed_allocation(
            source, model, opt, batch, loss_fn=None, options=options, arena=False, metered=True
        )
        assert got is source
    assert not torch.cuda.is_initialized()


def test_the_planned_arena_is_recorded_before_the_job_runs_even_when_a_step_is_metered() -> None:
    model, opt, batch, source = _job()
    got = attach_managed_allocation(
        source, model, opt, batch, loss_fn=None, options=None, arena=True, metered=True
    )
    assert has_managed_allocation(got.plan)
