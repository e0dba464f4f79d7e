"""Saved-tensor rebinding: tensors autograd saves that live in a device buffer are kept as (chunk, geometry).

A pack hook replaces any saved tensor in a buffer (a parameter, or a view such as `weight.t()`) by a
`SavedChunkView`; the unpack hook rebuilds it in backward from wherever the chunk is resident then,
uploading it if needed, so a buffer can be reused after forward without any saved tensor reading another
chunk's data. The hooks run only in scopes where such a tensor can be saved (the forward of each module
owning offloaded parameters, blocks the activation manager replaces), not around the whole forward: every
hooked saved tensor is a call from autograd into Python. The first training forward also hooks the whole
forward to check that no buffer tensor is saved outside those scopes; if one is, the whole forward is
hooked from then on.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from agent.runtime.device import DeviceContext
from agent.runtime.eager import eager
from agent.runtime.phase import Phase
from agent.runtime.residency import ChunkResidency
from agent.runtime.timing import PACK, UNPACK, RuntimeTiming, section


@dataclass(frozen=True)
class SavedChunkView:
    """A saved tensor that lived in a device buffer, recorded as the chunk and its geometry in it."""

    chunk: int
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


class SavedTensorRebinder:
    """Pushes and pops the saved-tensor hooks (per scope, or around the whole forward) and packs/unpacks."""

    def __init__(
        self,
        residency: ChunkResidency,
        ctx: DeviceContext,
        compute_dtype: torch.dtype,
        phase: Phase,
        on_backward: Callable[[], None],
        timing: RuntimeTiming,
    ) -> None:
        self.residency = residency
        self.ctx = ctx
        self.compute_dtype = compute_dtype
        self.phase = phase
        self.on_backward = on_backward  # an unpack outside forward means backward runs
        self.timing = timing
        self._root_pushed: list[str] = []  # per root forward call: "", "model" or "check"
        self._scope_depth = 0  # scopes with our hooks pushed now (nested scopes push nothing)
        self._module_scopes: list[tuple[int, bool]] = []  # per module call: (module id, pushed hooks)
        # whether a buffer tensor is saved outside every scope: None until a training forward checked it
        self.saved_outside: bool | None = None
        self._found_outside = False
        # the saved-tensor hooks as pushed, eager under torch.compile: autograd calls them from ops that run
        # eagerly inside a frame dynamo is compiling (agent/runtime/eager.py); they look `pack`/`unpack` up at
        # each call (the runtime probe and tests may replace them)
        self._pack_hook = eager(lambda t: self.pack(t))
        self._unpack_hook = eager(lambda packed: self.unpack(packed))
        self._check_hook = eager(lambda t: self._pack_check(t))

    # ================================================================ the wrapped model's forward
    def enter_root_forward(self, *, training: bool) -> None:
        """The wrapped model's forward starts (`training`: with grad): hook the whole forward when a buffer
        tensor was found saved outside the scopes, or check for one in the first training forward."""
        pushed = ""
        if training:
            if self.saved_outside:
                torch._C._autograd._push_saved_tensors_default_hooks(self._pack_hook, self._unpack_hook)
                self._scope_depth += 1
                pushed = "model"
            elif self.saved_outside is None and self._scope_depth == 0:
                self._found_outside = False
                torch._C._autograd._push_saved_tensors_default_hooks(self._check_hook, self._unpack_hook)
                pushed = "check"
        self._root_pushed.append(pushed)

    def skip_root_forward(self) -> None:
        """A forward re-run inside backward (recomputation): nothing to push."""
        self._root_pushed.append("")

    def exit_root_forward(self) -> None:
        """The wrapped model's forward ended: pop what `enter_root_forward` pushed, record the check's answer."""
        pushed = self._root_pushed.pop() if self._root_pushed else ""
        if pushed:
            torch._C._autograd._pop_saved_tensors_default_hooks()
        if pushed == "model":
            self._scope_depth -= 1
        elif pushed == "check":
            self.saved_outside = self._found_outside

    # ======================================================================= per-module scopes
    def enter_module(self, module_id: int) -> None:
        """A module owning offloaded parameters starts its forward: open a scope if needed."""
        self._module_scopes.append((module_id, False))
        if self.enter_scope():
            # the tensors this module's forward saves (its parameters, views of them) are recorded by
            # chunk, not by buffer; also for a module called on its own, outside the wrapped model's forward
            self._module_scopes[-1] = (module_id, True)

    def exit_module(self, module_id: int) -> None:
        """The module's forward ended: close its scope if it opened one."""
        if self._module_scopes and self._module_scopes[-1][0] == module_id:
            if self._module_scopes.pop()[1]:
                self.exit_scope()

    def enter_scope(self) -> bool:
        """Push the saved-tensor hooks for a scope, unless ours are already active (an enclosing scope, the
        whole forward) or it is not the time: in backward (a recomputation keeps its tensors itself: the
        chunks it acquires stay pinned), without grad (nothing is saved), or under someone else's hooks
        (torch's checkpoint, a user's: only the innermost hooks run, so ours would take tensors away from
        them; the whole-forward hooks were outermost as well). True when it pushed."""
        if self._scope_depth or self.phase.backward or not torch.is_grad_enabled():
            return False
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if top is not None and top[0] is not self._check_hook:
            return False
        torch._C._autograd._push_saved_tensors_default_hooks(self._pack_hook, self._unpack_hook)
        self._scope_depth += 1
        return True

    def exit_scope(self) -> None:
        """Pop the hooks `enter_scope` pushed."""
        torch._C._autograd._pop_saved_tensors_default_hooks()
        self._scope_depth -= 1

    @contextmanager
    def scope(self) -> Iterator[None]:
        """A scope of the saved-tensor hooks around a block whose forward the activation manager replaces
        (swap, checkpoint): entered before the block's own hooks, so the runtime's stay outermost (the swap
        store passes model-state tensors on to them; checkpoint keeps every tensor of its forward itself)."""
        pushed = self.enter_scope()
        try:
            yield
        finally:
            if pushed:
                self.exit_scope()

    # ============================================================================ pack / unpack
    def _pack_check(self, t: torch.Tensor) -> Any:
        """Whole-forward hook of the first training forward: a buffer tensor reaching it was saved outside
        every scope (a parameter used outside its module): the whole forward is hooked from then on."""
        packed = self.pack(t)
        if packed is not t:
            self._found_outside = True
        return packed

    @section(PACK)
    def pack(self, t: torch.Tensor) -> Any:
        """Saved-tensor pack hook: a tensor living in a device buffer becomes (chunk, geometry).

        Activation management must call this first from its own pack hook, and `unpack` from its unpack
        hook: only the innermost `saved_tensors_hooks` run."""
        if t.device != self.ctx.device:
            return t
        slot = self.residency.slot_by_storage.get(t.untyped_storage().data_ptr())
        if slot is None or slot.chunk is None:
            return t
        if t.dtype != self.compute_dtype:
            return t.clone()  # a dtype-reinterpreting view of a buffer: keep a private copy
        return SavedChunkView(slot.chunk, int(t.storage_offset()), tuple(t.shape), tuple(t.stride()))

    @section(UNPACK)
    def unpack(self, packed: Any) -> torch.Tensor:
        """Saved-tensor unpack hook: rebuild a packed buffer tensor from wherever its chunk is now."""
        if not isinstance(packed, SavedChunkView):
            return packed
        if not self.phase.forward:
            self.on_backward()
        slot = self.residency.acquire(packed.chunk)
        self.residency.note_unpacked(packed.chunk)
        return slot.params.as_strided(packed.size, packed.stride, packed.offset)
