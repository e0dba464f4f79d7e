"""One profiling session's training step: run iterations of the user's model and put everything back after.

`TrainingStep` calls the model the way the user's batch asks (`model(**batch)` for a mapping,
`model(*batch)` for a tuple or list, else `model(batch)`), computes the loss (`loss_fn(output, batch)`,
default `output.loss`), runs backward and the optimizer step. Errors raised by the model keep their type
and traceback; the profiler adds a note saying where it was.

`preserved_training_state` snapshots what profiling iterations change (parameter values to host memory,
optimizer state, gradients, RNG states) and restores it on exit, so profiling a live job leaves its
weights and optimizer exactly as they were.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from agent.profiler.block_marks import BlockTracker
from agent.profiler.device_clock import DeviceClock
from agent.random_states import RandomStates
from agent.runtime.module_buffers import RestoredBuffers, buffer_slots
from client.contract import Phase

LossFn = Callable[[Any, Any], torch.Tensor]


class ProfilerInputError(ValueError):
    """The model, batch or loss function cannot be profiled as given."""


def check_grad_mode(call: str) -> None:
    """Raise `ProfilerInputError` when `call` (profiling, or `wrap`, which profiles and trains) runs where no
    iteration can train: under `torch.inference_mode()` or with gradients disabled (`torch.no_grad()`)."""
    if torch.is_inference_mode_enabled():
        raise ProfilerInputError(
            f"{call}: called under torch.inference_mode(); it runs a real training iteration (forward and "
            "backward): call it outside inference_mode, where the training loop runs"
        )
    if not torch.is_grad_enabled():
        raise ProfilerInputError(
            f"{call}: called with gradients disabled (torch.no_grad() or torch.set_grad_enabled(False)); it runs a "
            "real training iteration (forward and backward): call it where gradients are enabled, as training runs"
        )


def default_loss(output: Any, batch: Any) -> torch.Tensor:
    """Hugging Face convention: the model computed the loss itself (`output.loss`)."""
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, Mapping):
        loss = output.get("loss")
    if loss is None:
        raise ProfilerInputError(
            "loss_fn: the model's output has no `loss` (Hugging Face models return one when the batch has "
            "`labels`); pass loss_fn=lambda output, batch: ... returning a scalar tensor"
        )
    return loss


def move_batch(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, Mapping):
        return {k: move_batch(v, device) for k, v in batch.items()}
    if isinstance(batch, tuple):
        return tuple(move_batch(v, device) for v in batch)
    if isinstance(batch, list):
        return [move_batch(v, device) for v in batch]
    return batch


class TrainingStep:
    """forward -> loss -> backward -> optimizer step, marking phases on an optional block_tracker."""

    def __init__(
        self,
        model: nn.Module,
        batch: Any,
        loss_fn: LossFn | None,
        optimizer: torch.optim.Optimizer,
        n_blocks: int,
    ) -> None:
        self.model = model
        self.batch = batch
        self.loss_fn = loss_fn or default_loss
        self.optimizer = optimizer
        self.epilogue = n_blocks - 1

    def forward_loss(self) -> torch.Tensor:
        try:
            if isinstance(self.batch, Mapping):
                output = self.model(**self.batch)
            elif isinstance(self.batch, (tuple, list)):
                output = self.model(*self.batch)
            else:
                output = self.model(self.batch)
        except Exception as e:
            e.add_note(
                f"memplan profiler: raised by the forward of {type(self.model).__name__} on the sample batch "
                "(check that sample_batch is what model(**batch) or model(*batch) takes)"
            )
            raise
        loss = self.loss_fn(output, self.batch)
        if isinstance(loss, torch.Tensor) and not loss.requires_grad:
            if not any(p.requires_grad for p in self.model.parameters()):
                raise ProfilerInputError(
                    f"model: no parameter of {type(self.model).__name__} requires grad (every one is frozen): "
                    "there is nothing to train; unfreeze the parameters to train before profiling"
                )
            check_grad_mode("profile")
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
            raise ProfilerInputError(
                "loss_fn: must return a scalar tensor that requires grad, got "
                f"{type(loss).__name__}{'' if not isinstance(loss, torch.Tensor) else tuple(loss.shape)}"
            )
        del output
        return loss

    def run(self, block_tracker: BlockTracker | None = None) -> None:
        """One iteration, moving `block_tracker` (if any) at the phase boundaries."""
        self.optimizer.zero_grad(set_to_none=True)
        if block_tracker is not None:
            block_tracker.move(0, Phase.forward)
        loss = self.forward_loss()
        if block_tracker is not None:
            block_tracker.move(self.epilogue, Phase.backward)
        loss.backward()
        del loss
        if block_tracker is not None:
            block_tracker.move(None, Phase.optimizer)
        self.optimizer.step()
        if block_tracker is not None:
            block_tracker.move(None, Phase.optimizer)  # closes the optimizer segment

    def timed(self, clock: DeviceClock) -> tuple[float, float, float]:
        """One un-hooked iteration: wall seconds of the whole iteration, of its optimizer step and of its
        `zero_grad` (the two optimizer calls the chunk runtime replaces by its own)."""
        t0 = clock.now()
        self.optimizer.zero_grad(set_to_none=True)
        tz = clock.now()
        loss = self.forward_loss()
        loss.backward()
        del loss
        t1 = clock.now()
        self.optimizer.step()
        t2 = clock.now()
        return t2 - t0, t2 - t1, tz - t0


@contextmanager
def preserved_training_state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> Iterator[None]:
    """Restore parameters, gradients, buffers (running statistics: `module_buffers.py`), optimizer state and RNG
    states after the block, even on error; never change a tensor of the optimizer's state in place (see
    below)."""
    buffers = RestoredBuffers(buffer_slots(model), to_host=True)
    params = [p for p in model.parameters()]
    values = [p.detach().to("cpu", copy=True) for p in params]
    grads = [p.grad for p in params]
    opt_state = _host_copy(optimizer.state_dict()) if optimizer is not None else None
    if optimizer is not None:
        # The profiled steps update the optimizer's state in place; its tensors may be shared with a dict the
        # caller still holds (a checkpoint passed to `optimizer.load_state_dict` on the same device): step
        # private copies instead (the caller's originals are freed here unless the caller holds them).
        for state in optimizer.state.values():
            for key, value in list(state.items()):
                if isinstance(value, torch.Tensor):
                    state[key] = value.detach().clone()
    rng = RandomStates.capture()  # torch's, Python's and numpy's (`random_states.py`)
    try:
        with buffers:
            yield
    finally:
        with torch.no_grad():
            for p, v in zip(params, values, strict=True):
                p.copy_(v.to(p.device))
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        if optimizer is not None and opt_state is not None:
            optimizer.state.clear()
            optimizer.load_state_dict(opt_state)
        rng.restore()


def _host_copy(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _host_copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_host_copy(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_host_copy(v) for v in value)
    return copy.deepcopy(value)
