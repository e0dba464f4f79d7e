"""Architecture matrix: Hugging Face causal-LM families as users get them, through `import agent; agent.wrap`.

Each family is built from its config with the library's defaults (KV cache on, SDPA or the family's own
attention, tied embeddings where the family ties them: `agent.testing.model_zoo.build_with_library_defaults`; only
sizes and token ids are set), profiled with no measurement skipped, and trained 5 steps under a device limit
that makes the planner offload parameter chunks; the losses equal plain PyTorch's within 1e-5 relative (fp32).
Afterwards `unwrap` gives back the user's cache settings.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import pytest
import torch
from torch import nn

from agent.testing.loops import train_with_clipping, uploads_in_one_step
from agent.testing.model_zoo import DEFAULTS_FAMILIES, build_with_library_defaults, sample_batch

pytestmark = pytest.mark.slow

MAX_GRAD_NORM = 1.0  # clipping as Trainer does it: torch.nn.utils.clip_grad_norm_ on the model's parameters
FAMILIES = DEFAULTS_FAMILIES  # 24 families: gpt2, llama, mistral, qwen2/3, gemma/2/3, falcon, phi/3, MoE (mixtral, qwen2_moe), ...
STEPS = 5
TOL = 1e-5
LIMIT_FRACTION = 0.7  # of the un-managed peak: the model's states no longer all fit
# OPT here (vocab 2048, hidden 128) has a tied embedding whose gradient from the lm_head use autograd holds through
# every block's backward (1 MiB, `planner_service/solver/held_gradients.py`): its smallest plan measures 7,340,040
# bytes, over 0.7 of the un-managed peak with the margin (the plan chosen at 0.7 before that was counted measured
# +16.7% over its prediction)
LIMIT_FRACTION_OF = {"opt": 0.8}


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)


def train(model: nn.Module, opt: torch.optim.Optimizer, batch: dict[str, torch.Tensor]) -> list[float]:
    return train_with_clipping(model, opt, batch, steps=STEPS, max_norm=MAX_GRAD_NORM)


@pytest.mark.parametrize("family", FAMILIES)
def test_family_with_library_defaults_trains_offloaded_like_plain_pytorch(
    family: str, caplog: pytest.LogCaptureFixture
) -> None:
    model, config = build_with_library_defaults(family, layers=2, hidden=128, vocab=2048, seq=64)
    check(family, model, config, caplog)


@pytest.mark.parametrize("family", ["llama", "falcon", "qwen2"])
def test_eager_attention_with_the_cache_on_trains_like_plain_pytorch(
    family: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Eager attention made `agent.profile` crash before (re-running a block appended to the KV cache)."""
    from transformers import AutoModelForCausalLM

    from agent.testing.model_zoo import library_default_config

    config = library_default_config(family, layers=2, hidden=128, vocab=2048, seq=64)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    model.train()
    assert model.config._attn_implementation == "eager"
    check(f"{family}-eager", model, config, caplog)


def check(family: str, model: nn.Module, config: Any, caplog: pytest.LogCaptureFixture) -> None:
    import agent

    batch = sample_batch(config, 2, 32)
    assert model.config.use_cache is True, "the library default is the point of this test"
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    if getattr(model.config, "tie_word_embeddings", False):
        assert tied, f"{family}: the library ties the embeddings, the model built here must too"

    reference = copy.deepcopy(model)
    expected = train(reference, adamw(reference), batch)
    probe = copy.deepcopy(model)
    peak = agent.profile(
        probe, batch, optimizer=adamw(probe), repeats=1, allocation_trace=False
    ).measurements.peak_device_bytes
    assert probe.config.use_cache is True  # agent.profile gives the setting back

    caplog.set_level(logging.WARNING, logger="agent")
    wrapped = agent.wrap(
        model,
        adamw(model),
        sample_batch=batch,
        device_memory=int(peak * LIMIT_FRACTION_OF.get(family, LIMIT_FRACTION)),
        feedback_steps=None,
    )
    skipped = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert not skipped, f"{family}: a measurement was skipped: {skipped}"
    trace = wrapped.source.trace
    assert trace is not None
    repeated = [b for b in trace.measurements.blocks if 0 < b.block < len(trace.measurements.blocks) - 1]
    assert all(b.swap_out_s > 0 or b.offload_overhead_s > 0 for b in repeated), (
        f"{family}: runtime costs were not measured: {repeated}"
    )
    policy = wrapped.plan.policy
    assert policy is not None
    assert any(c.placement.value == "offloaded" for c in policy.chunks), (
        f"{family}: the limit did not make the planner offload: {policy.mode_strip()} {policy.chunks}"
    )
    assert model.config.use_cache is False  # off while training

    got = train(wrapped.model, wrapped.optimizer, batch)
    for step, (a, b) in enumerate(zip(got, expected, strict=True)):
        assert abs(a - b) <= TOL * abs(b), f"{family} step {step}: loss {a} vs plain {b}"
    # the planner counts the chunk uploads of an iteration as the runtime makes them (a tied embedding's chunk
    # used again by lm_head: uploaded again, and the chunk it displaces too; `late_uses.py`)
    assert wrapped.plan.predictions is not None
    uploads = uploads_in_one_step(wrapped, batch, max_norm=MAX_GRAD_NORM)
    predicted = wrapped.plan.predictions.breakdown["uploads_per_iteration"]
    assert uploads == predicted, f"{family}: {uploads} uploads in an iteration, the plan counted {predicted}"
    agent.unwrap(wrapped)
    assert model.config.use_cache is True
    generation = getattr(model, "generation_config", None)
    assert generation is None or generation.use_cache is not False
