"""Shared helpers for the runtime tests: tiny HF models, hand-built plans, and one training loop."""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

import agent
from agent.runtime import RuntimeOptions, manual_plan
from agent.testing.model_zoo import build
from agent.wrapping import unwrap
from client.contract import Placement, Plan

VOCAB = 128
SEQ = 16
BATCH = 2


def tiny_model(kind: str, layers: int = 4, hidden: int = 64) -> nn.Module:
    model, _ = build(kind, layers=layers, hidden=hidden, vocab=VOCAB, seq=32, seed=0)
    return model


def batches(n: int, seed: int = 1, distinct: int = 4) -> list[torch.Tensor]:
    """`n` batches cycling over `distinct` random ones (so the loss falls and training is visible)."""
    g = torch.Generator().manual_seed(seed)
    pool = [torch.randint(0, VOCAB, (BATCH, SEQ), generator=g) for _ in range(distinct)]
    return [pool[i % distinct] for i in range(n)]


def chunk_bytes_for(model: nn.Module, n_chunks: int) -> int:
    """A chunk size giving about `n_chunks` chunks (never below the largest parameter)."""
    sizes = [p.numel() * p.element_size() for p in model.parameters()]
    return max(max(sizes), -(-sum(sizes) // n_chunks))


def plan_for(
    model: nn.Module,
    offload: str | list[int] | Callable[[int, int], Placement],
    *,
    n_chunks: int = 8,
    n_buffers: int = 2,
    compute_dtype: torch.dtype | None = None,
) -> Plan:
    return manual_plan(
        model,
        chunk_size_bytes=chunk_bytes_for(model, n_chunks),
        offload=offload,
        n_buffers=n_buffers,
        compute_dtype=compute_dtype,
    )


def alternate(i: int, n: int) -> Placement:
    return Placement.offloaded if i % 2 else Placement.persistent


@dataclass
class Trainer:
    """Anything with a model and an optimizer: plain PyTorch or a `Wrapped`."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    clip: Callable[[float], torch.Tensor] | None = None
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None


def train(
    t: Trainer, data: list[torch.Tensor], *, clip: float | None = None, micro: int = 1, seed: int = 1234
) -> list[float]:
    """The same loop for every variant: forward, backward (micro-batches), clip, step, schedule, zero."""
    torch.manual_seed(seed)  # dropout masks identical across variants
    losses = []
    for x in data:
        total = 0.0
        for part in x.chunk(micro):
            loss = t.model(input_ids=part, labels=part).loss / micro
            loss.backward()
            total += loss.item()
        if clip is not None:
            assert t.clip is not None
            t.clip(clip)
        t.optimizer.step()
        if t.scheduler is not None:
            t.scheduler.step()
        t.optimizer.zero_grad()
        losses.append(total)
    return losses


def plain_trainer(model: nn.Module, make_opt: Callable[[nn.Module], torch.optim.Optimizer]) -> Trainer:
    opt = make_opt(model)
    return Trainer(model, opt, clip=lambda m: torch.nn.utils.clip_grad_norm_(model.parameters(), m))


def clone(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)


def max_rel_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b, strict=True))


def param_rel_diff(m1: nn.Module, m2: nn.Module) -> tuple[float, str]:
    """Largest ||p1 - p2|| / ||p2|| over parameters, and its name."""
    worst, name = 0.0, ""
    p2s = dict(m2.named_parameters())
    for n, p in m1.named_parameters():
        q = p2s[n].detach().to(torch.float32)
        d = ((p.detach().to(torch.float32).cpu() - q.cpu()).norm() / q.norm().clamp_min(1e-12)).item()
        if d > worst:
            worst, name = d, n
    return worst, name


def measured_peak(
    model: nn.Module, batch: Mapping[str, torch.Tensor], plan: Plan, *, steps: int, tmp_path: Path
) -> int:
    """The device peak the monitor measured over `steps` iterations of a copy of `model` wrapped under `plan`
    on the CPU (fused AdamW), unwrapped after."""
    m = copy.deepcopy(model)
    w = agent.wrap(
        m,
        torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True),
        plan=plan,
        options=RuntimeOptions(device=torch.device("cpu")),
        feedback_steps=steps,
        feedback_path=tmp_path / "feedback.jsonl",
    )
    try:
        for _ in range(steps):
            w.model(**batch).loss.backward()
            w.optimizer.step()
            w.optimizer.zero_grad()
        assert w.monitor is not None and w.monitor.measured.peak_device_bytes is not None
        return w.monitor.measured.peak_device_bytes
    finally:
        unwrap(w)
