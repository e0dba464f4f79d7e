"""Training loops the tests compare memplan against plain PyTorch with: the loop a Trainer runs (forward,
backward, `torch.nn.utils.clip_grad_norm_` over the model's parameters, step, zero_grad), written once."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn


def train_with_clipping(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    batch: Mapping[str, torch.Tensor],
    *,
    steps: int,
    max_norm: float = 1.0,
) -> list[float]:
    """`steps` iterations on `batch` of a model whose output has `.loss`, clipping every step as the Hugging
    Face Trainer does (frozen parameters have no `.grad` and torch's clipping leaves them out); the losses."""
    torch.manual_seed(0)
    losses = []
    for _ in range(steps):
        loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses
