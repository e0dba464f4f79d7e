"""One block module run several times per forward (session 24 probe): weights shared across layers.

ALBERT (`AlbertForMaskedLM` at its library defaults) runs its one shared layer group once per layer, and a plain
model may hold one block N times (`nn.ModuleList([block] * n)`, a looped transformer). Before: with the block
swapped, the block's second call made the swap store forget the first call's tensors, and backward failed ("a
swapped tensor was unpacked after its host copy was released"); and the N places of one module were N blocks
whose paths but the first do not exist (`named_modules` lists a module once), so a checkpointed or swapped plan
was refused naming `layers.1`. Now the module is one block that runs several times, whose calls' swapped tensors
are kept together until its backward; training equals plain PyTorch's in every mode.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import transformers
from torch import nn

import agent
from agent.profiler.block_detection import detect_blocks
from agent.testing.loops import train_with_clipping
from agent.testing.plans import offloaded_plan

pytestmark = pytest.mark.slow

STEPS = 3


class Looped(nn.Module):
    """A looped transformer's shape: one residual block applied four times (`nn.ModuleList([block] * 4)`)."""

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(64)
            self.mlp = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.mlp(self.norm(x))

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, 64)
        block = Looped.Block()
        self.layers = nn.ModuleList([block] * 4)
        self.head = nn.Linear(64, 256)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> Any:
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        loss = nn.functional.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())
        return transformers.modeling_outputs.CausalLMOutput(loss=loss)


def albert() -> nn.Module:
    config = transformers.AlbertConfig(
        vocab_size=256,
        embedding_size=32,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=2,
        intermediate_size=128,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = transformers.AlbertForMaskedLM(config)
    model.train()
    return model


def looped() -> nn.Module:
    torch.manual_seed(0)
    return Looped()


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


def test_one_module_held_several_times_in_the_list_is_one_block() -> None:
    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    model = nn.Module()
    model.layers = nn.ModuleList([a, b, a, b])
    found = detect_blocks(model)
    assert found.names == ("layers.0", "layers.1")
    assert found.modules[0] is a and found.modules[1] is b
    assert detect_blocks(looped()).names == ("layers.0",)


@pytest.mark.parametrize("make", [albert, looped], ids=["albert", "looped"])
@pytest.mark.parametrize("mode", ["S", "C", "K"])
def test_a_block_run_several_times_per_forward_trains_like_plain_pytorch(make: Any, mode: str) -> None:
    model = make()
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    reference = copy.deepcopy(model)
    expected = train_with_clipping(reference, adamw(reference), batch, steps=STEPS)

    plan = offloaded_plan(model, batch, mode)
    assert (
        plan.policy is not None and len(plan.policy.blocks) == 3
    )  # prologue, the one shared block, epilogue
    wrapped = agent.wrap(model, adamw(model), sample_batch=batch, plan=plan, feedback_steps=None)
    got = train_with_clipping(wrapped.model, wrapped.optimizer, batch, steps=STEPS)
    trained = agent.unwrap(wrapped)

    assert got == pytest.approx(expected, rel=1e-5)
    for (name, p), q in zip(trained.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_a_list_holding_one_module_at_several_places_is_not_profiled_in_part() -> None:
    """A shorter list (`max_blocks`, a model larger than the device) would drop calls of the shared module: the
    profile says so instead of measuring fewer calls than the model makes."""
    from agent.profiler import BlockDetectionError, profile

    a, b = Looped.Block(), Looped.Block()
    model = looped()
    model.layers = nn.ModuleList([a, b, a, b])
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    with pytest.raises(BlockDetectionError, match=r"'layers' holds one module at several places"):
        profile(model, batch, max_blocks=1, repeats=1, allocation_trace=False)
    assert list(model.layers) == [a, b, a, b]  # the list is as it was
    whole = profile(model, batch, max_blocks=2, repeats=1, allocation_trace=False)
    assert not whole.measurements.extrapolated and len(whole.measurements.blocks) == 4  # 2 blocks + the edges
