"""fp16 mixed precision with a loss scaler (`torch.amp.GradScaler`), as Trainer(fp16=True) and GPUs without bf16
train: the scaled loss's backward, `unscale_` (in place on every `.grad`, offloaded ones on the host), clipping,
`scaler.step` (which skips `optimizer.step()` when a gradient is inf or nan) and `scaler.update`. Session 22
probe: docs/architecture/runtime.md listed this as untested (a skipped step must undo the host steps the runtime
overlapped with backward); it trains exactly as plain PyTorch, skipped steps included.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import agent
from agent.testing.model_zoo import build_with_library_defaults, sample_batch
from agent.testing.plans import offloaded_plan

pytestmark = pytest.mark.slow

STEPS = 6
INIT_SCALE = (
    2.0**22
)  # this model's first three scaled backwards overflow fp16 (steps skipped), the rest do not


def train(
    model: nn.Module, opt: torch.optim.Optimizer, batch: dict[str, torch.Tensor]
) -> list[tuple[float, float]]:
    """Per step the loss and the loss scale after `update()` (halved after a skipped step)."""
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
    torch.manual_seed(0)
    out = []
    for _ in range(STEPS):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(**batch).loss
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        out.append((loss.item(), scaler.get_scale()))
    return out


@pytest.mark.parametrize("stepped", ["wrapped", "original"])
def test_fp16_with_a_grad_scaler_and_skipped_steps_trains_like_plain_pytorch(stepped: str) -> None:
    """`stepped`: the scaler steps the wrapped optimizer, or the one given to `wrap` (its alias: a fused AdamW
    says it checks the scaler's inf flag in its own step, which the alias must not claim, or the overflowing
    steps were taken: session 23)."""
    model, cfg = build_with_library_defaults("llama", 4, 128, vocab=1000, seq=128)
    batch = sample_batch(cfg, 2, 64)
    reference = copy.deepcopy(model)
    expected = train(reference, torch.optim.AdamW(reference.parameters(), lr=1e-3, fused=True), batch)
    scales = [s for _, s in expected]
    skipped = sum(1 for before, after in zip([INIT_SCALE, *scales], scales, strict=False) if after < before)
    assert 1 <= skipped <= STEPS - 2, expected  # some steps skipped, some taken

    m = copy.deepcopy(model)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True)
    run = agent.wrap(m, opt, plan=offloaded_plan(model, batch), feedback_steps=None)
    got = train(run.model, run.optimizer if stepped == "wrapped" else opt, batch)
    assert run.runtime.counters.uploads > 0
    assert (
        run.runtime.counters.host_step_undos > 0
    )  # a skipped step undid the host steps overlapped with backward
    assert [s for _, s in got] == scales
    for (a, _), (b, _) in zip(got, expected, strict=True):
        assert abs(a - b) <= 1e-5 * abs(b), (got, expected)
    final = dict(run.model.named_parameters())
    for name, p in reference.named_parameters():
        assert torch.allclose(final[name], p, rtol=1e-5, atol=1e-6), name
    agent.unwrap(run)
