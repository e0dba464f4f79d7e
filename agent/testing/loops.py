"""Training loops the tests compare memplan against plain PyTorch with: the loop a Trainer runs (forward,
backward, `torch.nn.utils.clip_grad_norm_` over the model's parameters, step, zero_grad), written once."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import nn


def train_with_clipping(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    batch: Mapping[str, torch.Tensor],
    *,
    steps: int,
    max_norm: float = 1.0,
    forward_context: Callable[[], AbstractContextManager[Any]] = nullcontext,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
) -> list[float]:
    """`steps` iterations on `batch` of a model whose output has `.loss`, clipping every step as the Hugging
    Face Trainer does (frozen parameters have no `.grad` and torch's clipping leaves them out); the losses.
    `forward_context`: what each forward runs under (e.g. an autocast); `scheduler`: stepped after each step."""
    torch.manual_seed(0)
    losses = []
    for _ in range(steps):
        with forward_context():
            loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        opt.step()
        opt.zero_grad()
        if scheduler is not None:
            scheduler.step()
        losses.append(loss.item())
    return losses


def uploads_in_one_step(wrapped: Any, batch: Mapping[str, torch.Tensor], *, max_norm: float = 1.0) -> int:
    """The chunk uploads the runtime makes in one more `train_with_clipping` step of a `Wrapped` (after its
    first iteration recorded the access order), to compare with its plan's `uploads_per_iteration`."""
    before = wrapped.runtime.counters.uploads
    train_with_clipping(wrapped.model, wrapped.optimizer, batch, steps=1, max_norm=max_norm)
    return int(wrapped.runtime.counters.uploads - before)
