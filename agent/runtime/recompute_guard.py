"""Recompute guard: a checkpointed block's offloaded chunks stay in their buffers from recompute to the end of its backward.

Why: `torch.utils.checkpoint` (non-reentrant) keeps the tensors saved during recomputation itself,
bypassing the chunk runtime's saved-tensor hooks, so saved parameter views point straight into a
device buffer. If the runtime reused that buffer for another chunk before the block's backward
finished, the block's gradients would be computed from the wrong weights. The guard therefore
- at the start of a recompute, tells the runtime that a new backward node is running (the chunks the
  previous node unpacked are no longer protected: without this, one buffer could not serve a
  checkpointed block after a swapped or kept one);
- at the end of the recompute, pins the block's offloaded chunks that are resident;
- unpins them when the gradient of the block's input is ready (the block's backward is done), or at
  the end of backward when no input requires grad.

It reads and writes the runtime's bookkeeping (`ModelStateManager._node`, `_node_chunks`, slot pins),
which are private to `manager.py`: a public "recompute begins / pin these chunks" API on the manager
would be the clean form (noted for the runtime's owner).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from agent.runtime.buffers import Slot
    from agent.runtime.manager import ModelStateManager


class RecomputeGuard:
    """Protects one checkpointed block's offloaded chunks during its recompute and backward."""

    def __init__(self, manager: ModelStateManager, block: nn.Module) -> None:
        self.manager = manager
        chunks: set[int] = set()
        for p in block.parameters():
            entry = manager.layout.entry(p)
            if entry is not None and manager.states[entry.chunk].offloaded:
                chunks.add(entry.chunk)
        self.chunks = sorted(chunks)
        self._pinned: list[tuple[Slot, int]] = []

    @property
    def needed(self) -> bool:
        return bool(self.chunks)

    def context_fn(self) -> tuple[AbstractContextManager[None], AbstractContextManager[None]]:
        """For `checkpoint(..., context_fn=...)`: nothing in forward, the guard around the recompute."""
        return nullcontext(), self._recompute()

    @contextmanager
    def _recompute(self) -> Iterator[None]:
        m = self.manager
        m._node, m._node_chunks = torch._C._current_autograd_node(), set()
        self._pinned.clear()  # pins of an earlier backward were cleared by the runtime at its end
        yield
        if m.pool is None:
            return
        for c in self.chunks:
            slot_index = m.states[c].slot
            if slot_index is not None:
                slot = m.pool.slots[slot_index]
                slot.pins += 1
                self._pinned.append((slot, c))

    def watch(self, args: Any, kwargs: Any) -> None:
        """In forward: release the pins when the block's input gradient is ready (or backward ends)."""
        for t in _tensors((args, kwargs)):
            if t.requires_grad:
                t.register_hook(self._on_input_grad)
                return
        # no input requires grad: the runtime clears every pin at the end of backward

    def _on_input_grad(self, grad: torch.Tensor) -> None:
        self.release()

    def release(self) -> None:
        for slot, c in self._pinned:
            if slot.chunk == c and slot.pins > 0:
                slot.pins -= 1
        self._pinned.clear()


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


GuardFactory = Callable[[nn.Module], RecomputeGuard | None]
