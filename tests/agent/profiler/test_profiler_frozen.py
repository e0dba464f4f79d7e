"""Frozen parameters in the profiler: the trace says which parameters train (`ParameterInfo.trainable`:
`requires_grad` and held by the optimizer), and the model-state estimate that decides how many blocks to
profile counts a frozen parameter's bytes alone (no gradient, no Adam moments)."""

from __future__ import annotations

import torch
from torch import nn

from agent.profiler import profile
from agent.profiler.block_detection import detect_blocks
from agent.profiler.extrapolation import blocks_that_fit
from agent.testing.model_zoo import build, sample_batch
from client.contract import Hardware


def freeze_all_but_q_v(model: nn.Module) -> None:
    for name, p in model.named_parameters():
        p.requires_grad_("q_proj" in name or "v_proj" in name)


def test_the_trace_marks_frozen_and_unstepped_parameters_not_trainable(cpu_hardware: Hardware) -> None:
    model, config = build("llama", layers=2, hidden=64, vocab=128, seq=16)
    freeze_all_but_q_v(model)
    # the optimizer leaves layer 1's v_proj out: it gets a gradient, but nothing steps it
    held = [
        p
        for n, p in model.named_parameters()
        if p.requires_grad and n != "model.layers.1.self_attn.v_proj.weight"
    ]
    trace = profile(
        model,
        sample_batch(config, 2, 16),
        optimizer=torch.optim.AdamW(held, lr=1e-3),
        hardware=cpu_hardware,
        repeats=1,
        allocation_trace=False,
    )
    got = {p.name: p.trainable for p in trace.model.parameters}
    want = {
        n: p.requires_grad and n != "model.layers.1.self_attn.v_proj.weight"
        for n, p in model.named_parameters()
    }
    assert got == want


def test_blocks_that_fit_counts_frozen_parameters_at_their_own_bytes() -> None:
    model, _ = build("llama", layers=4, hidden=64, vocab=128, seq=16)
    repeated = detect_blocks(model, None)
    params = list(model.parameters())
    everything = sum(p.numel() * (2 * p.element_size() + 8) for p in params)
    # half the capacity fits the trainable model's states only just not: fewer blocks are profiled
    limit = 2 * everything - 2
    assert blocks_that_fit(model, repeated, torch.device("cpu"), limit) is not None
    freeze_all_but_q_v(model)
    frozen_states = sum(
        p.numel() * ((2 * p.element_size() + 8) if p.requires_grad else p.element_size()) for p in params
    )
    assert frozen_states < everything // 2
    assert (
        blocks_that_fit(model, repeated, torch.device("cpu"), limit) is None
    )  # before: counted as trainable
