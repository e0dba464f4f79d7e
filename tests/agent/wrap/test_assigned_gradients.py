"""Gradients assigned by hand (`p.grad = g`) and then stepped (session 23 probe).

`torch.autograd.grad(loss, params)` computes gradients without accumulating them, so none of the runtime's
gradient hooks runs; code that assigns them (`p.grad = g`: meta-learning loops, gradient surgery, evolution
strategies with no backward at all) then calls `optimizer.step()`. Before this session the wrapped optimizer
stepped nothing and said nothing (a 2-layer llama's loss stayed 4.8585 over 3 steps; plain PyTorch 4.86, 4.47,
4.44). Now `step()` takes every `.grad` the runtime did not set into its chunk (persistent or offloaded), and
the training equals plain PyTorch's bit for bit. In a job of several ranks such gradients are refused
(`tests/agent/distributed/test_qa_multi_rank.py`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn

import agent
from agent.runtime.manager import SecondBackwardError
from agent.testing.model_zoo import build_with_library_defaults, sample_batch
from agent.testing.plans import offloaded_plan

pytestmark = pytest.mark.slow

Batch = dict[str, torch.Tensor]
Step = Callable[[nn.Module, list[nn.Parameter], Batch, int], torch.Tensor]


def by_autograd_grad(m: nn.Module, params: list[nn.Parameter], batch: Batch, i: int) -> torch.Tensor:
    loss = m(**batch).loss
    for p, g in zip(params, torch.autograd.grad(loss, params), strict=True):
        p.grad = g
    return loss


def without_backward(m: nn.Module, params: list[nn.Parameter], batch: Batch, i: int) -> torch.Tensor:
    with torch.no_grad():
        loss = m(**batch).loss
    gen = torch.Generator().manual_seed(i)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen, dtype=p.dtype) * 1e-2
    return loss


def half_by_hand_half_by_backward(
    m: nn.Module, params: list[nn.Parameter], batch: Batch, i: int
) -> torch.Tensor:
    """`backward(inputs=)` for the second half of the parameters, `autograd.grad` of a second forward for the first."""
    half = len(params) // 2
    m(**batch).loss.backward(inputs=params[half:])
    loss = m(**batch).loss
    for p, g in zip(params[:half], torch.autograd.grad(loss, params[:half]), strict=True):
        p.grad = g
    return loss


def assigned_then_backward_of_the_rest(
    m: nn.Module, params: list[nn.Parameter], batch: Batch, i: int
) -> torch.Tensor:
    """A gradient assigned before a backward that gives its parameter none (`backward(inputs=...)`): torch keeps
    it; the end of backward dropped it from offloaded chunks (session 23 review)."""
    for k, p in enumerate(params[::2]):
        p.grad = torch.full_like(p, 1e-3 * (k + i + 1))
    loss = m(**batch).loss
    loss.backward(inputs=params[1::2])
    return loss


def backward_of_half(m: nn.Module, params: list[nn.Parameter], batch: Batch, i: int) -> torch.Tensor:
    """Half the parameters get no gradient: torch does not step them (the first step after wrap did: every
    persistent parameter showed a zero gradient view, taken for an assigned gradient; session 23 review)."""
    loss = m(**batch).loss
    loss.backward(inputs=params[1::2])
    return loss


def train(
    m: nn.Module,
    opt: torch.optim.Optimizer,
    batch: Batch,
    step: Step,
    *,
    zero: bool = True,
    zero_first: bool = False,
) -> list[float]:
    """Four steps: gradients by `step`, clipped by torch's clip_grad_norm_, stepped; zero_grad after each if `zero`
    (without it the next assignment replaces `.grad`, as in torch); `zero_first`: zero_grad(set_to_none=False)
    before any gradient exists (torch zeroes nothing then, and steps nothing without a gradient; memplan stepped
    every trainable parameter with zeros before session 23)."""
    params = list(m.parameters())
    losses = []
    if zero_first:
        opt.zero_grad(set_to_none=False)
    for i in range(4):
        loss = step(m, params, batch, i)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if zero:
            opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("planned", ["offloaded", "default"])
@pytest.mark.parametrize(
    ("step", "zero", "zero_first"),
    [
        (by_autograd_grad, True, False),
        (by_autograd_grad, False, False),
        (without_backward, True, False),
        (half_by_hand_half_by_backward, True, False),
        (assigned_then_backward_of_the_rest, True, False),
        (backward_of_half, False, False),
        (backward_of_half, False, True),
    ],
    ids=[
        "autograd-grad",
        "autograd-grad-no-zero-grad",
        "no-backward",
        "half-and-half",
        "assigned-then-backward-of-the-rest",
        "backward-of-half",
        "backward-of-half-after-zero-grad-keeping-none",
    ],
)
def test_assigned_gradients_are_stepped_as_in_plain_pytorch(
    step: Step, zero: bool, zero_first: bool, planned: str
) -> None:
    model, cfg = build_with_library_defaults("llama", 4, 128, vocab=1000, seq=64)
    batch = sample_batch(cfg, 2, 32)
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, fused=True)
    expected = train(reference, ref_opt, batch, step, zero=zero, zero_first=zero_first)

    m = copy.deepcopy(model)
    how = {"plan": offloaded_plan(model, batch)} if planned == "offloaded" else {"sample_batch": batch}
    run = agent.wrap(m, torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True), feedback_steps=None, **how)
    assert all(p.grad is None for p in run.model.parameters())  # no gradient before a backward, as in torch
    got = train(run.model, run.optimizer, batch, step, zero=zero, zero_first=zero_first)
    assert got == expected
    assert len(set(got)) > 1  # the parameters did change
    final = dict(run.model.named_parameters())
    for name, p in reference.named_parameters():
        assert torch.equal(final[name], p), name
    agent.unwrap(run)


def test_a_gradient_penalty_over_offloaded_chunks_is_refused_naming_autograd_grad() -> None:
    """`torch.autograd.grad(loss, inputs, create_graph=True)` and then a backward of the same forward (a gradient
    penalty): two backward passes over one forward, which offloaded chunks cannot take (the first settles the
    forward's chunks); refused naming the case. Persistent chunks train it (the default plan on a CPU)."""
    model, cfg = build_with_library_defaults("llama", 2, 64, vocab=128, seq=64)
    model.config._attn_implementation = "eager"  # torch's CPU SDPA kernel has no double backward
    batch = sample_batch(cfg, 2, 32)
    run = agent.wrap(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True),
        plan=offloaded_plan(model, batch),
        feedback_steps=None,
    )
    emb = run.model.get_input_embeddings()(batch["input_ids"])
    loss = run.model(inputs_embeds=emb, labels=batch["labels"]).loss
    (g,) = torch.autograd.grad(loss, emb, create_graph=True)
    with pytest.raises(SecondBackwardError, match="torch.autograd.grad over the forward's graph"):
        (loss + g.pow(2).sum()).backward()
