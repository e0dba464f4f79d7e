"""Hugging Face activation checkpointing switched on by the user (`model.activation_checkpointing_enable()`,
what Trainer's `activation_checkpointing=True` calls), beside memplan's own activation modes (session 21 probe).

Before or after `wrap`, reentrant or not: the layers then run through `torch.utils.checkpoint` inside memplan's
block hooks, and a block memplan checkpoints or swaps is checkpointed by the library too. With every chunk
offloaded and gradient clipping, training matches plain PyTorch with the same checkpointing (dropout seeded
alike) within 1e-5 in fp32. No defect was found; this keeps it so.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

import agent
from agent.testing.model_zoo import build_with_library_defaults, sample_batch
from agent.testing.plans import offloaded_plan

pytestmark = pytest.mark.slow

STEPS = 3
TOL = 1e-5


def enable(model: torch.nn.Module, reentrant: bool, extra: dict[str, Any]) -> None:
    """What Trainer's `activation_checkpointing=True` calls (`gradient_checkpointing_enable`, its deprecated
    alias, ends there too)."""
    model.activation_checkpointing_enable(
        activation_checkpointing_kwargs={"use_reentrant": reentrant}, **extra
    )


def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: dict[str, Any]) -> list[float]:
    torch.manual_seed(1)  # the same dropout masks in both runs (GPT-2 has dropout at its defaults)
    losses = []
    for _ in range(STEPS):
        loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize(
    ("kind", "reentrant", "when", "extra"),
    [
        ("llama", True, "before", {}),
        ("llama", False, "after", {}),
        ("gpt2", True, "after", {}),
        ("gpt2", False, "before", {}),
        # every other layer (`offload=True`, the library's `save_on_cpu` of their saved tensors, cannot run
        # here: it asks for pinned memory, which a machine without an accelerator refuses, plain PyTorch too)
        ("llama", False, "before", {"every_n_layers": 2}),
        ("qwen2", False, "after", {"every_n_layers": 2}),
    ],
)
def test_the_users_activation_checkpointing_trains_like_plain_pytorch(
    kind: str, reentrant: bool, when: str, extra: dict[str, Any]
) -> None:
    torch.manual_seed(0)
    model, cfg = build_with_library_defaults(kind, layers=4, hidden=64, vocab=256, seq=32)
    model.train()
    batch = sample_batch(cfg, 2, 32)

    reference = copy.deepcopy(model)
    enable(reference, reentrant, extra)
    expected = train(reference, torch.optim.AdamW(reference.parameters(), lr=1e-2), batch)

    m = copy.deepcopy(model)
    if when == "before":
        enable(m, reentrant, extra)
    # a solved plan's chunks, every one offloaded, and the blocks kept, checkpointed and swapped by memplan
    run = agent.wrap(
        m,
        torch.optim.AdamW(m.parameters(), lr=1e-2),
        plan=offloaded_plan(m, batch, "KCSC"),
        feedback_steps=None,
    )
    if when == "after":
        enable(run.model, reentrant, extra)
    got = train(run.model, run.optimizer, batch)
    assert run.runtime.counters.uploads > 0
    assert run.activations is not None and run.activations.store is not None
    assert run.activations.store.counters.swapped_out_bytes > 0
    for a, b in zip(got, expected, strict=True):
        assert abs(a - b) <= TOL * abs(b), (got, expected)
    final = dict(agent.unwrap(run).named_parameters())
    # (an attention key bias, GPT-2's in its fused c_attn and Qwen2's k_proj, has a gradient that is zero but
    # for rounding, which Adam normalises into full-size steps: any other order of summation moves it;
    # tests/agent/distributed/test_ddp_equivalence.py)
    off = {
        name: float((final[name] - p).norm() / p.norm())
        for name, p in reference.named_parameters()
        if not name.endswith(("attn.c_attn.bias", "k_proj.bias"))
    }
    assert max(off.values()) <= TOL, sorted(off.items(), key=lambda kv: -kv[1])[:5]
