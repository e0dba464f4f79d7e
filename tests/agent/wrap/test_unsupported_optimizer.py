"""An optimizer the runtime cannot run (README: "any other optimizer is refused with an error") is refused with
the error `wrap` documents, `agent.runtime.UnsupportedOptimizerError`, before anything runs on the model."""

from __future__ import annotations

import pytest
import torch

from agent.runtime import UnsupportedOptimizerError
from agent.testing.model_zoo import build_with_library_defaults, sample_batch


@pytest.mark.parametrize("make", [torch.optim.Adagrad, torch.optim.RMSprop], ids=["adagrad", "rmsprop"])
def test_an_unsupported_optimizer_is_refused_with_the_documented_error(
    make: type[torch.optim.Optimizer],
) -> None:
    """Defect: wrap raised ValueError("optimizer: Adagrad is not one the wire contract v1 describes ...") from
    the profiler, not the UnsupportedOptimizerError its docstring names, so `except UnsupportedOptimizerError`
    missed it. The runtime listed Adagrad, RMSprop, Adamax, NAdam and RAdam as supported although the
    contract does not describe them and nothing trained them; the README names AdamW, Adam and SGD."""
    import agent

    model, config = build_with_library_defaults("llama", layers=2, hidden=64, vocab=256, seq=64)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(UnsupportedOptimizerError, match=r"Adagrad|RMSprop") as caught:
        agent.wrap(
            model, make(model.parameters()), sample_batch=sample_batch(config, 2, 16), feedback_steps=None
        )
    assert "AdamW" in str(caught.value) and "wire contract" not in str(caught.value)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_an_optimizer_prepared_by_accelerate_before_wrap_is_refused_naming_the_order() -> None:
    """Session 23: `accelerator.prepare(model, optimizer)` then `agent.wrap(model, optimizer)` (the order many
    scripts have) was refused as "AcceleratedOptimizer is not supported", which did not say what to do."""
    import accelerate

    import agent

    model, config = build_with_library_defaults("llama", layers=2, hidden=64, vocab=256, seq=64)
    accelerator = accelerate.Accelerator(cpu=True)
    # the optimizer alone: Accelerate's state is process-wide, and an earlier test's settings (dynamo) would
    # compile a prepared model, which wrap refuses first
    optimizer = accelerator.prepare(torch.optim.AdamW(model.parameters()))
    with pytest.raises(
        UnsupportedOptimizerError, match="AcceleratedOptimizer around AdamW; wrap first"
    ) as caught:
        agent.wrap(model, optimizer, sample_batch=sample_batch(config, 2, 16), feedback_steps=None)
    assert "accelerator.prepare(wrapped.model, wrapped.optimizer" in str(caught.value)
