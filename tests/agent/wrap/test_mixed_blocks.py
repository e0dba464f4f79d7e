"""Models whose repeated blocks are not all alike: hybrid stacks (Jamba: Mamba and attention layers in one
`nn.ModuleList`, passed as `blocks=` or found by the profiler; OLMo-hybrid: linear and full attention layers;
Zamba2: Mamba layers and hybrid layers sharing one transformer block) and RWKV (block 0 carries an extra
`pre_ln`). Session 20 probe: detection found no same-class list in Jamba and OLMo-hybrid (BlockDetectionError
on the user's first call) and picked two LoRA adapters inside one Zamba2 layer as the blocks; now the list of
`config.num_hidden_layers` layers is the blocks, whatever their classes. Under a device limit small enough that the profiler extrapolates (profiles the first blocks and
copies their figures to the rest), wrap must still work and train like plain PyTorch.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import transformers
from torch import nn

from agent.profiler.block_detection import detect_blocks
from agent.testing.loops import train_with_clipping
from agent.testing.model_zoo import sample_batch

pytestmark = pytest.mark.slow

STEPS = 3
TOL = 1e-5
LIMIT_FRACTION = 0.7
TOKENS: dict[str, Any] = {"vocab_size": 2048, "bos_token_id": 0, "eos_token_id": 2047, "pad_token_id": 1}


def jamba() -> tuple[nn.Module, Any, list[nn.Module]]:
    config = transformers.JambaConfig(
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=256,
        num_experts=2,
        num_experts_per_tok=1,
        mamba_d_state=8,
        mamba_dt_rank=8,
        attn_layer_period=2,
        attn_layer_offset=1,
        expert_layer_period=2,
        expert_layer_offset=1,
        use_mamba_kernels=False,
        **TOKENS,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    return model, config, list(model.model.layers)


def jamba_detected() -> tuple[nn.Module, Any, None]:
    model, config, _ = jamba()
    return model, config, None


def olmo_hybrid() -> tuple[nn.Module, Any, None]:
    config = transformers.AutoConfig.for_model(
        "olmo_hybrid",
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=256,
        max_position_embeddings=128,
        **TOKENS,
    )
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config), config, None


def zamba2() -> tuple[nn.Module, Any, None]:
    config = transformers.AutoConfig.for_model(
        "zamba2",
        hidden_size=128,
        num_hidden_layers=4,
        layers_block_type=["mamba", "hybrid", "mamba", "hybrid"],
        num_attention_heads=2,
        num_key_value_heads=2,
        intermediate_size=256,
        max_position_embeddings=128,
        mamba_d_state=8,
        mamba_ngroups=1,
        n_mamba_heads=8,
        use_mamba_kernels=False,
        **TOKENS,
    )
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config), config, None


def rwkv() -> tuple[nn.Module, Any, None]:
    config = transformers.RwkvConfig(
        hidden_size=128, num_hidden_layers=2, attention_hidden_size=128, intermediate_size=256, **TOKENS
    )
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config), config, None


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


def train(model: nn.Module, opt: torch.optim.Optimizer, batch: dict[str, torch.Tensor]) -> list[float]:
    return train_with_clipping(model, opt, batch, steps=STEPS, max_norm=1.0)


@pytest.mark.parametrize(
    "make",
    [jamba, jamba_detected, olmo_hybrid, zamba2, rwkv],
    ids=["jamba-blocks-given", "jamba", "olmo_hybrid", "zamba2", "rwkv"],
)
def test_unlike_blocks_under_a_limit_train_like_plain_pytorch(make: Any) -> None:
    """Defect: extrapolation copied block 1's parameter names onto block 2 and raised
    BlockDetectionError("max_blocks: block 'model.layers.1' has no 'model.layers.1.mamba.A_log'; blocks
    differ") from wrap, naming an argument (`max_blocks`) the user never passed."""
    import agent

    model, config, blocks = make()
    model.train()
    batch = sample_batch(config, 2, 32)
    given: dict[str, Any] = {"blocks": blocks} if blocks is not None else {}
    reference = copy.deepcopy(model)
    expected = train(reference, adamw(reference), batch)
    probe = copy.deepcopy(model)
    probe_blocks = {"blocks": list(probe.model.layers)} if blocks is not None else {}
    if hasattr(model, "model") and blocks is None:  # the hybrids: found by the profiler, the whole layer list
        assert detect_blocks(model).names == tuple(
            f"model.layers.{i}" for i in range(len(model.model.layers))
        )
    peak = agent.profile(
        probe, batch, optimizer=adamw(probe), repeats=1, allocation_trace=False, **probe_blocks
    ).measurements.peak_device_bytes

    wrapped = agent.wrap(
        model,
        adamw(model),
        sample_batch=batch,
        device_memory=int(peak * LIMIT_FRACTION),
        feedback_steps=None,
        **given,
    )
    got = train(wrapped.model, wrapped.optimizer, batch)
    for step, (a, b) in enumerate(zip(got, expected, strict=True)):
        assert abs(a - b) <= TOL * abs(b), f"step {step}: loss {a} vs plain {b}"
