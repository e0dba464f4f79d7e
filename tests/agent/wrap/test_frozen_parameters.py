"""Adapter-style fine-tuning (LoRA-like): most parameters frozen (`requires_grad=False`), the optimizer over the
few that train. A frozen parameter has no gradient and no optimizer state, so such a job needs less device
memory than training every parameter: memplan must fit it wherever plain PyTorch fits it.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from agent.testing.loops import train_with_clipping
from agent.testing.model_zoo import build_with_library_defaults, sample_batch

pytestmark = pytest.mark.slow

STEPS = 3
TOL = 1e-5


def freeze_all_but_attention_q_v(model: nn.Module) -> None:
    """What a LoRA recipe leaves trainable (here the q/v projections themselves, no adapter modules)."""
    for name, p in model.named_parameters():
        p.requires_grad_("q_proj" in name or "v_proj" in name)


def adamw_over_trainable(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)


def train(model: nn.Module, opt: torch.optim.Optimizer, batch: dict[str, torch.Tensor]) -> list[float]:
    return train_with_clipping(model, opt, batch, steps=STEPS, max_norm=1.0)


def test_a_mostly_frozen_model_fits_within_2_percent_of_plain_pytorchs_peak() -> None:
    """Defect: the trace did not say which parameters train, so the planner counted a gradient and AdamW
    state for every frozen parameter too: wrap raised PlanInfeasibleError below 1.063x the peak the profiler
    measured for this very job. Now the model states are plain PyTorch's to the byte; what is left (0.44% on
    this model) is the planner's fragmentation margin on activations, which every plan keeps (offloading
    cannot trade for it here: a 2 MiB buffer costs more than a frozen chunk)."""
    import agent

    model, config = build_with_library_defaults("llama", layers=2, hidden=128, vocab=2048, seq=64)
    freeze_all_but_attention_q_v(model)
    batch = sample_batch(config, 2, 32)
    reference = copy.deepcopy(model)
    expected = train(reference, adamw_over_trainable(reference), batch)
    probe = copy.deepcopy(model)
    peak = agent.profile(
        probe, batch, optimizer=adamw_over_trainable(probe), repeats=1, allocation_trace=False
    ).measurements.peak_device_bytes

    wrapped = agent.wrap(
        model,
        adamw_over_trainable(model),
        sample_batch=batch,
        device_memory=int(peak * 1.02),
        feedback_steps=None,
    )
    got = train(wrapped.model, wrapped.optimizer, batch)
    for step, (a, b) in enumerate(zip(got, expected, strict=True)):
        assert abs(a - b) <= TOL * abs(b), f"step {step}: loss {a} vs plain {b}"
    assert all(not p.requires_grad for n, p in wrapped.model.named_parameters() if "mlp" in n)
