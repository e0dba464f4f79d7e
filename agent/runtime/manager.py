"""Model-state manager: keeps every parameter where the plan puts it and moves it when it is needed.

The flow of one iteration (offloaded chunks; persistent chunks stay on the device, their `.grad` are views
of the chunk's gradient area: after `zero_grad()` they are None as in plain PyTorch, and the gradient hook
copies each fresh gradient into the area and points `.grad` there):
- forward: a pre-hook on each module that owns parameters makes its chunks resident (demand upload
  into a device buffer, or a hit) and pins them for the module's forward; the next chunks in the
  recorded access order are prefetched into buffers whose chunks are needed later or never.
- saved tensors: a saved-tensor hook replaces any tensor that lives in a device buffer (a parameter, or
  a view of one such as `weight.t()`) by (chunk, geometry); in backward it is rebuilt from wherever the
  chunk is resident then, uploading it if needed. So a buffer can be reused after forward without any
  saved tensor reading another chunk's data. The hook runs only where such a tensor can be saved: around
  the forward of each module that owns parameters of an offloaded chunk (and around swapped or
  checkpointed blocks, entered by the activation manager outside its own hooks, see `saved_scope`), not
  around the whole forward: every hooked saved tensor is a call from autograd into Python (pack and
  unpack), which the blocks of persistent chunks would pay for nothing. The first training forward also
  hooks the whole forward to check that no buffer tensor is saved outside those scopes (a parameter used
  outside its own module); if one is, the whole forward is hooked from then on.
- backward: chunks still resident after forward are used as they are (no re-upload). Each parameter's
  gradient is gathered into its chunk's gradient area (post-accumulate-grad hook); when every
  parameter of the chunk used in forward has its gradient, the gradient area is copied to the host on
  the offload stream and the chunk leaves its buffer; with `overlap_host_step` the host worker then
  steps that chunk while backward goes on, speculatively (its master and optimizer state are kept to undo
  it). A callback at the end of backward settles stragglers and gives every offloaded parameter a `.grad`
  (a host view of its chunk's `user_grad`), so clipping and any user code see every gradient.
- step: persistent chunks step on the device; each offloaded chunk's speculative step is validated (is its
  `.grad`, its set of stepped parameters, its hyper-parameters what the step used?) and, where not, restored
  and redone; chunks not yet stepped are queued on the host worker; `step()` then waits for the host work
  (unless `async_step`: then a chunk's next upload, or any state access, waits). A training forward before
  `step()` (gradient accumulation) or `zero_grad()` without `step()` undoes the speculative steps.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from agent.runtime.accounting import Counters, MemoryReport, RuntimeReport
from agent.runtime.buffers import BufferPool, Slot
from agent.runtime.chunks import ChunkState, allocate, bind, stage_for, views
from agent.runtime.device import DeviceContext, Event, element_size
from agent.runtime.host_worker import HostWorker
from agent.runtime.layout import ChunkLayout
from agent.runtime.options import RuntimeOptions
from agent.runtime.schedule import AccessSchedule, Direction

if TYPE_CHECKING:
    from agent.runtime.optimizer import ChunkedOptimizer, ChunkStepper


@dataclass(frozen=True)
class SavedChunkView:
    """A saved tensor that lived in a device buffer, recorded as the chunk and its geometry in it."""

    chunk: int
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


class ModelStateManager:
    def __init__(
        self, model: nn.Module, layout: ChunkLayout, ctx: DeviceContext, options: RuntimeOptions
    ) -> None:
        self.model = model
        self.layout = layout
        self.ctx = ctx
        self.options = options
        self.counters = Counters()
        self._original = {id(e.param): (e.param.dtype, e.param.device) for e in layout.by_param.values()}
        self.states: list[ChunkState] = [
            allocate(spec, ctx, layout.compute_dtype, fp32_master=options.fp32_master) for spec in layout.chunks
        ]
        self._pos = {id(e.param): (e.chunk, j) for spec in layout.chunks for j, e in enumerate(spec.entries)}
        self.has_offload = bool(layout.offloaded)
        self.pool = (
            BufferPool(ctx, layout.n_buffers, layout.chunk_numel, layout.compute_dtype)
            if self.has_offload
            else None
        )
        self._slot_by_storage = self.pool.storage_ids() if self.pool else {}
        self.schedule = AccessSchedule([c.index for c in layout.offloaded])
        self.worker = HostWorker(inline=not ctx.is_cuda) if self.has_offload else None
        self.optimizer: ChunkedOptimizer | None = None
        self.steppers: list[ChunkStepper] = []
        self._handles: list[RemovableHandle] = []
        self._phase = "idle"
        self._root_grad = False
        # gradient accumulation: backward passes since the last optimizer.step(), and how many the last step
        # had; host steps are speculated only in the backward expected to be the last before a step
        self._backwards = 0
        self._accumulation = 1
        self._clock = 0
        # chunks whose saved tensors the running backward node has unpacked: it is about to read them,
        # so no upload may overwrite their buffers until the next node runs
        self._node: Any = None
        self._node_chunks: set[int] = set()
        # saved-tensor hooks (see the module docstring): pushed by the root forward (whole-forward mode, or
        # the first training forward's check), by scopes (modules owning offloaded parameters, blocks)
        self._root_pushed: list[str] = []  # per root forward call: "", "model" or "check"
        self._scope_depth = 0  # scopes with our hooks pushed now (nested scopes push nothing)
        self._module_scopes: list[tuple[int, bool]] = []  # per module call: (module id, pushed hooks)
        # whether a buffer tensor is saved outside every scope: None until a training forward checked it
        self._saved_outside: bool | None = None
        self._found_outside = False
        self._upload_timings: list[tuple[Event, Event]] = []  # (start, end) of each upload
        self._stall_timings: list[tuple[Event, Event]] = []  # (compute reached the wait, upload done)
        self._esize = element_size(layout.compute_dtype)
        # per (slot index, -1 for the chunk's host copy, -2 for a persistent chunk's gradients; chunk): the
        # parameters' views (making them is most of the cost of binding or of re-pointing `.grad`)
        self._bind_views: dict[tuple[int, int], list[torch.Tensor]] = {}
        self._move_buffers_to_device()
        self._install_hooks()

    # ================================================================================== setup/teardown
    def attach_optimizer(self, optimizer: ChunkedOptimizer) -> None:
        from agent.runtime.optimizer import ChunkStepper

        self.optimizer = optimizer
        group_of = optimizer.group_of()
        self.steppers = [
            ChunkStepper(st, optimizer.user_class, optimizer.param_groups, group_of, optimizer.device_impl)
            for st in self.states
        ]

    def _move_buffers_to_device(self) -> None:
        for module in self.model.modules():
            for name, buf in module._buffers.items():
                if buf is not None and buf.device != self.ctx.device:
                    module._buffers[name] = buf.to(self.ctx.device)

    def _install_hooks(self) -> None:
        self._hooked: set[int] = set()
        self._sync_grad_hooks()
        m = self.model
        self._handles.append(m.register_forward_pre_hook(self._on_root_forward, prepend=True))
        self._handles.append(m.register_forward_hook(self._after_root_forward, always_call=True))
        self._handles.append(m.register_state_dict_pre_hook(self._before_state_dict))
        self._handles.append(m.register_load_state_dict_pre_hook(self._before_load_state_dict))
        self._handles.append(m.register_load_state_dict_post_hook(self._after_load_state_dict))
        # `model.zero_grad()` (what e.g. the Hugging Face Trainer calls) must reset the chunk gradients too:
        # offloaded parameters have no `.grad` for it to clear.
        m.zero_grad = self._model_zero_grad  # type: ignore[method-assign]
        if not self.has_offload:
            return
        seen: set[int] = set()
        for module in m.modules():
            if id(module) in seen:
                continue
            seen.add(id(module))
            chunks: set[int] = set()
            expected: dict[int, list[int]] = {}
            for p in module._parameters.values():
                if p is None or id(p) not in self._pos:
                    continue
                c, j = self._pos[id(p)]
                if self.states[c].offloaded:
                    chunks.add(c)
                    expected.setdefault(c, []).append(j)
            if chunks:
                assert len(chunks) <= self.layout.n_buffers  # checked by ChunkLayout.from_policy
                ordered = sorted(chunks)
                self._handles.append(
                    module.register_forward_pre_hook(partial(self._before_module, ordered, expected))
                )
                self._handles.append(
                    module.register_forward_hook(partial(self._after_module, ordered), always_call=True)
                )

    def _sync_grad_hooks(self) -> None:
        """Gradient hooks on every parameter that requires grad now (also ones unfrozen after wrap)."""
        for e in self.layout.by_param.values():
            if e.param.requires_grad and id(e.param) not in self._hooked:
                self._handles.append(e.param.register_post_accumulate_grad_hook(self._on_grad))
                self._hooked.add(id(e.param))

    def remove_hooks(self) -> None:
        """Remove every hook from the model and its parameters (the parameters stay bound to the chunks)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._hooked.clear()
        if "zero_grad" in vars(self.model):
            del self.model.zero_grad

    def detach(self) -> None:
        """Remove every hook and turn parameters back into ordinary tensors with their trained values."""
        self.synchronize()
        self.evict_all()
        self.remove_hooks()
        with torch.no_grad():
            for st in self.states:
                source = st.master if st.mixed or st.offloaded else st.params
                assert source is not None
                for e, v in zip(st.spec.entries, views(source, st.spec.entries), strict=True):
                    dtype, device = self._original[id(e.param)]
                    e.param.data = v.to(device=device, dtype=dtype, copy=True)
                    e.param.grad = None
        if self.worker is not None:
            self.worker.shutdown()
        self.states = []
        self.steppers = []
        self.pool = None
        self._bind_views = {}

    # ======================================================================================= phases
    def _on_root_forward(self, module: nn.Module, args: Any) -> None:
        self._recover_if_aborted()
        if self._phase == "backward":
            self._root_pushed.append("")
            return  # a forward re-run inside backward (recomputation)
        self._phase = "forward"
        if self.has_offload and torch.is_grad_enabled():
            self._retract_grads()  # gradients of this forward's backward add to the host gradients
        # a forward with grad enabled at the root will be backpropagated through every module it runs,
        # also those run under no_grad inside it (re-entrant checkpointing recomputes them in backward)
        self._root_grad = torch.is_grad_enabled()
        self._sync_grad_hooks()
        self.schedule.start(Direction.forward, record=True)
        pushed = ""
        if self.has_offload and torch.is_grad_enabled():
            if self._saved_outside:
                torch._C._autograd._push_saved_tensors_default_hooks(self.pack_saved, self.unpack_saved)
                self._scope_depth += 1
                pushed = "model"
            elif self._saved_outside is None and self._scope_depth == 0:
                self._found_outside = False
                torch._C._autograd._push_saved_tensors_default_hooks(self._pack_check, self.unpack_saved)
                pushed = "check"
        self._root_pushed.append(pushed)

    def _after_root_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        pushed = self._root_pushed.pop() if self._root_pushed else ""
        if pushed:
            torch._C._autograd._pop_saved_tensors_default_hooks()
        if pushed == "model":
            self._scope_depth -= 1
        elif pushed == "check":
            self._saved_outside = self._found_outside
        if self._phase == "forward":
            self._phase = "idle"
            if torch.is_grad_enabled():
                # Backward starts in the outermost graph task at the loss, before any re-entrant
                # (nested) backward a checkpointed block may run: the end-of-backward callback must be
                # queued there, not in a nested task that ends early.
                for t in _tensors(output):
                    if t.requires_grad:
                        t.register_hook(self._on_output_grad)

    def _on_output_grad(self, grad: torch.Tensor) -> None:
        self._ensure_backward()

    def _ensure_backward(self) -> None:
        if self._phase == "backward":
            return
        self._phase = "backward"
        self.schedule.start(Direction.backward, record=True)
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _recover_if_aborted(self) -> None:
        """A backward that raised never ran its end callback: settle it (keep its partial gradients,
        as torch keeps partial `.grad`, and step nothing) before anything else touches the state."""
        if self._phase == "backward" and torch._C._current_graph_task_id() == -1:
            self._end_backward(aborted=True)

    def _end_backward(self, *, aborted: bool = False) -> None:
        for st in self.states:
            if st.offloaded and (st.in_slot or (st.received and not st.complete)):
                if aborted:  # keep the partial gradients (as torch keeps partial .grad), step nothing
                    st.recompute_pins = 0
                    if st.slot is not None:
                        assert self.pool is not None
                        self.pool.slots[st.slot].pins = 0
                        self._evict(self.pool.slots[st.slot])
                else:
                    self._complete(st)
        for st in self.states:
            st.expected.clear()
            st.received.clear()
            st.complete = False
            st.recompute_pins = 0
        if self.pool is not None:
            for slot in self.pool.slots:
                slot.pins = 0
        self.schedule.finish_recording()
        self._node = None
        self._node_chunks = set()
        self._phase = "idle"
        self.counters.iterations += 1
        if not aborted:
            self._backwards += 1
            if self.has_offload:
                self._expose_grads()

    # ================================================================================ module hooks
    def _before_module(
        self, chunks: list[int], expected: dict[int, list[int]], module: nn.Module, args: Any
    ) -> None:
        self._module_scopes.append((id(module), False))
        for c in chunks:
            self._acquire(c, pin=True)
            if self._phase == "backward":
                # a recomputation (activation checkpointing) inside backward: the tensors it saves
                # point into the buffer directly, so the chunk stays put until its gradients are done
                self.states[c].recompute_pins += 1
        if torch.is_grad_enabled() or (self._phase == "forward" and self._root_grad):
            for c, js in expected.items():
                entries = self.states[c].spec.entries
                self.states[c].expected.update(j for j in js if entries[j].param.requires_grad)
        if self._enter_scope():
            # the tensors this module's forward saves (its parameters, views of them) are recorded by
            # chunk, not by buffer; also for a module called on its own, outside the wrapped model's forward
            self._module_scopes[-1] = (id(module), True)

    def _after_module(self, chunks: list[int], module: nn.Module, args: Any, output: Any) -> None:
        assert self.pool is not None
        if self._module_scopes and self._module_scopes[-1][0] == id(module):
            if self._module_scopes.pop()[1]:
                self._exit_scope()
        if self._phase == "backward":
            return  # recomputation: pins held until the chunk's gradients are complete
        for c in chunks:
            st = self.states[c]
            if st.slot is not None:
                slot = self.pool.slots[st.slot]
                slot.pins = max(0, slot.pins - 1)

    # ============================================================================== saved tensors
    def _enter_scope(self) -> bool:
        """Push the saved-tensor hooks for a scope, unless ours are already active (an enclosing scope, the
        whole forward) or it is not the time: in backward (a recomputation keeps its tensors itself: the
        chunks it acquires stay pinned), without grad (nothing is saved), or under someone else's hooks
        (torch's checkpoint, a user's: only the innermost hooks run, so ours would take tensors away from
        them; the whole-forward hooks were outermost as well). True when it pushed."""
        if not self.has_offload or self._scope_depth or self._phase == "backward" or not torch.is_grad_enabled():
            return False
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if top is not None and top[0] != self._pack_check:
            return False
        torch._C._autograd._push_saved_tensors_default_hooks(self.pack_saved, self.unpack_saved)
        self._scope_depth += 1
        return True

    def _exit_scope(self) -> None:
        torch._C._autograd._pop_saved_tensors_default_hooks()
        self._scope_depth -= 1

    @contextmanager
    def saved_scope(self) -> Iterator[None]:
        """A scope of the saved-tensor hooks around a block whose forward the activation manager replaces
        (swap, checkpoint): entered before the block's own hooks, so the runtime's stay outermost (the swap
        store passes model-state tensors on to them; checkpoint keeps every tensor of its forward itself)."""
        pushed = self._enter_scope()
        try:
            yield
        finally:
            if pushed:
                self._exit_scope()

    def _pack_check(self, t: torch.Tensor) -> Any:
        """Whole-forward hook of the first training forward: a buffer tensor reaching it was saved outside
        every scope (a parameter used outside its module): the whole forward is hooked from then on."""
        packed = self.pack_saved(t)
        if packed is not t:
            self._found_outside = True
        return packed

    def pack_saved(self, t: torch.Tensor) -> Any:
        """Saved-tensor pack hook: a tensor living in a device buffer becomes (chunk, geometry).

        Activation management (issue 7) must call this first from its own pack hook, and
        `unpack_saved` from its unpack hook: only the innermost `saved_tensors_hooks` run."""
        if t.device != self.ctx.device:
            return t
        slot = self._slot_by_storage.get(t.untyped_storage().data_ptr())
        if slot is None or slot.chunk is None:
            return t
        if t.dtype != self.layout.compute_dtype:
            return t.clone()  # a dtype-reinterpreting view of a buffer: keep a private copy
        return SavedChunkView(slot.chunk, int(t.storage_offset()), tuple(t.shape), tuple(t.stride()))

    def unpack_saved(self, packed: Any) -> torch.Tensor:
        """Saved-tensor unpack hook: rebuild a packed buffer tensor from wherever its chunk is now."""
        if not isinstance(packed, SavedChunkView):
            return packed  # type: ignore[no-any-return]
        if self._phase != "forward":
            self._ensure_backward()
        node = torch._C._current_autograd_node()
        if node is not self._node:
            self._node, self._node_chunks = node, set()
        slot = self._acquire(packed.chunk)
        self._node_chunks.add(packed.chunk)
        return slot.params.as_strided(packed.size, packed.stride, packed.offset)

    # ================================================================================== residency
    def _acquire(self, c: int, *, pin: bool = False) -> Slot:
        assert self.pool is not None
        st = self.states[c]
        self._clock += 1
        self.schedule.demand(c)
        if st.slot is None:
            self._upload(st, self._victim(demand=True))
            self.counters.demand_uploads += 1
        else:
            self.counters.resident_hits += 1
        slot = self.pool.slots[st.slot]  # type: ignore[index]
        slot.last_use = self._clock
        if pin:
            slot.pins += 1
        if self.options.measure_uploads and st.ready is not None:
            self._stall_timings.append((self.ctx.record(timing=True), st.ready))
        self.ctx.wait(st.ready)
        self._prefetch()
        return slot

    def _victim(self, *, demand: bool, before: float = float("inf")) -> Slot | None:
        assert self.pool is not None
        for slot in self.pool.slots:
            if slot.chunk is None:
                return slot
        # the chunks the running backward node unpacked; a node that is no longer running reads nothing (a
        # recompute inside a later node's unpack must be able to evict what an earlier node used)
        node_chunks = self._node_chunks if torch._C._current_autograd_node() is self._node else set()
        candidates = [s for s in self.pool.slots if s.pins == 0 and s.chunk not in node_chunks]
        if not candidates:
            if demand:
                held = [s.chunk for s in self.pool.slots]
                raise RuntimeError(
                    f"chunk runtime: all {len(self.pool.slots)} device buffers hold chunks in use {held}; "
                    "the plan needs more buffers (policy.n_buffers) for this model"
                    + (
                        " (chunks recomputed in backward by activation checkpointing stay resident until "
                        "their gradients are complete)"
                        if any(self.states[c].recompute_pins for c in held if c is not None)
                        else ""
                    )
                )
            return None
        best = max(candidates, key=lambda s: (self.schedule.next_use(s.chunk), -s.last_use))  # type: ignore[arg-type]
        if not demand and self.schedule.next_use(best.chunk) <= before:  # type: ignore[arg-type]
            return None
        return best

    def _prefetch(self) -> None:
        assert self.pool is not None
        for t in self.schedule.upcoming(len(self.pool.slots) - 1):
            st = self.states[t]
            if st.slot is not None or not st.offloaded:
                continue
            if st.host_work is not None and not st.host_work.done():
                break  # its host step is still running: do not block the training thread for a prefetch
            victim = self._victim(demand=False, before=self.schedule.next_use(t))
            if victim is None:
                break
            self._upload(st, victim)
            self.counters.prefetches += 1

    def _upload(self, st: ChunkState, slot: Slot | None) -> None:
        assert slot is not None and st.host_params is not None
        if slot.chunk is not None:
            self._evict(slot)
        st.wait_host()  # the host step must have finished writing the upload source
        n = st.numel
        stream = self.ctx.upload_stream
        with self.ctx.on(stream):
            for ev in slot.free_after:
                self.ctx.wait(ev, stream)
            slot.free_after.clear()
            timing = self.options.measure_uploads
            start = self.ctx.record(stream, timing=True) if timing else None
            slot.params[:n].copy_(st.host_params, non_blocking=True)
            slot.grad[:n].zero_()
            st.ready = self.ctx.record(stream, timing=timing)
            if start is not None:
                self._upload_timings.append((start, st.ready))
        slot.chunk = st.index
        st.slot = slot.index
        self._bind(slot.params, slot.index, st)
        self.counters.uploads += 1
        self.counters.upload_bytes += n * self._esize

    def _evict(self, slot: Slot) -> None:
        assert slot.chunk is not None
        st = self.states[slot.chunk]
        if st.in_slot:
            self._flush(st, slot)
        slot.free_after.append(self.ctx.record())  # compute that read the buffer so far
        assert st.host_params is not None
        self._bind(st.host_params, -1, st)
        slot.chunk = None
        st.slot = None
        st.ready = None
        self.counters.evictions += 1

    def _bind(self, flat: torch.Tensor, where: int, st: ChunkState) -> None:
        """Point the chunk's parameters into `flat` (slot `where`, or -1: the host copy), views cached."""
        key = (where, st.index)
        cached = self._bind_views.get(key)
        if cached is None:
            cached = self._bind_views[key] = views(flat, st.spec.entries)
        bind(flat, st.spec.entries, cached)

    def _grad_views(self, st: ChunkState) -> list[torch.Tensor]:
        """The persistent chunk's per-parameter gradient views (made once: its gradient buffer never moves)."""
        cached = self._bind_views.get((-2, st.index))
        if cached is None:
            assert st.grad is not None
            cached = self._bind_views[(-2, st.index)] = views(st.grad, st.spec.entries)
        return cached

    def evict_all(self) -> None:
        if self.pool is not None:
            for slot in self.pool.slots:
                if slot.chunk is not None:
                    self._evict(slot)

    # ================================================================================== gradients
    def _on_grad(self, param: torch.Tensor) -> None:
        self._ensure_backward()
        if param.grad is None:
            return
        c, j = self._pos[id(param)]
        st = self.states[c]
        e = st.spec.entries[j]
        if not st.offloaded:
            view = self._grad_views(st)[j]
            if param.grad.data_ptr() != view.data_ptr():  # a fresh gradient (after zero_grad), or the user's
                view.copy_(param.grad)
                param.grad = view
            st.touched.add(j)
            return
        if st.stepped:
            # a parameter used again after its chunk's speculative step (e.g. outside its module's forward)
            self._undo(st, why=f"parameter {e.name!r} got a gradient after its chunk's speculative host step")
        if st.slot is None:
            self._acquire(c)
        assert self.pool is not None and st.slot is not None
        dst = self.pool.slots[st.slot].grad[e.offset : e.end]
        if j in st.in_slot:
            dst.add_(param.grad.reshape(-1))
        else:
            dst.copy_(param.grad.reshape(-1))
        param.grad = None
        st.in_slot.add(j)
        st.received.add(j)
        if st.expected and st.expected <= st.received:
            self._complete(st)

    def _complete(self, st: ChunkState) -> None:
        """Every expected gradient of the chunk has arrived: send them to the host, step if overlapping."""
        assert self.pool is not None
        if st.slot is not None:
            slot = self.pool.slots[st.slot]
            slot.pins = max(0, slot.pins - st.recompute_pins)
            st.recompute_pins = 0
            if slot.pins == 0:
                self._evict(slot)
            elif st.in_slot:
                self._flush(st, slot, keep=True)
        st.complete = True
        if self._speculating() and st.touched and not st.stepped and self.optimizer is not None:
            self._submit_step(st, speculative=True)

    def _flush(self, st: ChunkState, slot: Slot, *, keep: bool = False) -> None:
        """Copy the chunk's gradient area to the host (overwrite after zero_grad, else add)."""
        assert st.host_grad is not None and self.worker is not None
        st.wait_host()  # host work may still read host_grad or the staging buffer
        n = st.numel
        first = st.flushes == 0
        direct = first and not st.mixed
        target = st.host_grad if direct else stage_for(st, self.ctx, self.layout.compute_dtype)
        computed = self.ctx.record()
        stream = self.ctx.offload_stream
        with self.ctx.on(stream):
            self.ctx.wait(computed, stream)
            target[:n].copy_(slot.grad[:n], non_blocking=True)
            copied = self.ctx.record(stream)
        slot.free_after.append(copied)
        if keep:
            self.ctx.wait(copied)
            slot.grad[:n].zero_()
        st.flushes += 1
        st.touched |= st.in_slot
        st.in_slot.clear()
        events = [*st.pending_events, copied]
        st.pending_events = []
        if direct:
            st.pending_events = events
        else:
            st.host_work = self.worker.submit(self._absorb, st, events, first)
        self.counters.grad_flushes += 1
        self.counters.grad_flush_bytes += n * self._esize

    def _absorb(self, st: ChunkState, events: list[Event], first: bool) -> None:
        """Host worker: fold the staged gradient copy into the fp32 host gradient."""
        for ev in events:
            self.ctx.host_wait(ev)
        assert st.host_grad is not None and st.stage is not None
        if first:
            st.host_grad.copy_(st.stage)
        else:
            st.host_grad.add_(st.stage)

    # ================================================================================== optimizer
    def _speculating(self) -> bool:
        """Step offloaded chunks during this backward: overlapping, and (with gradient accumulation) this is
        the backward the last optimizer step was taken after (earlier micro-batches' steps would be undone)."""
        return self.options.overlap_host_step and self._backwards + 1 >= self._accumulation

    def _submit_step(self, st: ChunkState, *, speculative: bool = False, redo: bool = False) -> None:
        """Queue the chunk's host step. Speculative (during backward): first the gradient `.grad` will show
        is filled, and (undo_host_steps) the master and optimizer state are kept. Redo: the speculative
        step is undone first."""
        assert self.optimizer is not None and self.worker is not None
        hypers = self.optimizer.hyper_snapshot()
        events = st.pending_events
        st.pending_events = []
        backup = speculative and self.options.undo_host_steps
        touched = set(st.touched)
        st.host_work = self.worker.submit(self._host_step, st, hypers, touched, events, speculative, backup, redo)
        st.stepped = speculative
        st.spec_backup = backup
        st.spec_hypers = hypers if speculative else None
        st.spec_touched = frozenset(touched)
        if speculative:
            st.user_grad_filled = True
            self.counters.speculative_steps += 1

    def _host_step(
        self, st: ChunkState, hypers: list[dict[str, Any]], touched: set[int], events: list[Event],
        speculative: bool, backup: bool, redo: bool,
    ) -> None:
        """Host worker: the chunk's optimizer step on its fp32 master, then refresh the upload source.

        The step reads only `host_grad`, never the `.grad` the user sees (`user_grad`), so user code may
        scale `.grad` while host steps run."""
        for ev in events:
            self.ctx.host_wait(ev)
        t0 = time.perf_counter()
        assert st.host_grad is not None and st.host_params is not None and st.master is not None
        if redo:
            self._restore(st)
        if speculative:
            self._fill_user_grad(st)
            if backup:
                if st.backup_master is None:
                    st.backup_master = torch.empty_like(st.master)
                st.backup_master.copy_(st.master)
                self.steppers[st.index].snapshot()
        self.steppers[st.index].step(hypers, st.host_grad, touched)
        if st.mixed:
            st.host_params.copy_(st.master)
        self.counters.host_step_s += time.perf_counter() - t0
        self.counters.host_steps += 1

    def _fill_user_grad(self, st: ChunkState, events: list[Event] | None = None) -> None:
        """Host worker: the gradient `.grad` shows, from the host gradient (cast to the compute dtype)."""
        for ev in events or []:
            self.ctx.host_wait(ev)
        assert st.host_grad is not None
        if st.user_grad is None:
            st.user_grad = torch.empty(st.numel, dtype=self.layout.compute_dtype, device=st.host_grad.device)
        st.user_grad.copy_(st.host_grad)

    def _restore(self, st: ChunkState) -> None:
        """Host worker: undo the chunk's speculative step (master, compute copy, optimizer state)."""
        assert st.master is not None and st.backup_master is not None and st.host_params is not None
        st.master.copy_(st.backup_master)
        self.steppers[st.index].restore()
        if st.mixed:
            st.host_params.copy_(st.master)

    def _undo(self, st: ChunkState, *, why: str) -> None:
        """Undo a speculative step now (another backward adds to the gradient, or no step follows)."""
        if not st.stepped:
            return
        if not st.spec_backup:
            raise RuntimeError(
                f"chunk runtime: {why}, and RuntimeOptions(undo_host_steps=False) keeps nothing to undo it with. "
                "Use undo_host_steps=True (the default) or overlap_host_step=False."
            )
        assert self.worker is not None and self.pool is not None
        if st.slot is not None:  # its buffer may hold the stepped values: upload the restored ones on demand
            self._evict(self.pool.slots[st.slot])
        st.wait_host()
        st.host_work = self.worker.submit(self._restore, st)
        st.stepped = False
        st.spec_hypers = None
        st.user_grad_filled = False
        self.counters.host_step_undos += 1

    # ==================================================================== gradients the user sees
    def _expose_grads(self) -> None:
        """End of backward: every offloaded parameter with a gradient gets `.grad`, a view of its chunk's
        `user_grad` (host, compute dtype), so code that reads or scales `.grad` (torch's clip_grad_norm_,
        Accelerate, the Trainer) sees every gradient. In-flight host steps are settled first, so the
        user never reads a gradient the worker is writing."""
        assert self.worker is not None and self.pool is not None
        for st in self.states:
            if st.offloaded and st.touched and not st.user_grad_filled:
                events = st.pending_events
                st.pending_events = []
                st.host_work = self.worker.submit(self._fill_user_grad, st, events)
                st.user_grad_filled = True
        for st in self.states:
            if not st.offloaded or not st.touched:
                continue
            st.wait_host()
            assert st.user_grad is not None
            if st.slot is not None:
                # `.grad` must be on the parameter's device (the host copy), and the buffer is stale once the
                # chunk is stepped (a chunk still pinned when it completed, e.g. by a recomputation, stayed)
                self._evict(self.pool.slots[st.slot])
            gv = self._user_grad_views(st)
            for j, e in enumerate(st.spec.entries):
                e.param.grad = gv[j] if j in st.touched else None
            st.exposed = True
            st.user_grad_filled = False

    def _user_grad_views(self, st: ChunkState) -> list[torch.Tensor]:
        cached = self._bind_views.get((-3, st.index))
        if cached is None:
            assert st.user_grad is not None
            cached = self._bind_views[(-3, st.index)] = views(st.user_grad, st.spec.entries)
        return cached

    def _reconcile(self, st: ChunkState) -> bool:
        """Make the host gradient what the user's `.grad` now says; True when it changed since exposure.

        A `.grad` replaced by another tensor is copied in, one set to None drops the parameter from the
        step (as torch skips it). The gradient is compared by value: torch's clip multiplies by its clamped
        coefficient even when it is 1.0 (no change), and version counters cannot tell: they bump without a
        change, and `torch._foreach_mul_` on CPU was seen changing values without bumping them (torch 2.13)."""
        if not st.exposed:
            return False
        assert st.user_grad is not None and st.host_grad is not None
        changed = False
        gv = self._user_grad_views(st)
        for j in sorted(st.touched):
            g = st.spec.entries[j].param.grad
            if g is None:
                st.touched.discard(j)
                changed = True
            elif g is not gv[j]:
                gv[j].copy_(g)
        if not torch.equal(st.user_grad, st.host_grad.to(st.user_grad.dtype)):
            st.host_grad.copy_(st.user_grad)
            changed = True
        return changed

    def _sync_persistent_grads(self, st: ChunkState) -> None:
        """A persistent chunk steps from its gradient area, which its parameters' `.grad` view: a `.grad`
        the user replaced by another tensor is copied in, one set to None is not stepped (as in torch)."""
        gv = self._grad_views(st)
        for j in sorted(st.touched):
            g = st.spec.entries[j].param.grad
            if g is None:
                st.touched.discard(j)
            elif g is not gv[j]:
                gv[j].copy_(g)
                st.spec.entries[j].param.grad = gv[j]

    def _retract_grads(self) -> None:
        """Before a training forward: the user's edits go into the host gradients, `.grad` of offloaded
        parameters goes back to None (the next backward adds on the host), and a speculative step that no
        `optimizer.step()` confirmed is undone (gradient accumulation: the gradient is not final)."""
        for st in self.states:
            if not st.offloaded or not (st.exposed or st.stepped):
                continue
            st.wait_host()
            self._reconcile(st)
            if st.stepped:
                self._undo(st, why="another backward pass started before optimizer.step() (gradient accumulation)")
            if st.exposed:
                for e in st.spec.entries:
                    e.param.grad = None
                st.exposed = False

    @torch.no_grad()
    def step(self) -> None:
        self._recover_if_aborted()
        if self._phase == "backward":
            raise RuntimeError("optimizer.step(): called during backward")
        assert self.optimizer is not None
        hypers = self.optimizer.hyper_snapshot()
        for st in self.states:
            if st.offloaded or not st.touched:
                continue
            assert st.grad is not None and st.params is not None and st.master is not None
            self._sync_persistent_grads(st)
            grad = st.grad.float() if st.mixed else st.grad
            self.steppers[st.index].step(hypers, grad, st.touched)
            if st.mixed:
                st.params.copy_(st.master)
            self.counters.device_steps += 1
        self._accumulation = max(1, self._backwards)
        self._backwards = 0
        for st in self.states:
            if not st.offloaded:
                continue
            st.wait_host()
            changed = self._reconcile(st)
            if st.stepped:
                if changed or st.spec_touched != frozenset(st.touched) or not _same_hypers(st.spec_hypers, hypers):
                    # validation failed: the gradient (e.g. clipped), the parameters with a gradient or the
                    # hyper-parameters differ from what the speculative step used: restore and step again
                    if not st.spec_backup:
                        raise RuntimeError(
                            f"optimizer.step(): the gradients of offloaded chunk {st.index} changed after its "
                            "overlapped host step (e.g. clipping that scaled them), and "
                            "RuntimeOptions(undo_host_steps=False) keeps nothing to undo it with. Use "
                            "undo_host_steps=True (the default) or overlap_host_step=False."
                        )
                    if st.slot is not None:
                        assert self.pool is not None
                        self._evict(self.pool.slots[st.slot])
                    self._submit_step(st, redo=True)
                    self.counters.host_step_redos += 1
            elif st.touched:
                if st.slot is not None:
                    assert self.pool is not None
                    self._evict(self.pool.slots[st.slot])
                self._submit_step(st)
            st.stepped = False
            st.spec_hypers = None
        if not self.options.async_step:
            for st in self.states:  # parameters are final when step() returns, as in plain PyTorch
                st.wait_host()

    @torch.no_grad()
    def zero_grad(self, *, set_to_none: bool = True) -> None:
        self._recover_if_aborted()
        for st in self.states:
            if set_to_none:
                st.touched = set()
            else:
                st.touched = {j for j, e in enumerate(st.spec.entries) if e.param.requires_grad}
            if not st.offloaded:
                if set_to_none:
                    # as in plain PyTorch: no gradient until backward makes one; the gradient hook copies it
                    # into the chunk's gradient area and points `.grad` there. (Zeroing the area and letting
                    # backward accumulate into it cost a memset and an add pass over every gradient.)
                    for e in st.spec.entries:
                        e.param.grad = None
                    continue
                assert st.grad is not None
                st.grad.zero_()
                for e, g in zip(st.spec.entries, self._grad_views(st), strict=True):
                    if e.param.requires_grad and e.param.grad is not g:
                        e.param.grad = g
                continue
            if st.stepped:  # a speculative step no optimizer.step() confirmed: skipped, as torch would
                self._undo(st, why="zero_grad() without optimizer.step()")
            st.flushes = 0
            st.user_grad_filled = False
            if st.exposed and set_to_none:
                for e in st.spec.entries:
                    e.param.grad = None
                st.exposed = False
            if not set_to_none:
                st.wait_host()
                assert st.host_grad is not None
                for ev in st.pending_events:
                    self.ctx.host_wait(ev)
                st.pending_events = []
                st.host_grad.zero_()
                st.flushes = 1
                if st.exposed:  # `.grad` stays, zeroed, as in plain PyTorch
                    assert st.user_grad is not None
                    st.user_grad.zero_()

    def _model_zero_grad(self, set_to_none: bool = True) -> None:
        self.zero_grad(set_to_none=set_to_none)

    def synchronize(self) -> None:
        """Wait for all host work and device copies: parameters and states are then safe to read.
        Waits on the chunks' own futures and events; no device-wide synchronisation."""
        self._recover_if_aborted()
        for st in self.states:
            st.wait_host()
            for ev in st.pending_events:
                self.ctx.host_wait(ev)
            st.pending_events = []

    @torch.no_grad()
    def refresh_compute_from_master(self) -> None:
        """After masters were loaded: rebuild the compute copies (mixed precision) and drop stale buffers."""
        self.evict_all()
        for st in self.states:
            if not st.mixed:
                continue
            target = st.host_params if st.offloaded else st.params
            assert target is not None and st.master is not None
            target.copy_(st.master)

    def clip_grad_norm_(
        self, max_norm: float, *, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        """Clip every gradient by the global norm: `torch.nn.utils.clip_grad_norm_` over the model's
        parameters, which after backward all expose `.grad` (offloaded ones on the host). Speculative host
        steps whose gradients this scales are redone at `optimizer.step()`."""
        self._recover_if_aborted()
        if self._phase == "backward":
            raise RuntimeError("clip_grad_norm_: called during backward")
        params = [p for p in self.model.parameters() if p.grad is not None]
        if not params:
            return torch.tensor(0.0, device=self.ctx.device)
        return torch.nn.utils.clip_grad_norm_(
            params, max_norm, norm_type=norm_type, error_if_nonfinite=error_if_nonfinite
        )

    # ================================================================================ state dicts
    def _before_state_dict(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        self.synchronize()
        self.evict_all()  # offloaded parameters now point at their host copies

    def _before_load_state_dict(self, module: nn.Module, *args: Any) -> None:
        self.synchronize()
        self.evict_all()

    @torch.no_grad()
    def _after_load_state_dict(self, module: nn.Module, incompatible_keys: Any) -> None:
        for st in self.states:
            if st.mixed:
                source = st.host_params if st.offloaded else st.params
                assert st.master is not None and source is not None
                st.master.copy_(source)

    # ================================================================================= accounting
    def memory_report(self) -> MemoryReport:
        rep = MemoryReport()
        dev, host = rep.device, rep.host

        def add(d: dict[str, int], key: str, n: int) -> None:
            d[key] = d.get(key, 0) + n

        seen: set[int] = set()
        for st in self.states:
            side = host if st.offloaded else dev
            tensors = {
                "parameters": st.host_params if st.offloaded else st.params,
                "gradients": st.host_grad if st.offloaded else st.grad,
                "master": st.master if st.mixed else None,
                "gradient_staging": st.stage,
                "gradient_exposed": st.user_grad,  # the `.grad` offloaded parameters show after backward
                "undo_backup": st.backup_master,  # speculative host steps: master before the step
            }
            for key, t in tensors.items():
                if t is None or t.untyped_storage().data_ptr() in seen:
                    continue
                seen.add(t.untyped_storage().data_ptr())
                add(side, key, t.nbytes)
                if t.is_pinned():
                    rep.pinned_host_bytes += t.nbytes
            inner = self.steppers[st.index].inner if self.steppers else None
            if inner is not None:
                for s in inner.state.values():
                    for v in s.values():
                        if isinstance(v, torch.Tensor):
                            on_host = st.offloaded or (self.ctx.is_cuda and v.device.type == "cpu")
                            add(host if on_host else dev, "optimizer_state", v.nbytes)
            if self.steppers and st.offloaded and self.steppers[st.index].backup_nbytes():
                add(host, "undo_backup", self.steppers[st.index].backup_nbytes())  # optimizer state before the step
        if self.pool is not None:
            dev["buffers"] = self.pool.nbytes
        return rep

    def report(self, host_optimizer: str) -> RuntimeReport:
        self.synchronize()
        self.ctx.synchronize()  # upload timings need their events completed
        upload_s = None
        if self._upload_timings:
            upload_s = (
                sum(a.elapsed_time(b) for a, b in self._upload_timings if a is not None and b is not None)
                / 1e3
            )
        return RuntimeReport(
            memory=self.memory_report(),
            counters=self.counters,
            chunks=len(self.states),
            offloaded_chunks=sum(st.offloaded for st in self.states),
            n_buffers=self.layout.n_buffers,
            chunk_size_bytes=self.layout.chunk_numel * self._esize,
            compute_dtype=str(self.layout.compute_dtype).removeprefix("torch."),
            device=str(self.ctx.device),
            host_optimizer=host_optimizer,
            upload_s=upload_s,
        )

    def reset_upload_timings(self) -> list[tuple[Event, Event]]:
        """CUDA events (start, end) of every upload since the last reset (with measure_uploads)."""
        out, self._upload_timings = self._upload_timings, []
        return out

    def reset_stall_timings(self) -> list[tuple[Event, Event]]:
        """Per wait of compute on an upload: (compute reached the wait, upload done). A positive
        `a.elapsed_time(b)` is upload time exposed to compute (with measure_uploads)."""
        out, self._stall_timings = self._stall_timings, []
        return out


def _same_hypers(a: list[dict[str, Any]] | None, b: list[dict[str, Any]]) -> bool:
    """Equal hyper-parameter snapshots (values may be tensors, e.g. a tensor learning rate)."""
    if a is None or len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        if x.keys() != y.keys():
            return False
        for k, v in x.items():
            w = y[k]
            if isinstance(v, torch.Tensor) or isinstance(w, torch.Tensor):
                if not (isinstance(v, torch.Tensor) and isinstance(w, torch.Tensor) and torch.equal(v, w)):
                    return False
            elif v != w:
                return False
    return True


def _tensors(value: Any) -> list[torch.Tensor]:
    """Tensors inside a module output (tensor, tuple/list, dict or Hugging Face ModelOutput)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []
