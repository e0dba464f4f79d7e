"""Running statistics (BatchNorm) through memplan (session 22 probe of a ResNet at its library defaults).

Two defects, each with a test that failed before:
- profiling (`agent.profile`, and `agent.wrap` planning from a sample batch) ran about twenty training-mode
  forwards on the user's model and left their updates in its BatchNorm buffers: after `wrap` a ResNet's
  `num_batches_tracked` read 20 and its running means had moved toward the sample batch;
- a block the plan checkpoints re-ran its forward in backward and updated its running statistics a second time
  (3 steps: `num_batches_tracked` 3 above plain PyTorch's; the running means and variances differed, and so did
  the model's outputs in `eval()`).
`agent/runtime/module_buffers.py` puts the buffers back in both places.
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from torch import nn

import agent
from agent.runtime.module_buffers import ChangedBuffers, RestoredBuffers, buffer_slots
from agent.testing.loops import train_with_clipping
from agent.testing.plans import offloaded_plan, offloaded_with_modes

TOL = 1e-5


def resnet() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    cfg = transformers.ResNetConfig(
        num_channels=3, embedding_size=16, hidden_sizes=[16, 32, 32, 64], depths=[1, 1, 2, 1], num_labels=10
    )
    model = transformers.ResNetForImageClassification(cfg)
    model.train()
    return model, {"pixel_values": torch.randn(4, 3, 32, 32), "labels": torch.randint(0, 10, (4,))}


def assert_same_state(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], tol: float) -> None:
    assert got.keys() == expected.keys()
    for name, want in expected.items():
        have = got[name]
        if want.dtype == torch.int64:  # num_batches_tracked
            assert torch.equal(have, want), (name, have, want)
        else:
            assert torch.allclose(have, want, rtol=tol, atol=tol), (name, (have - want).abs().max().item())


def test_profile_and_wrap_leave_the_models_buffers_as_they_were() -> None:
    model, batch = resnet()
    before = copy.deepcopy(model.state_dict())
    assert any(name.endswith("running_mean") for name in before)

    agent.profile(model, batch)
    assert_same_state(model.state_dict(), before, tol=0.0)

    run = agent.wrap(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        sample_batch=batch,
        device_memory=4 * 10**6,
        feedback_steps=None,
    )
    assert_same_state(run.model.state_dict(), before, tol=0.0)
    agent.unwrap(run)


@pytest.mark.parametrize("letter", ["C", "S"], ids=["checkpointed", "swapped"])
def test_blocks_update_running_statistics_once_a_forward(letter: str) -> None:
    model, batch = resnet()
    reference = copy.deepcopy(model)
    expected = train_with_clipping(
        reference, torch.optim.AdamW(reference.parameters(), lr=1e-2), batch, steps=3, max_norm=0.5
    )

    plan = offloaded_plan(model, batch)
    assert plan.policy is not None
    plan = offloaded_with_modes(plan, letter * (len(plan.policy.blocks) - 2))
    m = copy.deepcopy(model)
    run = agent.wrap(m, torch.optim.AdamW(m.parameters(), lr=1e-2), plan=plan, feedback_steps=None)
    got = train_with_clipping(run.model, run.optimizer, batch, steps=3, max_norm=0.5)
    if letter == "C":
        assert run.activations is not None and run.activations.counters.checkpointed_forwards == 3 * (
            len(plan.policy.blocks) - 2
        )
    for a, b in zip(got, expected, strict=True):
        assert abs(a - b) <= TOL * abs(b)
    assert_same_state(run.model.state_dict(), reference.state_dict(), tol=1e-4)

    reference.eval()
    run.model.eval()
    with torch.no_grad():
        want = reference(pixel_values=batch["pixel_values"]).logits
        have = run.model(pixel_values=batch["pixel_values"]).logits
    assert torch.allclose(have, want, rtol=1e-4, atol=1e-4), (have - want).abs().max().item()
    agent.unwrap(run)


class Stateful(nn.Module):
    """Buffers changed in the three ways a forward can: a batch norm's kernel (no version bump), an in-place
    update (a bump), an assignment (another tensor); and one it only reads."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(4)
        self.register_buffer("steps", torch.zeros(()))
        self.register_buffer("last", torch.zeros(4))
        self.register_buffer("table", torch.arange(4.0), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.steps.add_(1)
        self.last = x.detach().mean(0)
        return self.norm(x) * self.table


def test_changed_buffers_are_found_and_restored() -> None:
    m = Stateful()
    x = torch.randn(8, 4)
    changed = ChangedBuffers(m)
    with changed.watching():
        m(x)
    assert sorted(f"{type(s.module).__name__}.{s.name}" for s in changed.changed) == [
        "BatchNorm1d.num_batches_tracked",
        "BatchNorm1d.running_mean",
        "BatchNorm1d.running_var",
        "Stateful.last",
        "Stateful.steps",
    ]

    after_forward = {k: v.clone() for k, v in m.state_dict().items()}
    last = m.last
    with changed.restoring():
        m(2 * x)  # a recompute
    assert m.last is last
    assert_same_state(m.state_dict(), after_forward, tol=0.0)

    m.eval()  # no statistic is updated in eval(): only what the forward itself changes
    with changed.watching():
        m(x)
    assert {s.name for s in changed.changed} == {"steps", "last"}


def test_restored_buffers_put_back_every_buffer_after_an_error() -> None:
    m = Stateful()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    with pytest.raises(RuntimeError, match="boom"), RestoredBuffers(buffer_slots(m), to_host=True):
        m(torch.randn(8, 4))
        raise RuntimeError("boom")
    assert_same_state(m.state_dict(), before, tol=0.0)
