"""A failure in `wrap` after the plan is applied leaves nothing half-wrapped (session 10).

Before, only a failure in the activation modes unwrapped: one in the guards, the feedback sink or the step monitor
(the last steps of `wrap`) left the model wrapped (hooks on, parameters views into chunks) with no handle returned
to unwrap it, so wrapping it again raised "model: is already wrapped". Now every step after `apply_plan` rolls back:
the model trains as plain PyTorch and wraps again.
"""

from __future__ import annotations

import pytest
import torch

import agent
import agent.wrapping
from agent.runtime import manual_plan
from agent.testing.model_zoo import build_with_library_defaults, sample_batch


class MonitorFault(RuntimeError):
    pass


@pytest.mark.parametrize("where", ["StepMonitor", "BatchShapeGuard", "DDPGuard"])
def test_a_failure_in_the_last_steps_of_wrap_leaves_the_model_as_it_was(
    where: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.manual_seed(0)
    model, cfg = build_with_library_defaults("llama", layers=2, hidden=32, vocab=64, seq=16)
    batch = sample_batch(cfg, 2, 16)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    plan = manual_plan(model, chunk_size_bytes=1 << 14, offload="all", n_buffers=2)

    def fail(*args: object, **kwargs: object) -> None:
        raise MonitorFault(f"{where}: injected")

    monkeypatch.setattr(agent.wrapping, where, fail)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with pytest.raises(MonitorFault, match="injected"):
        agent.wrap(model, opt, plan=plan, sample_batch=batch, feedback_steps=4)
    # unwrapped: no hooks or chunk views left, the values untouched, the KV cache setting given back
    assert not getattr(model, "_memplan_wrapped", False) and "zero_grad" not in model.__dict__
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert all(p.grad is None for p in model.parameters())
    assert model.config.use_cache is True
    # plain PyTorch trains it
    loss = model(**batch).loss
    loss.backward()
    opt.step()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    opt.zero_grad()
    # and once the cause is gone it wraps again, and trains
    monkeypatch.undo()
    wrapped = agent.wrap(model, opt, plan=plan, sample_batch=batch, feedback_steps=4)
    wrapped.model(**batch).loss.backward()
    wrapped.optimizer.step()
    agent.unwrap(wrapped)
