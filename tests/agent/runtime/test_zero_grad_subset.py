"""`optimizer.zero_grad()` clears the optimizer's own parameters only, as torch's does (review, session 27).

A trainable parameter the optimizer does not hold (an optimizer over the layers only, the embedding and head
still requiring gradients) keeps its `.grad` across `zero_grad()` in plain PyTorch, accumulating; a clip over
`model.parameters()` then counts it. memplan's `zero_grad` forgot every chunk's gradients: the clip norm came out
1.41 instead of 1.95 after one step, and the layers drifted 6e-3 from plain PyTorch in 3 steps. Now the chunks'
other entries keep theirs (persistent and offloaded chunks; `model.zero_grad()` still clears every one).
"""

from __future__ import annotations

import copy

import pytest
import torch
from runtime_helpers import param_rel_diff
from torch import nn

from agent.runtime import manual_plan
from agent.wrapping import wrap

VOCAB = 64
HIDDEN = 32
TOL = 1e-6


class LM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(nn.Linear(HIDDEN, HIDDEN) for _ in range(2))
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for layer in self.layers:
            h = h + torch.tanh(layer(h))
        return nn.functional.cross_entropy(self.head(h).flatten(0, 1), ids.flatten())


def _layers(model: nn.Module) -> list[nn.Parameter]:
    return [p for n, p in model.named_parameters() if n.startswith("layers")]


def _train(model: nn.Module, run: nn.Module, opt: torch.optim.Optimizer, set_to_none: bool) -> list[float]:
    """3 steps; the clip norms over every parameter (the embedding's and head's `.grad` accumulate)."""
    g = torch.Generator().manual_seed(1)
    norms = []
    for _ in range(3):
        ids = torch.randint(0, VOCAB, (4, 8), generator=g)
        run(ids).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
    return norms


@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("offload", ["none", "all"])
def test_zero_grad_keeps_the_gradients_of_parameters_the_optimizer_does_not_hold(
    offload: str, set_to_none: bool
) -> None:
    torch.manual_seed(0)
    ref = LM()
    model = copy.deepcopy(ref)
    ref_opt = torch.optim.SGD(_layers(ref), lr=0.1, momentum=0.9)
    want = _train(ref, ref, ref_opt, set_to_none)
    # two chunks, each mixing parameters the optimizer holds (a layer) with others (the embedding, the head)
    plan = manual_plan(model, chunk_size_bytes=13000, offload=offload, n_buffers=2)
    wrapped = wrap(
        model, torch.optim.SGD(_layers(model), lr=0.1, momentum=0.9), plan=plan, feedback_steps=None
    )
    got = _train(model, wrapped.model, wrapped.optimizer, set_to_none)
    assert max(abs(a - b) / b for a, b in zip(got, want, strict=True)) <= TOL, (got, want)
    for name in ("embed.weight", "head.weight", "head.bias"):
        a, b = dict(model.named_parameters())[name].grad, dict(ref.named_parameters())[name].grad
        assert a is not None and b is not None, name
        assert float((a - b).norm() / b.norm()) <= TOL, name
    for name, p in ref.named_parameters():
        if name.startswith("layers"):
            assert (p.grad is None) == set_to_none, name
    assert param_rel_diff(model, ref)[0] <= TOL
    # model.zero_grad() clears every parameter, as torch's
    wrapped.model.zero_grad()
    assert all(p.grad is None for p in model.parameters())
