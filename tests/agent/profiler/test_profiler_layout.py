"""Block detection and parameter-to-block mapping are exact for gpt2, llama and gpt_neox."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from agent.profiler import BlockDetectionError, profile
from agent.testing.model_zoo import build, sample_batch
from client.contract import BlockKind, Hardware

# For each architecture: the repeated blocks' module prefix and the parameter names of prologue/epilogue.
EXPECTED = {
    "gpt2": (
        "transformer.h",
        {"transformer.wte.weight", "transformer.wpe.weight"},
        {"transformer.ln_f.weight", "transformer.ln_f.bias"},
    ),
    "llama": ("model.layers", {"model.embed_tokens.weight"}, {"model.norm.weight", "lm_head.weight"}),
    "gpt_neox": (
        "gpt_neox.layers",
        {"gpt_neox.embed_in.weight"},
        {"gpt_neox.final_layer_norm.weight", "gpt_neox.final_layer_norm.bias", "lm_head.weight"},
    ),
}


@pytest.mark.parametrize("kind", sorted(EXPECTED))
def test_blocks_and_parameter_mapping_are_exact(kind: str, cpu_hardware: Hardware) -> None:
    layers = 3
    model, config = build(kind, layers=layers, hidden=64, vocab=128, seq=16)
    trace = profile(
        model, sample_batch(config, 2, 16), hardware=cpu_hardware, repeats=1, allocation_trace=False
    )
    prefix, prologue, epilogue = EXPECTED[kind]

    blocks = trace.model.blocks
    assert [b.kind for b in blocks] == [BlockKind.prologue] + [BlockKind.block] * layers + [
        BlockKind.epilogue
    ]
    assert [b.name for b in blocks[1:-1]] == [f"{prefix}.{i}" for i in range(layers)]
    for b in blocks[1:-1]:
        assert model.get_submodule(b.name) is model.get_submodule(prefix)[b.index - 1]

    got = {p.name: p.block for p in trace.model.parameters}
    assert set(got) == {n for n, _ in model.named_parameters()}  # every parameter once, canonical names
    for name, block in got.items():
        m = re.match(rf"{re.escape(prefix)}\.(\d+)\.", name)
        if m:
            assert block == int(m.group(1)) + 1, name
        elif name in prologue:
            assert block == 0, name
        else:
            assert name in epilogue and block == layers + 1, name
    # execution order: blocks never go backwards along the parameter list
    order = [p.block for p in trace.model.parameters]
    assert order == sorted(order)
    named = dict(model.named_parameters())
    for p in trace.model.parameters:
        assert p.shape == list(named[p.name].shape) and p.bytes == named[p.name].numel() * 4


def test_tied_head_is_listed_once_at_its_first_use_with_its_alias(cpu_hardware: Hardware) -> None:
    model, config = build("gpt2", layers=2, hidden=64, vocab=128, seq=16)
    trace = profile(
        model, sample_batch(config, 2, 16), hardware=cpu_hardware, repeats=1, allocation_trace=False
    )
    first = trace.model.parameters[0]
    assert first.name == "transformer.wte.weight"
    assert first.block == 0
    assert first.aliases == ["lm_head.weight"]
    assert "lm_head.weight" not in {p.name for p in trace.model.parameters}


class TinyBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class PlainModel(nn.Module):
    """Not a Hugging Face model: embedding, an nn.ModuleList `blocks`, a head; returns logits."""

    def __init__(self, width: int = 32, depth: int = 3, vocab: int = 50) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(TinyBlock(width) for _ in range(depth))
        self.head = nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _ce(output: torch.Tensor, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return nn.functional.cross_entropy(output.flatten(0, 1), batch[0].flatten())


def test_plain_module_with_a_blocks_list_is_profiled(cpu_hardware: Hardware) -> None:
    model = PlainModel()
    batch = (torch.randint(0, 50, (2, 8)),)
    trace = profile(model, batch, loss_fn=_ce, hardware=cpu_hardware, repeats=1)
    assert [b.name for b in trace.model.blocks[1:-1]] == ["blocks.0", "blocks.1", "blocks.2"]
    assert trace.model.blocks[0].name == "prologue[embed]"
    assert trace.model.blocks[-1].name == "epilogue[head]"
    assert trace.workload.batch_size == 2 and trace.workload.sequence_length == 8


class Unstructured(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def test_model_without_blocks_gets_an_error_that_says_how_to_pass_them(cpu_hardware: Hardware) -> None:
    model = Unstructured()
    with pytest.raises(BlockDetectionError, match=r"blocks=\["):
        profile(model, (torch.randn(2, 8),), loss_fn=lambda o, b: o.sum(), hardware=cpu_hardware)


def test_explicit_blocks_override_detection(cpu_hardware: Hardware) -> None:
    model = Unstructured()
    trace = profile(
        model,
        (torch.randn(2, 8),),
        loss_fn=lambda o, b: o.sum(),
        blocks=[model.a, model.b],
        hardware=cpu_hardware,
        repeats=1,
    )
    assert [b.name for b in trace.model.blocks] == ["prologue[-]", "a", "b", "epilogue[-]"]
    assert [p.block for p in trace.model.parameters] == [1, 1, 2, 2]


def test_blocks_that_are_not_submodules_are_rejected_naming_the_entry(cpu_hardware: Hardware) -> None:
    model = Unstructured()
    with pytest.raises(BlockDetectionError, match=r"blocks\[1\]"):
        profile(
            model,
            (torch.randn(2, 8),),
            loss_fn=lambda o, b: o.sum(),
            blocks=[model.a, nn.Linear(2, 2)],
            hardware=cpu_hardware,
        )


def test_fingerprint_is_stable_for_a_config_and_differs_between_configs() -> None:
    from agent.profiler.parameters import fingerprint

    a, _ = build("llama", layers=2, hidden=32, vocab=64, seq=8, seed=1)
    b, _ = build("llama", layers=2, hidden=32, vocab=64, seq=8, seed=2)
    c, _ = build("llama", layers=3, hidden=32, vocab=64, seq=8)
    assert fingerprint(a) == fingerprint(b)
    assert fingerprint(a) != fingerprint(c)
