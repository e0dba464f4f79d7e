"""The profiler records, per tied or shared parameter, the blocks that use it (`ParameterInfo.use_blocks`).

Real Hugging Face models at library defaults (GPT-2 and T5 tie their embeddings; Llama when asked to with
`tie_word_embeddings=True`; T5's epilogue, the whole decoder, has a name cut to the limit), and plain modules
for what those do not show: a tied pair run by a prologue whose name is cut before it (the name-based fallback
counted its gradient through every block), a module called by two blocks under one name (no alias: nothing
counted it), and a parameter every block uses, profiled on a truncated model (`max_blocks`).
"""

from __future__ import annotations

import pytest
import torch
import transformers
from torch import nn

from agent.profiler import profile
from agent.testing.model_zoo import build_with_library_defaults, library_default_config, sample_batch
from client.contract import Hardware, ParameterInfo, Trace
from client.contract.common import MAX_NAME_CHARS
from planner_service.solver.held_gradients import held_gradient_bytes

LAYERS = 2


def _recorded(trace: Trace) -> dict[str, list[int]]:
    return {p.name: p.use_blocks for p in trace.model.parameters if p.use_blocks}


def _without_uses(params: list[ParameterInfo]) -> list[ParameterInfo]:
    """The parameters as a trace from before `use_blocks` carried them."""
    return [p.model_copy(update={"use_blocks": []}) for p in params]


def _profile(model: nn.Module, batch: object, hardware: Hardware, **kw: object) -> Trace:
    return profile(model, batch, hardware=hardware, repeats=1, allocation_trace=False, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("family", "tied_name"),
    [("gpt2", "transformer.wte.weight"), ("llama", "model.embed_tokens.weight")],
)
def test_a_tied_input_and_output_embedding_is_used_by_the_prologue_and_the_epilogue(
    family: str, tied_name: str, cpu_hardware: Hardware
) -> None:
    if family == "llama":
        config = library_default_config(family, layers=LAYERS, hidden=64, vocab=256, seq=32)
        config.tie_word_embeddings = True
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config)
        model.train()
    else:
        model, config = build_with_library_defaults(family, layers=LAYERS, hidden=64, vocab=256, seq=32)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    trace = _profile(model, sample_batch(config, 2, 16), cpu_hardware)
    assert _recorded(trace) == {tied_name: [0, LAYERS + 1]}
    tied = next(p for p in trace.model.parameters if p.name == tied_name)
    assert tied.aliases == ["lm_head.weight"]
    held = held_gradient_bytes(trace.model.blocks, trace.model.parameters)
    assert held == (tied.bytes,) * (LAYERS + 1) + (0,)
    assert held == held_gradient_bytes(trace.model.blocks, _without_uses(trace.model.parameters))


