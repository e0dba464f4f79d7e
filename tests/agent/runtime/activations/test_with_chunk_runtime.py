"""Activation modes on top of the chunk runtime (offloaded parameters in shared device buffers) stay exact."""

from __future__ import annotations

import copy

import pytest
import torch
from activation_helpers import TOL, block_aligned_policy, data, rel

from agent.runtime import manual_plan
from agent.runtime.activations import apply_activation_policy
from agent.testing.model_zoo import build


def adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    # fused, like the runtime's host step: a foreach reference differs by ~1e-4 on near-zero biases after a
    # few steps for the chunk runtime alone (all-keep), which is not what these tests are about
    return torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)


def losses_and_params(
    model: torch.nn.Module, opt: torch.optim.Optimizer, batches: list[torch.Tensor]
) -> list[float]:
    torch.manual_seed(1234)
    out = []
    for x in batches:
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


@pytest.mark.parametrize(
    ("offload", "n_buffers", "strip"),
    [
        ("all", 1, "SCSC"),
        ("all", 1, "CCCC"),
        ("all", 2, "CSSK"),
        ("alternate", 1, "SSCC"),
        ("alternate", 2, "KCSC"),
        # one buffer, the tied embedding/head and the first blocks offloaded, the last block on the device (a
        # solver plan for gpt2-4L): the first recompute in backward must be able to evict the chunk the head's
        # backward node unpacked before it (that node has finished)
        ("head", 1, "CCCK"),
    ],
)
def test_modes_with_offloaded_chunks_train_like_unmanaged_pytorch(
    offload: str, n_buffers: int, strip: str
) -> None:
    from agent.wrapping import unwrap, wrap

    base, _ = build("gpt2", layers=len(strip), hidden=64, vocab=128, seq=32, seed=0)
    batches = data(4)
    ref_model = copy.deepcopy(base)
    ref = losses_and_params(ref_model, adamw(ref_model), batches)

    model = copy.deepcopy(base)
    policy = block_aligned_policy(
        model,
        "transformer.h",
        strip,
        {"all": lambda i: True, "alternate": lambda i: i % 2 == 1, "head": lambda i: i <= 3}[offload],
        n_buffers,
    )
    plan = manual_plan(model, chunk_size_bytes=policy.chunk_size_bytes).model_copy(update={"policy": policy})
    w = wrap(model, adamw(model), plan=plan)
    mgr = apply_activation_policy(model, policy, torch.device("cpu"), w.runtime)
    got = losses_and_params(w.model, w.optimizer, batches)
    for step, (a, b) in enumerate(zip(got, ref, strict=True)):
        assert abs(a - b) <= TOL * abs(b), f"step {step}: loss {a} vs {b}"
    w.synchronize()
    mgr.remove()
    trained = unwrap(w)
    ref_params = dict(ref_model.named_parameters())
    for name, p in trained.named_parameters():
        assert rel(p.detach(), ref_params[name].detach()) <= TOL, name


def test_a_checkpointed_block_needing_more_offloaded_chunks_than_buffers_is_refused_before_any_change() -> (
    None
):
    from agent.runtime.activations import ActivationPlanError, block_targets

    model, _ = build("gpt2", layers=2, hidden=64, vocab=128, seq=32, seed=0)
    largest = max(sum(p.numel() * 4 for p in b.parameters()) for b in model.transformer.h)
    split = manual_plan(model, chunk_size_bytes=largest // 2 + 4096, offload="all", n_buffers=1).policy
    assert split is not None
    policy = split.model_copy(
        update={"blocks": block_aligned_policy(model, "transformer.h", "CK", lambda i: True, 1).blocks}
    )
    with pytest.raises(
        ActivationPlanError, match=r"policy.blocks\[1\]: checkpointed block 'transformer.h.0'"
    ):
        block_targets(model, policy)
