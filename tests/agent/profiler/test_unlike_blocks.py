"""Extrapolation over repeated blocks that are not all alike: each unprofiled block copies a profiled
block of its own kind (parameter signature), the profiled prefix holds every kind, and what cannot be
profiled is said in terms the user controls."""

from __future__ import annotations

import pytest
import torch
import transformers
from torch import nn

from agent.profiler import profile
from agent.profiler.block_detection import BlockDetectionError, detect_blocks
from agent.profiler.extrapolation import block_kinds, covering_prefix, profiled_prefix
from agent.testing.model_zoo import sample_batch
from client.contract import Hardware


def rwkv(layers: int) -> tuple[nn.Module, transformers.RwkvConfig]:
    config = transformers.RwkvConfig(
        vocab_size=128,
        hidden_size=32,
        num_hidden_layers=layers,
        attention_hidden_size=32,
        intermediate_size=64,
    )
    torch.manual_seed(0)
    return transformers.RwkvForCausalLM(config), config


class Hybrid(nn.Module):
    """A periodic hybrid stack: wide, narrow, wide, narrow, ... (as Jamba alternates Mamba and attention)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))
            if i % 2 == 0
            else nn.Sequential(nn.Linear(16, 16))
            for i in range(n)
        )


def test_rwkv_block_zero_is_its_own_kind_and_the_others_copy_block_one(cpu_hardware: Hardware) -> None:
    model, config = rwkv(4)
    repeated = detect_blocks(model)
    assert block_kinds(repeated) == [0, 1, 1, 1]  # block 0 alone has `pre_ln`
    trace = profile(model, sample_batch(config, 2, 8), hardware=cpu_hardware, max_blocks=2, repeats=1)
    m = trace.measurements
    assert m.extrapolated and m.profiled_blocks == [0, 1, 2, 5]
    assert {p.name for p in trace.model.parameters} == {n for n, _ in model.named_parameters()}
    for p in trace.model.parameters:  # every copied block lists its own parameters, not block 1's
        if p.name.startswith("rwkv.blocks."):
            assert p.block == int(p.name.split(".")[2]) + 1
    sizes = [sum(p.numel() * p.element_size() for p in b.parameters()) for b in model.rwkv.blocks]
    assert [b.parameter_bytes for b in trace.model.blocks[1:-1]] == sizes
    for b in m.blocks[3:5]:
        assert b.model_dump(exclude={"block"}) == m.blocks[2].model_dump(exclude={"block"})


def test_t5_under_a_limit_profiles_encoder_blocks_0_and_1_and_extrapolates_the_rest(
    cpu_hardware: Hardware,
) -> None:
    """T5 at library defaults: detection takes `encoder.block` (the decoder is the epilogue); block 0
    alone holds `relative_attention_bias`. Before, extrapolation copied block 0 onto block 1 and raised."""
    config = transformers.T5Config(vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=3, num_heads=2)
    config.decoder_start_token_id = 0  # as the published t5 configs say; this release has no default
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(config)
    repeated = detect_blocks(model)
    assert repeated.container_name == "encoder.block" and block_kinds(repeated) == [0, 1, 1]
    states = sum(p.numel() * (2 * p.element_size() + 8) for p in model.parameters())
    trace = profile(
        model, sample_batch(config, 2, 8), hardware=cpu_hardware, device_memory_limit=states, repeats=1
    )
    m = trace.measurements
    assert m.extrapolated and m.profiled_blocks == [0, 1, 2, 4]
    assert {p.name for p in trace.model.parameters} == {n for n, _ in model.named_parameters()}
    assert {p.block for p in trace.model.parameters if p.name.startswith("encoder.block.2.")} == {3}
    assert m.blocks[3].model_dump(exclude={"block"}) == m.blocks[2].model_dump(exclude={"block"})


def test_an_explicit_max_blocks_that_misses_a_kind_is_refused_before_profiling() -> None:
    model, config = rwkv(3)
    with pytest.raises(ValueError, match=r"max_blocks: 1 .*'rwkv.blocks.1'.* at least 2"):
        profile(model, sample_batch(config, 2, 8), max_blocks=1, repeats=1)


def test_under_a_limit_the_profiled_prefix_holds_every_kind() -> None:
    model, _ = rwkv(4)
    repeated = detect_blocks(model)
    total = 10 << 20
    assert profiled_prefix(repeated, total, capacity=total, free=None) == 2  # budget fits 1 block: 2 cover
    hybrid = detect_blocks(Hybrid(6))
    assert block_kinds(hybrid) == [0, 1, 0, 1, 0, 1] and covering_prefix(block_kinds(hybrid)) == 2
    assert profiled_prefix(hybrid, 1 << 20, capacity=1 << 20, free=None) == 2
    assert profiled_prefix(detect_blocks(Hybrid(2)), 1 << 20, capacity=1 << 20, free=None) is None  # all


def test_a_prefix_that_cannot_be_profiled_on_the_device_names_what_the_user_controls() -> None:
    hybrid = detect_blocks(Hybrid(4))
    with pytest.raises(BlockDetectionError) as caught:
        profiled_prefix(hybrid, 1 << 20, capacity=1 << 10, free=1 << 10)
    message = str(caught.value)
    assert "'layers.1'" in message and "blocks=" in message and "device_memory" in message
    assert "max_blocks" not in message


class ReadsItsWeight(nn.Module):
    """A block that passes a child's weight to a function instead of calling the child (as Jamba's Mamba
    mixer hands `conv1d.weight` to its kernel): no module call reaches `side`."""

    def __init__(self) -> None:
        super().__init__()
        self.main = nn.Linear(8, 8)
        self.side = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.main(x) + nn.functional.linear(x, self.side.weight)


class Reader(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.blocks = nn.ModuleList(ReadsItsWeight() for _ in range(2))
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def test_a_weight_no_module_call_reaches_stays_in_its_block(cpu_hardware: Hardware) -> None:
    """Defect: such a parameter was listed after the epilogue, and the planner refused the trace
    ('block: 1 comes after block 3; ... each block's parameters contiguous')."""
    model = Reader()
    trace = profile(
        model, torch.randn(2, 4), loss_fn=lambda out, _: out.sum(), hardware=cpu_hardware, repeats=1
    )
    blocks = [p.block for p in trace.model.parameters]
    assert blocks == sorted(blocks)
    assert [p.name for p in trace.model.parameters if p.block == 1] == [
        "blocks.0.main.weight",
        "blocks.0.main.bias",
        "blocks.0.side.weight",
        "blocks.0.side.bias",
    ]
