"""Batches larger than the plan's: the plan is made for one batch shape (the largest the user declares).

`BatchShapeGuard` is a forward pre-hook on the wrapped model. A batch larger than planned (`within_plan`: more
tokens, rows x sequence, or a longer sequence than `max_batch`, else `sample_batch`) uses more memory than the
plan budgeted: on CPU it warns once and runs; on a GPU a forward with gradients raises `BatchShapeError` before
it runs, rather than letting the iteration run out of device memory halfway (with the runtime's state in
between), and an evaluation (no gradients: no activations kept for a backward) warns once and runs. The
message names the shapes and the fix: pass the largest batch as `max_batch=` to `wrap`.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from agent.profiler.tensors import iter_tensors
from agent.runtime.eager import eager

log = logging.getLogger(__name__)


class BatchShapeError(RuntimeError):
    """A batch larger than the one the plan was made for, on a GPU."""


def batch_shape(batch: Any) -> tuple[int, int] | None:
    """(rows, sequence length) of a batch as the model takes it: `input_ids` if present, else its first tensor."""
    t = batch.get("input_ids") if isinstance(batch, dict) else None
    if not isinstance(t, torch.Tensor):
        t = next(iter_tensors(batch), None)
    if t is None or t.dim() == 0:
        return None
    return int(t.shape[0]), int(t.shape[1]) if t.dim() > 1 else 1


def within_plan(shape: tuple[int, int], planned: tuple[int, int]) -> bool:
    """Whether a batch of `shape` (rows, sequence) takes no more memory than the `planned` one: no more tokens
    (rows x sequence) and no longer a sequence. A transformer's activations grow as rows x sequence (the
    blocks' hidden states, logits) and rows x sequence^2 (eager attention scores) = tokens x sequence, so both
    are then within the plan's (what grows with rows alone, a pooled head's output, is a row's hidden size).
    The same order as the job's choice of trace among its ranks (`process_group.batch_order`: most tokens,
    then the longer sequence): before session 33 each dimension was compared alone, so under a group whose
    ranks' first batches were 4 x 32 and 2 x 64 the job planned for 2 x 64 and rank 0 was told its own 4 x 32
    was larger than planned (refused on a GPU)."""
    return shape[0] * shape[1] <= planned[0] * planned[1] and shape[1] <= planned[1]


class BatchShapeGuard:
    """Warn once (CPU) or raise (GPU) when the model is called on a batch larger than `planned`."""

    def __init__(self, model: nn.Module, planned: tuple[int, int], device: torch.device) -> None:
        self.planned, self.device, self.warned = planned, device, False
        self._handle: RemovableHandle = model.register_forward_pre_hook(
            eager(self._check), with_kwargs=True, prepend=True
        )  # before the runtime

    def remove(self) -> None:
        self._handle.remove()

    def _check(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        shape = batch_shape(kwargs) if kwargs else batch_shape(args)
        if shape is None or within_plan(shape, self.planned):
            return
        message = (
            f"batch of {shape[0]} x {shape[1]} (rows x sequence) is larger than the {self.planned[0]} x "
            f"{self.planned[1]} the memory plan was made for; pass the largest batch you train on as "
            "agent.wrap(..., max_batch=...)"
        )
        if self.device.type == "cuda":
            if torch.is_grad_enabled():
                raise BatchShapeError(
                    f"{message} (refused before the forward: it would exceed the plan's device memory)"
                )
            # an evaluation (no_grad, inference_mode) keeps no activations for a backward, the plan's largest
            # cost: run it rather than stop the training job at its first evaluation (a Trainer's
            # `per_device_eval_batch_size` above the training batch). Unchecked on a GPU (none lent so far).
            message += (
                " (an evaluation without gradients: run, with no activations kept; its logits grow with it)"
            )
        if not self.warned:
            self.warned = True
            log.warning(
                "memplan: %s; running it anyway on %s (memory above the plan's limit)",
                message,
                self.device.type,
            )
