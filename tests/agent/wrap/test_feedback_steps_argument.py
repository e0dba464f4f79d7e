"""`wrap(feedback_steps=...)` too small to measure (the monitor needs warm-up steps, a metered step and a timed
step): an error naming the argument before anything is profiled, planned or wrapped.

Defect (session 9 QA): `feedback_steps=2` raised this ValueError from the step monitor, made after the plan was
applied: after profiling and planning (18 s for a tiny llama at 2 ranks, rank 0 asking the service first), and
with the model left wrapped (hooks on, parameters views into chunks), so wrapping it again raised "model: is
already wrapped; unwrap it first" while the wrapped handle to unwrap it with was never returned.
"""

from __future__ import annotations

import pytest
import torch

import agent
from agent.runtime import manual_plan
from agent.testing.model_zoo import build_with_library_defaults


@pytest.mark.parametrize("steps", [1, 3, -1])
def test_too_few_feedback_steps_are_refused_before_the_model_is_touched(steps: int) -> None:
    model, _ = build_with_library_defaults("llama", layers=2, hidden=32, vocab=64, seq=16)
    plan = manual_plan(model, chunk_size_bytes=1 << 16, offload="all", n_buffers=2)
    with pytest.raises(ValueError, match=r"^feedback_steps: must be at least 4"):
        agent.wrap(model, torch.optim.AdamW(model.parameters()), plan=plan, feedback_steps=steps)
    assert not getattr(model, "_memplan_wrapped", False) and "zero_grad" not in model.__dict__
    wrapped = agent.wrap(model, torch.optim.AdamW(model.parameters()), plan=plan, feedback_steps=4)
    agent.unwrap(wrapped)
