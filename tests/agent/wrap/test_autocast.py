"""Mixed precision by autocast (bf16 on the CPU), the way most fine-tuning runs: fp32 parameters, the forward under
`torch.autocast`, through `import agent; agent.wrap` (session 22 probe; no test ran memplan under autocast before).

- Training matches plain PyTorch under the same autocast: every chunk offloaded, blocks kept, checkpointed and
  swapped, clipping (losses within 1e-5 relative; the first step's gradients are bitwise equal).
- `agent.wrap` called inside the autocast context profiles the forward as training runs it: the trace's block
  activations are the bf16 ones (the README says so; `wrap_trainer` enters the Trainer's own autocast:
  `tests/agent/integrations/test_hf_trainer.py`).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import agent
from agent.testing.loops import train_with_clipping
from agent.testing.model_zoo import build_with_library_defaults, sample_batch
from agent.testing.plans import offloaded_plan

pytestmark = pytest.mark.slow

TOL = 1e-5
STEPS = 3


def bf16() -> torch.autocast:
    return torch.autocast("cpu", dtype=torch.bfloat16)


def train(model: nn.Module, opt: torch.optim.Optimizer, batch: dict[str, torch.Tensor]) -> list[float]:
    return train_with_clipping(model, opt, batch, steps=STEPS, max_norm=0.5, forward_context=bf16)


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_training_under_autocast_matches_plain_pytorch(family: str) -> None:
    model, cfg = build_with_library_defaults(family, 4, 128, vocab=1000, seq=128)
    batch = sample_batch(cfg, 2, 64)
    reference = copy.deepcopy(model)
    expected = train(reference, adamw(reference), batch)

    m = copy.deepcopy(model)
    run = agent.wrap(m, adamw(m), plan=offloaded_plan(model, batch), feedback_steps=None)
    got = train(run.model, run.optimizer, batch)
    assert run.runtime.counters.uploads > 0
    assert run.activations is not None and run.activations.counters.checkpointed_forwards > 0
    for a, b in zip(got, expected, strict=True):
        assert abs(a - b) <= TOL * abs(b), (run.plan.policy.mode_strip(), got, expected)
    agent.unwrap(run)


def test_wrap_inside_autocast_profiles_the_half_precision_activations() -> None:
    model, cfg = build_with_library_defaults("llama", 4, 128, vocab=1000, seq=128)
    batch = sample_batch(cfg, 4, 128)
    in_fp32 = agent.profile(copy.deepcopy(model), batch, repeats=1, allocation_trace=False)
    with bf16():
        under = agent.profile(copy.deepcopy(model), batch, repeats=1, allocation_trace=False)
    fp32_act = in_fp32.measurements.blocks[1].activation_bytes
    bf16_act = under.measurements.blocks[1].activation_bytes
    assert bf16_act < 0.9 * fp32_act  # the matmuls' saved inputs are bf16

    m = copy.deepcopy(model)
    limit = int(0.7 * in_fp32.measurements.peak_device_bytes)
    with bf16():
        run = agent.wrap(m, adamw(m), sample_batch=batch, device_memory=limit, feedback_steps=None)
    assert run.source is not None and run.source.trace is not None
    assert run.source.trace.measurements.blocks[1].activation_bytes == bf16_act
    agent.unwrap(run)