def test_t5_whose_epilogue_name_is_cut_records_its_shared_embedding_at_both_ends(
    cpu_hardware: Hardware,
) -> None:
    config = transformers.T5Config(
        vocab_size=256,
        d_model=64,
        d_kv=32,
        d_ff=128,
        num_layers=LAYERS,
        num_heads=2,
        decoder_start_token_id=0,
    )
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(config)
    model.train()
    ids = torch.randint(2, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    trace = _profile(model, {"input_ids": ids, "labels": ids}, cpu_hardware)
    epilogue = trace.model.blocks[-1].name
    assert len(epilogue) == MAX_NAME_CHARS and epilogue.endswith("...]")  # the decoder's modules, cut
    assert "lm_head" not in epilogue
    assert _recorded(trace) == {"shared.weight": [0, LAYERS + 1]}
    shared = trace.model.parameters[0]
    assert shared.aliases == ["encoder.embed_tokens.weight", "decoder.embed_tokens.weight", "lm_head.weight"]
    assert held_gradient_bytes(trace.model.blocks, trace.model.parameters) == (shared.bytes,) * (
        LAYERS + 1
    ) + (0,)


class TinyBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


STEM = 40  # 40 paths of 30 characters: the prologue's name is cut after about 16


class LongStem(nn.Module):
    """A prologue of many modules (a dict, so not taken for the repeated blocks); the last one's weight is
    tied to the first's, both run by the prologue."""

    def __init__(self, width: int = 16, vocab: int = 50) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.stem = nn.ModuleDict(
            {f"projection_number_{i:02d}": nn.Linear(width, width) for i in range(STEM)}
        )
        self.stem[f"projection_number_{STEM - 1:02d}"].weight = self.stem["projection_number_00"].weight
        self.blocks = nn.ModuleList(TinyBlock(width) for _ in range(LAYERS))
        self.head = nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for m in self.stem.values():
            x = torch.tanh(m(x))
        for b in self.blocks:
            x = b(x)
        return self.head(x)


class SharedProjection(nn.Module):
    """One module called by the prologue and again by the epilogue: one name, no alias."""

    def __init__(self, width: int = 16, vocab: int = 50) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.proj = nn.Linear(width, width)
        self.blocks = nn.ModuleList(TinyBlock(width) for _ in range(LAYERS))
        self.head = nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.proj(self.embed(ids))
        for b in self.blocks:
            x = b(x)
        return self.head(self.proj(x))


class SharedBlock(nn.Module):
    def __init__(self, width: int, shared: nn.Linear) -> None:
        super().__init__()
        self.own = TinyBlock(width)
        self.shared = shared

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.own(x) + self.shared(x)


class SharedInEveryBlock(nn.Module):
    """Every repeated block calls one shared module (the same parameters under each block's name)."""

    def __init__(self, width: int = 16, vocab: int = 50, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        shared = nn.Linear(width, width)
        self.blocks = nn.ModuleList(SharedBlock(width, shared) for _ in range(depth))
        self.head = nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _ce(output: torch.Tensor, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return nn.functional.cross_entropy(output.flatten(0, 1), batch[0].flatten())


def _ids() -> tuple[torch.Tensor]:
    return (torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(0)),)


def test_a_tie_inside_a_cut_prologue_holds_nothing_where_the_names_said_every_block(
    cpu_hardware: Hardware,
) -> None:
    torch.manual_seed(0)
    trace = _profile(LongStem(), _ids(), cpu_hardware, loss_fn=_ce)
    prologue = trace.model.blocks[0].name
    assert prologue.endswith("...]") and f"projection_number_{STEM - 1:02d}" not in prologue
    assert _recorded(trace) == {"stem.projection_number_00.weight": [0]}
    params = trace.model.parameters
    assert held_gradient_bytes(trace.model.blocks, params) == (0,) * (LAYERS + 2)
    tied = next(p for p in params if p.aliases)
    before = held_gradient_bytes(trace.model.blocks, _without_uses(params))  # the name-based fallback
    assert before == (tied.bytes,) * (LAYERS + 1) + (0,)


def test_a_module_called_by_two_blocks_under_one_name_holds_its_gradient(cpu_hardware: Hardware) -> None:
    torch.manual_seed(0)
    trace = _profile(SharedProjection(), _ids(), cpu_hardware, loss_fn=_ce)
    assert _recorded(trace) == {"proj.weight": [0, LAYERS + 1], "proj.bias": [0, LAYERS + 1]}
    proj = sum(p.bytes for p in trace.model.parameters if p.name.startswith("proj."))
    assert held_gradient_bytes(trace.model.blocks, trace.model.parameters) == (proj,) * (LAYERS + 1) + (0,)
    # before: no alias, so no held gradient
    assert held_gradient_bytes(trace.model.blocks, _without_uses(trace.model.parameters)) == (0,) * (
        LAYERS + 2
    )


def test_a_truncated_profile_gives_the_unprofiled_blocks_the_uses_of_the_block_they_copy(
    cpu_hardware: Hardware,
) -> None:
    torch.manual_seed(0)
    model = SharedInEveryBlock()
    full = _recorded(_profile(model, _ids(), cpu_hardware, loss_fn=_ce))
    truncated = _profile(model, _ids(), cpu_hardware, loss_fn=_ce, max_blocks=2)
    assert truncated.measurements.extrapolated
    assert full == {"blocks.0.shared.weight": [1, 2, 3, 4], "blocks.0.shared.bias": [1, 2, 3, 4]}
    assert _recorded(truncated) == full
