"""A model's registered buffers (BatchNorm's running statistics and `num_batches_tracked`, rotary caches, masks)
put back as they were after work the user did not ask for.

Two places run a model's forward where the user's training would not:
- the profiler's iterations on the user's model (`agent.profile`, and `agent.wrap` planning from a sample batch):
  about twenty forwards in training mode, each of which moved a BatchNorm layer's running mean and variance
  toward the sample batch and counted it in `num_batches_tracked` (session 22: a ResNet's
  `num_batches_tracked` read 20 after `wrap`, 0 before; `preserved_training_state` restored the parameters,
  gradients, optimizer state and RNG, not the buffers);
- a checkpointed block's recompute in backward (the runtime's checkpoint mode, which the planner chooses, not the
  user): torch's checkpoint re-runs the block's forward, which updated the running statistics a second time
  (a ResNet trained 3 steps with one block checkpointed ended with its `num_batches_tracked` 3 above plain
  PyTorch's, and other running means and variances: its outputs in `eval()` differed).

`BufferSlot`s name each buffer by its owning module and attribute, so that a buffer the forward replaced (an
assignment, not an in-place update) is put back too. `RestoredBuffers` keeps copies of the slots' values (on
the host for the profiler, beside the buffer for a recompute) and, on exit, puts every slot's tensor object and
value back. `ChangedBuffers` tells which slots a forward changed (`Tensor._version`, bumped by in-place updates
made through autograd-visible ops; another tensor in the slot; a normalization layer's running statistics, which
its kernel updates without a bump), so that a recompute copies only those (BatchNorm's three per layer), not a
block's rotary cache or causal mask.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase

_RUNNING_STATS = frozenset({"running_mean", "running_var", "num_batches_tracked"})


@dataclass(frozen=True)
class BufferSlot:
    """One registered buffer: `module._buffers[name]`, holding `tensor` when the slot was read."""

    module: nn.Module
    name: str
    tensor: torch.Tensor


def buffer_slots(model: nn.Module) -> list[BufferSlot]:
    """Every registered buffer of `model` and its submodules (each module once), None entries left out."""
    slots = []
    for module in model.modules():
        for name, tensor in module._buffers.items():
            if tensor is not None:
                slots.append(BufferSlot(module, name, tensor))
    return slots


def _running_stat(slot: BufferSlot) -> bool:
    """A running statistic the normalization layer's forward updates (training mode, statistics tracked)."""
    m = slot.module
    return isinstance(m, _NormBase) and m.training and m.track_running_stats and slot.name in _RUNNING_STATS


def _version(t: torch.Tensor) -> int | None:
    """The tensor's in-place version counter; None for an inference tensor, which has none."""
    return None if t.is_inference() else t._version


class ChangedBuffers:
    """The slots of `module`'s buffers whose tensor changed while `watching()` was open: `changed` after it
    closes. Changed: replaced by another tensor, updated in place as its version counter says, or a running
    statistic of a normalization layer in training mode (`_NormBase`: BatchNorm, InstanceNorm with
    `track_running_stats`): the batch-norm kernel updates `running_mean` and `running_var` in place without
    bumping their version counters (torch 2.13), so the counter alone misses them."""

    def __init__(self, module: nn.Module) -> None:
        self._module = module
        self.changed: list[BufferSlot] = []

    @contextmanager
    def watching(self) -> Iterator[None]:
        before = [(slot, _version(slot.tensor)) for slot in buffer_slots(self._module)]
        try:
            yield
        finally:
            self.changed = []
            for slot, version in before:
                now = slot.module._buffers.get(slot.name)
                if now is None:
                    continue
                if (
                    now is not slot.tensor
                    or version is None
                    or _version(now) != version
                    or _running_stat(slot)
                ):
                    self.changed.append(BufferSlot(slot.module, slot.name, now))

    @contextmanager
    def restoring(self) -> Iterator[None]:
        """The slots `watching()` found changed, restored on exit (`RestoredBuffers`); read when entered, so it
        may be made before the watched forward ran (torch's checkpoint takes both contexts at once)."""
        with RestoredBuffers(self.changed):
            yield


class RestoredBuffers:
    """On exit (error or not), each slot holds its tensor object again with the value it had on entry. `to_host`:
    the copies are kept in host memory (the profiler: the whole model's buffers, beside its parameters' host
    copies), else beside each buffer. An inference tensor (no in-place update outside inference mode) is only
    put back in its slot."""

    def __init__(self, slots: list[BufferSlot], *, to_host: bool = False) -> None:
        self._slots = slots
        self._to_host = to_host
        self._values: list[torch.Tensor | None] = []

    def __enter__(self) -> RestoredBuffers:
        with torch.no_grad():
            self._values = [
                None
                if s.tensor.is_inference()
                else s.tensor.detach().to("cpu", copy=True)
                if self._to_host
                else s.tensor.detach().clone()
                for s in self._slots
            ]
        return self

    def __exit__(self, *exc: object) -> None:
        with torch.no_grad():
            for slot, value in zip(self._slots, self._values, strict=True):
                slot.module._buffers[slot.name] = slot.tensor
                if value is not None:
                    slot.tensor.copy_(value.to(slot.tensor.device))
        self._values = []
