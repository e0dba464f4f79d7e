"""Torch's own `nn.TransformerEncoder` through `agent.wrap` (session 21 probe).

`nn.MultiheadAttention` passes its `out_proj.weight` and `.bias` to `F.multi_head_attention_forward` without
calling `out_proj`, so `out_proj`'s forward hooks never fire. With `out_proj` in another offloaded chunk than
`in_proj_weight` and one device buffer, the attention read `out_proj`'s host copy: correct by accident on a
CPU (host and "device" are one memory), a device mismatch on a GPU. Now the attention's own hooks make its
`out_proj` resident too (`agent.runtime.layout.hooked_parameters`), and a plan with too few buffers for that is
refused naming the module. The planner's plans never cut a block between chunks, so they keep an attention in
one chunk; hand-made plans (`agent.runtime.manual_plan`, an edited plan file) can cut it.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import agent
from agent.runtime import manual_plan
from agent.runtime.layout import PlanMismatchError

CHUNK = 2**17  # splits layers 0 and 3's attention between two chunks
TOL = 1e-5


class EncoderLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(256, 64)
        layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 4, enable_nested_tensor=False)
        self.head = nn.Linear(64, 256)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(ids.shape[1])
        return self.head(self.enc(self.emb(ids), mask=mask, is_causal=True))


def loss_fn(out: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.flatten(0, 1), ids.flatten())


def split_attention(model: EncoderLM) -> list[int]:
    """The layers whose attention `manual_plan(chunk_size_bytes=CHUNK)` cuts between two chunks."""
    policy = manual_plan(model, chunk_size_bytes=CHUNK, offload="all").policy
    assert policy is not None
    chunk_of = {name: c.index for c in policy.chunks for name in c.parameters}
    return [
        i
        for i in range(4)
        if chunk_of[f"enc.layers.{i}.self_attn.in_proj_weight"]
        != chunk_of[f"enc.layers.{i}.self_attn.out_proj.weight"]
    ]


@pytest.fixture
def job() -> tuple[EncoderLM, torch.Tensor]:
    torch.manual_seed(0)
    return EncoderLM(), torch.randint(0, 256, (2, 32))


def test_the_attentions_out_proj_is_resident_when_it_runs_and_training_is_exact(
    job: tuple[EncoderLM, torch.Tensor],
) -> None:
    model, ids = job
    assert split_attention(model), "the chunk size no longer splits an attention"
    reference = copy.deepcopy(model)
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, fused=True)
    expected = []
    for _ in range(3):
        loss = loss_fn(reference(ids), ids)
        loss.backward()
        opt.step()
        opt.zero_grad()
        expected.append(loss.item())

    m = copy.deepcopy(model)
    plan = manual_plan(m, chunk_size_bytes=CHUNK, offload="all", n_buffers=2)
    run = agent.wrap(
        m,
        torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True),
        plan=plan,
        loss_fn=loss_fn,
        feedback_steps=None,
    )
    runtime = run.runtime
    resident: list[bool] = []

    def out_proj_resident(attention: nn.Module, args: object) -> None:
        chunk = runtime.layout.by_param[id(attention.out_proj.weight)].chunk  # type: ignore[union-attr]
        resident.append(runtime.states[chunk].slot is not None)

    # (after the runtime's pre-hook, registered at wrap)
    hooks = [layer.self_attn.register_forward_pre_hook(out_proj_resident) for layer in m.enc.layers]
    got = []
    for _ in range(3):
        loss = loss_fn(run.model(ids), ids)
        loss.backward()
        run.optimizer.step()
        run.optimizer.zero_grad()
        got.append(loss.item())
    for h in hooks:
        h.remove()
    assert resident and all(resident), resident
    for a, b in zip(got, expected, strict=True):
        assert abs(a - b) <= TOL * abs(b), (got, expected)
    trained = dict(agent.unwrap(run).named_parameters())
    for name, p in reference.named_parameters():
        if name.endswith(
            "in_proj_bias"
        ):  # its key part's gradient is zero but for rounding (Adam amplifies it)
            continue
        assert float((trained[name] - p).norm() / p.norm()) <= TOL, name


def test_a_plan_with_one_buffer_for_a_split_attention_is_refused_naming_it(
    job: tuple[EncoderLM, torch.Tensor],
) -> None:
    model, ids = job
    first = split_attention(model)[0]
    plan = manual_plan(model, chunk_size_bytes=CHUNK, offload="all", n_buffers=1)
    with pytest.raises(
        PlanMismatchError, match=rf"module enc\.layers\.{first}\.self_attn \(MultiheadAttention\)"
    ):
        agent.wrap(
            model, torch.optim.AdamW(model.parameters()), plan=plan, loss_fn=loss_fn, feedback_steps=None
        )
