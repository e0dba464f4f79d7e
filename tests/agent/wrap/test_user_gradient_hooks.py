"""Post-accumulate-grad hooks the user registers on the wrapped model's parameters after `wrap` (gradient
logging, per-parameter clipping) see each gradient as in plain PyTorch, and what they change in it is what
the step uses.

Defect (session 32, found by an exploratory run): the runtime's own hook, registered first, took the gradient
of an offloaded chunk's parameter (to the host, `p.grad` None until the step), so every such hook registered
after `wrap` saw `p.grad` None (a hook calling `p.grad.norm()` raised inside backward). The runtime now puts its
hook behind the parameter's others at each forward.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from agent.testing.model_zoo import build_with_library_defaults, sample_batch

pytestmark = pytest.mark.slow
CLIP = 2e-3  # per element: clamps much of this model's gradient


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    """SGD with momentum: a clamped gradient moves the parameters by other amounts (Adam's normalised update
    would hide much of it)."""
    return torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.9)


def clipping_hooks(model: nn.Module, norms: dict[str, float]) -> None:
    """Each gradient's norm recorded, then clamped in place (per-parameter clipping, as users write it)."""
    for name, p in model.named_parameters():

        def hook(p: torch.Tensor, name: str = name) -> None:
            assert p.grad is not None, f"{name}: the hook saw no gradient"
            norms[name] = p.grad.norm().item()
            p.grad.clamp_(-CLIP, CLIP)

        p.register_post_accumulate_grad_hook(hook)


def train(model: nn.Module, optimizer: torch.optim.Optimizer, batch: dict[str, torch.Tensor]) -> list[float]:
    losses = []
    for _ in range(3):
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_hooks_registered_after_wrap_see_and_change_every_gradient_as_in_plain_pytorch() -> None:
    import agent
    from agent.testing.plans import offloaded_plan

    model, config = build_with_library_defaults("llama", layers=2, hidden=64, vocab=256, seq=64)
    batch = sample_batch(config, 2, 32)
    reference, unclipped = copy.deepcopy(model), copy.deepcopy(model)
    plain_norms: dict[str, float] = {}
    clipping_hooks(reference, plain_norms)
    expected = train(reference, sgd(reference), batch)
    assert any(abs(v) > CLIP for v in plain_norms.values())

    plan = offloaded_plan(model, batch, "CS")  # every chunk offloaded: the runtime takes every gradient
    wrapped = agent.wrap(model, sgd(model), plan=plan, feedback_steps=None)
    norms: dict[str, float] = {}
    clipping_hooks(wrapped.model, norms)  # after wrap, on the wrapped model's parameters
    losses = train(wrapped.model, wrapped.optimizer, batch)
    assert norms.keys() == plain_norms.keys()
    for name, value in plain_norms.items():
        assert norms[name] == pytest.approx(value, rel=1e-4), name
    assert losses == pytest.approx(expected, rel=1e-5)
    agent.unwrap(wrapped)
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert ((p.detach() - q.detach()).norm() / q.detach().norm()).item() <= 1e-5, name
    # the clamps mattered: plain training without them ends elsewhere
    train(unclipped, sgd(unclipped), batch)
    assert any(
        ((p.detach() - q.detach()).norm() / q.detach().norm()).item() > 1e-3
        for p, q in zip(model.parameters(), unclipped.parameters(), strict=True)
    )
