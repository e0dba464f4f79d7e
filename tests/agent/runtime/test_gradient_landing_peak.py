"""Plans for Llama (library defaults, untied and with `tie_word_embeddings=True`) and T5 (tied, its epilogue's
name cut) peak within the repo's bounds of their predictions: at most 2% above, at most 8% below.

The defect (session 9): the profiler read a block's backward transient above the higher of the levels at its
start and its end, and in the plain profiled iteration the block's own gradients land in `.grad` and stay, so
the level at the end had them and the transient did not. The runtime moves each gradient into its chunk's
gradient area (counted apart, as model state) as it lands, so the fresh gradient is live beside that area at
its landing. With the vocabulary's head in the epilogue (2048 x 128 fp32, 1 MiB) the peak is the epilogue's
backward, where the head's gradient is produced. A tied head's gradient does not land there (autograd holds
it until the embedding's backward), so the level at the epilogue's end had it and the transient did not.
Errors (measured / predicted - 1) before -> after: Llama +5.97% -> +0.00%, Llama tied +5.34% -> +0.00%,
T5 -4.77% -> +0.00% (docs/BENCHMARKS.md). Now a backward transient is read above the level at the block's
start, net of each gradient from its landing on (`BlockTracker.land`).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from runtime_helpers import measured_peak
from torch import nn

import agent
from agent.testing.model_zoo import library_default_config, sample_batch
from client.contract import Constraints
from planner_service.solver import solve

pytestmark = pytest.mark.slow

STEPS = 4
FRACTION = 0.6  # of the un-managed peak: every chunk of Llama offloaded, one buffer


def llama(tied: bool) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    config = library_default_config("llama", layers=4, hidden=128, vocab=2048, seq=64)
    config.tie_word_embeddings = tied
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.train()
    return model, sample_batch(config, 2, 32)


def t5() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    config = transformers.T5Config(
        vocab_size=2048, d_model=128, d_kv=64, d_ff=256, num_layers=4, num_heads=2, decoder_start_token_id=0
    )
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(config)
    model.train()
    ids = torch.randint(2, 2048, (2, 32), generator=torch.Generator().manual_seed(0))
    return model, {"input_ids": ids, "labels": ids}


def measured_and_predicted(model: nn.Module, batch: dict[str, Any], tmp_path: Path) -> tuple[int, int]:
    probe = copy.deepcopy(model)
    trace = agent.profile(
        probe,
        batch,
        optimizer=torch.optim.AdamW(probe.parameters(), lr=1e-3, fused=True),
        repeats=1,
        allocation_trace=False,
    )
    limit = int(trace.measurements.peak_device_bytes * FRACTION)
    plan = solve(trace, Constraints(device_memory_bytes=limit, time_limit_s=5.0))
    assert plan.policy is not None and plan.predictions is not None, plan.solver.message
    assert any(c.placement.value == "offloaded" for c in plan.policy.chunks)
    return measured_peak(
        model, batch, plan, steps=STEPS, tmp_path=tmp_path
    ), plan.predictions.peak_device_bytes


@pytest.mark.parametrize("case", ["llama", "llama-tied", "t5"])
def test_a_plan_peaks_within_bounds_of_its_prediction_with_the_heads_gradient_counted(
    case: str, tmp_path: Path
) -> None:
    model, batch = t5() if case == "t5" else llama(tied=case == "llama-tied")
    measured, predicted = measured_and_predicted(model, batch, tmp_path)
    error = measured / predicted - 1
    assert -0.08 <= error <= 0.02, (case, measured, predicted, f"{error:+.2%}")
