"""The profiler marks a parameter an op used outside the forward of the module owning it
(`ParameterInfo.used_outside_owner`, `agent/profiler/outside_use.py`): a device-sharded chunk holding it would
read a released placeholder, so the planner never shards that chunk on the device
(`tests/planner_service/solver/test_multi_rank_policy.py`)."""

from __future__ import annotations

import torch
from torch import nn

from agent.profiler import profile
from agent.testing.model_zoo import build, sample_batch
from client.contract import Hardware, Trace


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(32, 32)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.relu(self.lin(h))


class ParentReadsTheEmbedding(nn.Module):
    """The output head is the embedding's weight used in the parent's forward (a functional tie)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.layers = nn.ModuleList(Block() for _ in range(3))
        self.norm = nn.LayerNorm(32)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        for layer in self.layers:
            h = layer(h)
        # `.dtype` is metadata (not a use); the matmul with the embedding's weight is
        return self.norm(h).to(self.embed.weight.dtype) @ self.embed.weight.T


def outside(trace: Trace) -> set[str]:
    return {p.name for p in trace.model.parameters if p.used_outside_owner}


def test_a_weight_used_in_its_parents_forward_is_marked_used_outside_its_owner(
    cpu_hardware: Hardware,
) -> None:
    torch.manual_seed(0)
    model = ParentReadsTheEmbedding()
    ids = torch.randint(0, 64, (2, 16))
    trace = profile(
        model,
        {"input_ids": ids},
        loss_fn=lambda out, batch: nn.functional.cross_entropy(
            out.flatten(0, 1), batch["input_ids"].flatten()
        ),
        optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
        hardware=cpu_hardware,
        repeats=1,
        allocation_trace=False,
    )
    assert outside(trace) == {"embed.weight"}
    # additive: left out of the JSON when false, so traces without it load and keep their content hashes
    assert trace.model_dump_json().count("used_outside_owner") == 1
    assert Trace.model_validate_json(trace.model_dump_json()).model.parameters == trace.model.parameters


def test_a_hugging_face_model_uses_every_parameter_inside_its_owners_forward(cpu_hardware: Hardware) -> None:
    for kind in ("llama", "gpt2"):  # gpt2: lm_head shares the embedding's weight (a tie through a module)
        model, config = build(kind, layers=2, hidden=64, vocab=128, seq=16)
        trace = profile(
            model,
            sample_batch(config, 2, 16),
            optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
            hardware=cpu_hardware,
            repeats=1,
            allocation_trace=False,
        )
        assert outside(trace) == set(), kind
