"""Parameters of offloaded chunks read outside their own module's forward (session 27).

The runtime makes a chunk resident in the forward pre-hooks of the modules owning its parameters
(`layout.hooked_parameters`: a module's own, and those of submodules that cannot run). Code can read a parameter
elsewhere: a root forward that ties the output to the embedding (`F.linear(h, self.embed.weight)`,
`h @ self.embed.weight.t()`: common in research language models), a parent reading a child's weight. When the
chunk is not resident then, its parameters point at the host copy: right values on a CPU device, and on a GPU
an op mixing a host tensor with device ones ("Expected all tensors to be on the same device").

`ForeignReads` is a `TorchFunctionMode` the runtime enters for each root forward on CUDA. Each op whose arguments
(or a list or tuple of them) hold a parameter of an offloaded chunk that no running module holds (no buffer, or
a buffer without pins) first makes that chunk resident (`ChunkResidency.acquire`, waiting for its upload) for
the op. The pin is dropped after the op unless its result views the chunk's buffer (`weight.t()`, a slice):
then at the end of the root forward, so the view is not overwritten by the next upload into that buffer. What
autograd saves of the read is handled as any parameter saved for backward (`saved_tensors.py`).

Cost: one Python call per op of the forward on CUDA (a type check per argument; an acquire only where a foreign
read happens). Not on a CPU device, where the host copy is read correctly.

Not covered (said in docs/architecture/runtime.md): a recomputation inside backward (activation checkpointing)
that reads a parameter outside its module (backward runs on autograd's device thread on CUDA, where the mode is
not active); parameters of device-sharded persistent chunks (`device_shards.py`) read outside their module.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from agent.runtime.accounting import Counters
from agent.runtime.chunks import ChunkState
from agent.runtime.residency import ChunkResidency

log = logging.getLogger(__name__)

# attribute access and metadata: no data read (`p.grad`, `p.data = view`, `p.data_ptr()` in the runtime's own
# hooks, which run inside the forward)
_METADATA = frozenset(
    {
        "__get__",
        "__set__",
        "__delete__",
        "data_ptr",
        "size",
        "dim",
        "numel",
        "nelement",
        "stride",
        "storage_offset",
        "untyped_storage",
        "element_size",
        "is_contiguous",
        "register_hook",
        "register_post_accumulate_grad_hook",
        "requires_grad_",
        "__hash__",
        "__repr__",
        "__format__",
    }
)


class ForeignReads(TorchFunctionMode):
    """Make an offloaded chunk resident for an op that reads its parameters outside their module (CUDA)."""

    def __init__(
        self,
        pos: dict[int, tuple[int, int]],
        states: list[ChunkState],
        residency: ChunkResidency,
        counters: Counters,
    ) -> None:
        super().__init__()
        self._pos = pos
        self._states = states
        self._residency = residency
        self._counters = counters
        self._held: list[int] = []  # chunks pinned until the root forward ends (a result views their buffer)
        self._warned = False

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        taken: list[int] = []
        if getattr(func, "__name__", "") not in _METADATA:
            for a in (*args, *kwargs.values()):
                if isinstance(a, (list, tuple)):
                    for b in a:
                        self._take(b, taken)
                else:
                    self._take(a, taken)
        out = func(*args, **kwargs)
        if taken:
            self._release(taken, out)
        return out

    def _take(self, a: Any, taken: list[int]) -> None:
        if not isinstance(a, nn.Parameter):
            return
        at = self._pos.get(id(a))
        if at is None:
            return
        st = self._states[at[0]]
        if not st.offloaded or at[0] in taken:
            return
        slots = self._residency.pool.slots
        if st.slot is not None and slots[st.slot].pins > 0:
            return  # a running module holds it (its own forward, or a foreign read kept for a view)
        try:
            self._residency.acquire(st.index, pin=True)
        except RuntimeError as exc:  # every buffer pinned: the op reads the host copy, as before session 27
            if not self._warned:
                self._warned = True
                log.warning("memplan: %s; a parameter read outside its module stays in host memory", exc)
            return
        taken.append(st.index)
        self._counters.foreign_reads += 1

    def _release(self, taken: list[int], out: Any) -> None:
        """Unpin the chunks taken for one op, except those its result views (kept until `end`)."""
        slots = self._residency.pool.slots
        views = {
            t.untyped_storage().data_ptr()
            for t in (out if isinstance(out, (list, tuple)) else (out,))
            if isinstance(t, torch.Tensor)
        }
        for c in taken:
            slot = slots[self._states[c].slot]  # type: ignore[index]
            if slot.params.untyped_storage().data_ptr() in views:
                self._held.append(c)
            else:
                slot.pins = max(0, slot.pins - 1)

    def end(self) -> None:
        """The root forward ended: the pins kept for results that view a buffer are dropped."""
        slots = self._residency.pool.slots
        for c in self._held:
            st = self._states[c]
            if st.slot is not None:
                slots[st.slot].pins = max(0, slots[st.slot].pins - 1)
        self._held = []
