"""Frozen parameters under the chunk runtime: a persistent chunk's gradient area holds its trainable
parameters only (none for a chunk of frozen ones), which is what the planner counts for it
(`planner_service.solver.instance.chunk_model_state_bytes`), and training matches plain PyTorch."""

from __future__ import annotations

import torch
from runtime_helpers import (
    Trainer,
    alternate,
    batches,
    clone,
    max_rel_diff,
    param_rel_diff,
    plan_for,
    tiny_model,
    train,
)
from torch import nn

from agent.wrapping import wrap
from client.contract import parameter_slot_bytes


def freeze_all_but_q_v(model: nn.Module) -> None:
    for name, p in model.named_parameters():
        p.requires_grad_("q_proj" in name or "v_proj" in name)


def adamw(m: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-3)


def trainable_slot_bytes(model: nn.Module) -> int:
    return sum(
        parameter_slot_bytes(p.numel(), p.element_size()) for p in model.parameters() if p.requires_grad
    )


def test_persistent_chunks_hold_gradients_for_trainable_parameters_only_and_train_as_plain() -> None:
    model = tiny_model("llama")
    freeze_all_but_q_v(model)
    plain = clone(model)
    expected = train(Trainer(plain, adamw(plain)), batches(3))

    wrapped_model = clone(model)
    w = wrap(wrapped_model, adamw(wrapped_model), plan=plan_for(wrapped_model, "none"))
    got = train(Trainer(w.model, w.optimizer), batches(3))
    assert max_rel_diff(got, expected) <= 1e-5
    diff, name = param_rel_diff(w.model, plain)
    assert diff <= 1e-5, name
    rep = w.report().memory
    # before: every chunk's gradient area was the whole chunk (frozen embeddings and MLPs included)
    assert rep.device["gradients"] == trainable_slot_bytes(model)
    assert all(p.grad is None for p in w.model.parameters() if not p.requires_grad)


def test_offloaded_and_persistent_chunks_with_frozen_parameters_train_as_plain() -> None:
    model = tiny_model("llama")
    freeze_all_but_q_v(model)
    plain = clone(model)
    expected = train(Trainer(plain, adamw(plain)), batches(3))
    wrapped_model = clone(model)
    w = wrap(wrapped_model, adamw(wrapped_model), plan=plan_for(wrapped_model, alternate))
    got = train(Trainer(w.model, w.optimizer), batches(3))
    assert max_rel_diff(got, expected) <= 1e-5
    diff, name = param_rel_diff(w.model, plain)
    assert diff <= 1e-5, name


def test_a_parameter_unfrozen_after_wrap_gets_its_gradient_and_trains_as_plain() -> None:
    """A gradient for a parameter that had no slot widens its chunk's gradient area (beyond the plan)."""
    model = tiny_model("llama")
    freeze_all_but_q_v(model)
    plain = clone(model)
    wrapped_model = clone(model)
    w = wrap(
        wrapped_model,
        torch.optim.AdamW(wrapped_model.parameters(), lr=1e-3),
        plan=plan_for(wrapped_model, "none"),
    )
    popt = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    for m in (plain, w.model):
        for name, p in m.named_parameters():
            if "o_proj" in name:
                p.requires_grad_(True)
    expected = train(Trainer(plain, popt), batches(3))
    got = train(Trainer(w.model, w.optimizer), batches(3))
    assert max_rel_diff(got, expected) <= 1e-5
    diff, name = param_rel_diff(w.model, plain)
    assert diff <= 1e-5, name
