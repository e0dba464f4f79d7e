"""`plan=` and `agent.install_allocator(path)` given something that is not a Plan: a clear error naming the
argument, as `wrap` documents ("ValueError/TypeError naming a bad argument"), with the model untouched."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from agent.testing.model_zoo import build_with_library_defaults, sample_batch


@pytest.mark.parametrize("given", ["path", "dict"])
def test_a_plan_argument_that_is_no_plan_is_refused_naming_it(tmp_path: Path, given: str) -> None:
    """Defect: `wrap(..., plan="plan.json")` (a path, as `memplan plans solve -o` writes and
    `install_allocator` takes) or a dict raised AttributeError("'str' object has no attribute 'policy'")."""
    import agent

    model, config = build_with_library_defaults("llama", layers=2, hidden=64, vocab=256, seq=64)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"foo": 1}))
    plan: object = str(path) if given == "path" else {"foo": 1}
    with pytest.raises((TypeError, ValueError), match=r"\bplan\b"):
        agent.wrap(
            model,
            torch.optim.AdamW(model.parameters()),
            sample_batch=sample_batch(config, 2, 16),
            plan=plan,  # type: ignore[arg-type]
            feedback_steps=None,
        )
    agent.wrap(  # untouched: the same model wraps afterwards
        model,
        torch.optim.AdamW(model.parameters()),
        sample_batch=sample_batch(config, 2, 16),
        feedback_steps=None,
    )


def test_install_allocator_names_a_json_file_that_is_no_plan_in_one_error(tmp_path: Path) -> None:
    """Defect: a JSON file that is not a plan raised pydantic's ValidationError ("4 validation errors for
    Plan"), where an unreadable or non-JSON file gets ValueError("plan: cannot read a plan from PATH ...")."""
    import agent

    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"foo": 1}))
    with pytest.raises(ValueError, match=rf"plan: .*{path}"):
        agent.install_allocator(str(path))
