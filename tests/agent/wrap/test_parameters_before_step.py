"""Parameters read or written between `loss.backward()` and `optimizer.step()` (session 22 probe).

The runtime steps offloaded chunks on the host during backward (speculatively, checked at `step()`). Before this
session the parameters of those chunks already showed the stepped values when backward returned, while plain
PyTorch changes them only in `step()`: code between the two that reads them (an L2 term added to `.grad` by
hand, `p.grad.add_(p, alpha=wd)`; a logged norm) read the next step's weights, and training drifted (loss 6.738
against 6.499 by step 3), and an in-place write (decoupled weight decay by hand, `p.mul_(1 - lr * wd)`) was lost
when the speculative step stood. Now they show the values before the step (the step's undo backup) until
`step()` (`state_dict()` too), and a write to them (an in-place op, a write through `.data` that changes a
parameter's first, middle or last element, `load_state_dict`) makes `step()` redo the chunk's step from the
written values (a review of the session's change found the `.data` and state-dict cases lost, fixed).

Limit (docs/architecture/runtime.md): chunks whose master is a separate fp32 copy (bf16/fp16 parameters) and
chunks sharded across ranks still show the stepped values there.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn

import agent
from agent.testing.model_zoo import build_with_library_defaults, sample_batch
from agent.testing.plans import offloaded_plan

pytestmark = pytest.mark.slow

LR = 1e-2
WD = 0.1
Between = Callable[[nn.Module], None]


def l2_in_the_gradient(model: nn.Module) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.grad.add_(p, alpha=WD)  # type: ignore[union-attr]


def weight_decay_by_hand(model: nn.Module) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1 - LR * WD)


def train(
    model: nn.Module, opt: torch.optim.Optimizer, batch: dict[str, torch.Tensor], between: Between
) -> list[float]:
    losses = []
    for _ in range(4):
        before = [p.detach().clone() for p in model.parameters()]
        loss = model(**batch).loss
        loss.backward()
        for p, q in zip(model.parameters(), before, strict=True):
            assert torch.equal(p, q), "a parameter changed before optimizer.step()"
        params = dict(model.named_parameters())
        for name, v in model.state_dict().items():
            if name in params:
                assert torch.equal(v, params[name]), name  # the state dict holds the same values
        between(model)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def weight_decay_through_data(model: nn.Module) -> None:
    for p in model.parameters():
        p.data.mul_(1 - LR * WD)  # bumps no version counter: seen by the sampled elements


def state_dict_then_load(model: nn.Module) -> None:
    state = {k: v.clone() for k, v in model.state_dict().items()}  # the values before the step
    for v in state.values():
        v.mul_(0.5)
    model.load_state_dict(state)  # the step then starts from the loaded values


@pytest.mark.parametrize(
    "between",
    [l2_in_the_gradient, weight_decay_by_hand, weight_decay_through_data, state_dict_then_load],
    ids=["read", "write", "write-data", "state-dict-load"],
)
def test_parameters_change_in_step_as_in_plain_pytorch(between: Between) -> None:
    model, cfg = build_with_library_defaults("llama", 4, 128, vocab=1000, seq=128)
    batch = sample_batch(cfg, 2, 64)
    reference = copy.deepcopy(model)
    expected = train(reference, torch.optim.AdamW(reference.parameters(), lr=LR, fused=True), batch, between)

    m = copy.deepcopy(model)
    run = agent.wrap(
        m,
        torch.optim.AdamW(m.parameters(), lr=LR, fused=True),
        plan=offloaded_plan(model, batch),
        feedback_steps=None,
    )
    got = train(run.model, run.optimizer, batch, between)
    assert run.runtime.counters.speculative_steps > 0  # the host steps did overlap backward
    assert run.runtime.counters.write_backs == 0  # nothing wrote a parameter in a device buffer
    assert got == expected
    final = dict(run.model.named_parameters())
    for name, p in reference.named_parameters():
        assert torch.equal(final[name], p), name
    agent.unwrap(run)


def test_an_in_place_write_to_a_chunk_left_in_a_device_buffer_is_kept() -> None:
    """An evaluation leaves offloaded chunks in device buffers; `p.copy_(w)` / `p.mul_(...)` then wrote the buffer
    and the next eviction dropped it (uploads come from the host copy): one step later the parameters were 1.08
    off plain PyTorch (session 22 review). The eviction now copies a written buffer back."""
    model, cfg = build_with_library_defaults("llama", 4, 128, vocab=1000, seq=128)
    batch = sample_batch(cfg, 2, 64)

    def job(m: nn.Module, opt: torch.optim.Optimizer) -> list[float]:
        losses = []
        for i in range(3):
            loss = m(**batch).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            if i == 0:
                m.eval()
                with torch.no_grad():
                    m(**batch)  # an evaluation: chunks stay in their buffers
                    for p in m.parameters():
                        p.mul_(0.5)
                m.train()
        return losses

    reference = copy.deepcopy(model)
    expected = job(reference, torch.optim.AdamW(reference.parameters(), lr=LR, fused=True))
    m = copy.deepcopy(model)
    run = agent.wrap(
        m,
        torch.optim.AdamW(m.parameters(), lr=LR, fused=True),
        plan=offloaded_plan(model, batch),
        feedback_steps=None,
    )
    got = job(run.model, run.optimizer)
    assert run.runtime.counters.write_backs > 0
    assert got == expected
    final = dict(run.model.named_parameters())
    for name, p in reference.named_parameters():
        assert torch.equal(final[name], p), name
    agent.unwrap(run)
