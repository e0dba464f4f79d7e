"""Plans from the real profiler and solver apply exactly: training matches plain PyTorch."""

from __future__ import annotations

import pytest
import torch
from runtime_helpers import Trainer, batches, clone, max_rel_diff, param_rel_diff, plain_trainer, train

from agent.testing.model_zoo import build
from client.contract import Constraints, SolverStatus

TOL = 1e-5


def adamw(m: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.1, fused=True)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_plan_solved_under_a_tight_limit_trains_like_plain_pytorch(kind: str) -> None:
    import agent
    from agent.wrapping import wrap
    from planner_service.solver import solve

    base, _ = build(kind, layers=4, hidden=128, vocab=128, seq=32, seed=0)
    data = batches(20)
    probe = clone(base)
    x = data[0]
    trace = agent.profile(
        probe, {"input_ids": x, "labels": x}, optimizer=adamw(probe), repeats=1, allocation_trace=False
    )
    limit = int(trace.measurements.peak_device_bytes * 0.4)  # well below what one plain iteration used
    plan = solve(trace, Constraints(device_memory_bytes=limit, time_limit_s=5.0))
    assert plan.solver.status in (SolverStatus.optimal, SolverStatus.feasible), plan.solver.message
    assert plan.policy is not None

    ref_model = clone(base)
    ref = train(plain_trainer(ref_model, adamw), data)
    model = clone(base)
    w = wrap(model, adamw(model), plan=plan)
    got = train(Trainer(w.model, w.optimizer), data)
    assert max_rel_diff(got, ref) <= TOL
    w.synchronize()
    diff, name = param_rel_diff(model, ref_model)
    assert diff <= TOL, f"{name} differs by {diff}"
    offloaded = [c.index for c in plan.policy.chunks if c.placement.value == "offloaded"]
    assert w.report().offloaded_chunks == len(offloaded)
