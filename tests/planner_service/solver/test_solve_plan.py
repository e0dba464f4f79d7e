"""One way to solve a plan: the service's worker and the agent's in-process path give the same plan."""

from __future__ import annotations

import torch
import transformers

import agent
from agent.planning import solve_embedded
from client.contract import Constraints, PlanRequest, SolverStatus
from planner_service.jobs.tasks import solve_request


def test_the_worker_and_the_embedded_path_give_the_same_plan_allocation_included() -> None:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=512, n_positions=64)
    model = transformers.GPT2LMHeadModel(cfg)
    batch = {"input_ids": torch.randint(0, 512, (2, 32)), "labels": torch.randint(0, 512, (2, 32))}
    trace = agent.profile(model, batch, optimizer=torch.optim.AdamW(model.parameters()), repeats=1)
    assert trace.allocation_trace is not None
    constraints = Constraints(
        device_memory_bytes=int(trace.measurements.peak_device_bytes * 2), time_limit_s=5.0
    )

    embedded = solve_embedded(trace, constraints)
    served = solve_request(trace, PlanRequest(trace_id="t", constraints=constraints))

    assert embedded.solver.status in (SolverStatus.optimal, SolverStatus.feasible), embedded.solver.message
    assert embedded.allocation is not None  # before solve_plan, the embedded path placed no buffers
    assert served.allocation is not None
    timing = {"solve_s"}  # the only field that may differ between two solves of the same trace
    assert embedded.allocation.model_dump(exclude=timing) == served.allocation.model_dump(exclude=timing)
    assert embedded.policy == served.policy
    assert embedded.predictions == served.predictions
