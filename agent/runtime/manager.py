"""Model-state manager: the state and lifecycle of the chunk runtime (FSDP2's `FSDPState`); it wires the parts.

The parts, one job each: `residency.ChunkResidency` (acquire, victim, prefetch, upload, evict),
`gradients.GradientFlow` (gradient hooks' work, flushes, the `.grad` users see), `saved_tensors.
SavedTensorRebinder` (pack/unpack scopes), `host_steps.HostSteps` (queued, speculative, validated host
steps), `stepper.ChunkStepper` (held by `optimizer.ChunkedOptimizer`), `timing.RuntimeTiming` (the timing
hook), `phase.TrainingState`. The manager owns the hooks on the model, the phase, and the public methods.

One iteration (details in each part's docstring and docs/architecture/runtime.md): forward pre-hooks on
modules owning offloaded parameters make their chunks resident and open saved-tensor scopes; backward
gathers each gradient into its chunk, flushes complete chunks to the host and (overlapping) steps them
speculatively; the end-of-backward callback settles stragglers and exposes every `.grad`; `step()` steps
persistent chunks on the device and validates, redoes or queues the host steps. A training forward before
`step()` (gradient accumulation) or `zero_grad()` without `step()` undoes the speculative steps.

Over ~400 lines because it is the one place torch's hooks enter and the public surface of
`wrapped.runtime` (step, zero_grad, synchronize, state-dict hooks, reports): every method delegates to a part.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from agent.runtime import timing
from agent.runtime.accounting import Counters, MemoryReport, RuntimeReport, measure_memory
from agent.runtime.buffers import BufferPool
from agent.runtime.chunks import ChunkState, ViewCache, allocate, views
from agent.runtime.device import DeviceContext, Event, element_size
from agent.runtime.device_shards import DeviceShards, pre_backward_hook
from agent.runtime.eager import eager
from agent.runtime.foreign_reads import ForeignReads
from agent.runtime.gradients import GradientFlow
from agent.runtime.host_steps import HostSteps
from agent.runtime.host_worker import HostWorker
from agent.runtime.layout import ChunkLayout, check_world, hooked_parameters
from agent.runtime.node_shared import NodeSharedCopy
from agent.runtime.optimizer import ChunkedOptimizer
from agent.runtime.options import RuntimeOptions
from agent.runtime.phase import Phase, TrainingState
from agent.runtime.process_group import RankGroup
from agent.runtime.residency import ChunkResidency
from agent.runtime.saved_tensors import SavedChunkView, SavedTensorRebinder
from agent.runtime.schedule import AccessSchedule, Direction
from agent.runtime.shards import Shard
from agent.runtime.stepper import ChunkStepper
from agent.runtime.timing import RuntimeTiming, section

log = logging.getLogger(__name__)

__all__ = ["ModelStateManager", "SavedChunkView"]


class ParameterReplacedError(RuntimeError):
    """User code replaced a managed parameter's tensor after `wrap` (`p.data = ...`, a resize)."""


class SecondBackwardError(RuntimeError):
    """A backward after another one with no forward of the model in between, where the runtime settled the first
    backward's gradients already (offloaded or device-sharded chunks): refused, not computed wrongly."""


class ModelStateManager:
    """Applies a plan's model-state policy to a model: owns its hooks, the phase, and the runtime's parts."""

    def __init__(
        self,
        model: nn.Module,
        layout: ChunkLayout,
        ctx: DeviceContext,
        options: RuntimeOptions,
        group: RankGroup | None = None,
        shared: NodeSharedCopy | None = None,
    ) -> None:
        self.model = model
        self.layout = layout
        self.ctx = ctx
        self.options = options
        # the job's process group (issue 20): gradients are averaged across its ranks after backward
        self.group = group
        self.backwards_started = 0  # rank 0 publishes it (`RankGroup.check_arrival`)
        self._publishes = group is not None and group.rank == 0
        self.sync_gradients = True  # False inside `no_sync()`
        self.counters = Counters()
        self.timing = RuntimeTiming()  # the timing hook: see `timing.py`
        self.phase = Phase()
        self._original = {id(e.param): (e.param.dtype, e.param.device) for e in layout.by_param.values()}
        check_world(layout, group.world_size if group is not None else 1)
        # the sharded chunks' node-shared compute copies (`node_shared.py`; None: private copies per rank)
        self.shared = shared
        self.states: list[ChunkState] = [
            allocate(
                spec,
                ctx,
                layout.compute_dtype,
                fp32_master=options.fp32_master,
                shard=Shard(group.rank, group.world_size, spec.shard_numel)
                if spec.sharded and group is not None
                else None,
                shared=shared.chunk(spec.index)
                if shared is not None and spec.sharded and spec.offloaded
                else None,
            )
            for spec in layout.chunks
        ]
        if shared is not None:
            assert group is not None
            group.barrier()  # every rank wrote its shards of the node's copy before any rank reads one
            self.counters.compute_barriers += 1
        self._pos = {id(e.param): (e.chunk, j) for spec in layout.chunks for j, e in enumerate(spec.entries)}
        self.has_offload = bool(layout.offloaded)
        self.schedule = AccessSchedule([c.index for c in layout.offloaded])
        self._views = ViewCache()
        self.residency: ChunkResidency | None = None
        self.host_steps: HostSteps | None = None
        self.saved: SavedTensorRebinder | None = None
        self.worker: HostWorker | None = None
        if self.has_offload:
            self.worker = HostWorker(inline=not ctx.is_cuda)
            self.residency = ChunkResidency(
                self.states, layout, ctx, options, self.counters, self.schedule, self._views, self.timing
            )
            self.host_steps = HostSteps(
                ctx, options, self.counters, self.worker, self.residency, layout.compute_dtype
            )
            self.host_steps.group = group
            self.host_steps.shared = shared is not None
            self.saved = SavedTensorRebinder(
                self.residency, ctx, layout.compute_dtype, self.phase, self._ensure_backward, self.timing
            )
        # CUDA: a parameter of an offloaded chunk read outside its module is made resident for that op
        # (`foreign_reads.py`); entered for each root forward. On a CPU device the host copy reads right.
        self._foreign: ForeignReads | None = None
        self._foreign_on = False
        if self.residency is not None and ctx.is_cuda:
            self._foreign = ForeignReads(self._pos, self.states, self.residency, self.counters)
        self.gradients = GradientFlow(
            self.states,
            self._pos,
            ctx,
            layout.compute_dtype,
            self.counters,
            self._views,
            self.timing,
            self.residency,
            self.host_steps,
            self.worker,
        )
        self.gradients.group = group
        if options.persistent_reductions_in_backward is not None:
            self.gradients.persistent_in_backward = options.persistent_reductions_in_backward
        if self.residency is not None:
            self.residency.flush = self.gradients.flush
        # device-sharded persistent chunks (ZeRO-3 on the device, `device_shards.py`): released until used
        self.device_shards: DeviceShards | None = None
        if group is not None and any(spec.sharded and not spec.offloaded for spec in layout.chunks):
            self.device_shards = DeviceShards(self.states, group, ctx, self.counters, self.worker)
            self.device_shards.release_all()
        self.optimizer: ChunkedOptimizer | None = None
        self._handles: list[RemovableHandle] = []
        self._state_dict_on_host_warned = False  # `_private_copy` fell back to the host once (warned once)
        self._root_grad = False
        self._backward_done = False  # a backward ended since the last forward with gradients
        self._esize = element_size(layout.compute_dtype)
        self._move_buffers_to_device()
        self._install_hooks()

    @property
    def pool(self) -> BufferPool | None:
        """The device buffers offloaded chunks are uploaded into (None without offloaded chunks)."""
        return self.residency.pool if self.residency is not None else None

    @property
    def steppers(self) -> list[ChunkStepper]:
        """One stepper per chunk, held by the attached optimizer ([] before one is attached)."""
        return self.optimizer.steppers if self.optimizer is not None else []

    # ================================================================================== setup/teardown
    def attach_optimizer(self, optimizer: ChunkedOptimizer) -> None:
        """Step the chunks with `optimizer` (it makes one stepper per chunk)."""
        self.optimizer = optimizer
        optimizer.bind_chunks(self.states)
        if self.host_steps is not None:
            self.host_steps.optimizer = optimizer

    def _move_buffers_to_device(self) -> None:
        """The model's buffers (not parameters: the chunks hold those) go to the runtime's device."""
        for module in self.model.modules():
            for name, buf in module._buffers.items():
                if buf is not None and buf.device != self.ctx.device:
                    module._buffers[name] = buf.to(self.ctx.device)

    def _install_hooks(self) -> None:
        """Root forward, state-dict and gradient hooks; pre/post hooks on each module owning offloaded chunks."""
        self._hooked: dict[int, int] = {}  # id(parameter) -> the id of its gradient hook's handle
        self._sync_grad_hooks()
        m = self.model
        self._handles.append(m.register_forward_pre_hook(eager(self._on_root_forward), prepend=True))
        self._handles.append(m.register_forward_hook(eager(self._after_root_forward), always_call=True))
        self._handles.append(m.register_state_dict_pre_hook(self._before_state_dict))
        self._handles.append(m.register_load_state_dict_pre_hook(self._before_load_state_dict))
        self._handles.append(m.register_load_state_dict_post_hook(self._after_load_state_dict))
        # a partial: torch marks the hook with an attribute, which a bound method cannot take
        self._handles.append(m.register_state_dict_post_hook(partial(self._after_state_dict)))
        # `model.zero_grad()` (what e.g. the Hugging Face Trainer calls) must reset the chunk gradients too:
        # offloaded parameters have no `.grad` for it to clear.
        m.zero_grad = self._model_zero_grad  # type: ignore[method-assign]
        if self.device_shards is not None:
            self._install_device_shard_hooks()
        if self.group is not None and self.group.world_size > 1 and self.gradients.persistent_in_backward:
            self._install_persistent_hooks()
        if not self.has_offload:
            return
        owning = list(self._modules_owning(lambda st: st.offloaded))
        chunks_of = {id(module): set(expected) for module, expected in owning}
        for module, expected in owning:
            assert len(expected) <= self.layout.n_buffers  # checked by ChunkLayout.from_policy
            inside = set().union(*(chunks_of.get(id(d), ()) for d in module.modules() if d is not module))
            if inside - set(expected) and len(expected) >= self.layout.n_buffers:
                # its forward runs modules of other offloaded chunks (a root or container holding parameters of
                # its own: timm's ViT `pos_embed`, a root-level temperature), and pinning its chunks for its
                # whole forward would hold every buffer while each chunk inside needs one in turn (with one
                # buffer the runtime refused the solver's plan in the first forward, session 32). Its
                # parameters are read where their chunk is resident, else as any foreign read
                # (`foreign_reads.py`: the host copy on a CPU device, an upload for the op on CUDA); their
                # gradients are expected as before. With a buffer to spare it pins them (session 26).
                self._handles.append(
                    module.register_forward_pre_hook(eager(partial(self._before_persistent_module, expected)))
                )
                continue
            ordered = sorted(expected)
            self._handles.append(
                module.register_forward_pre_hook(eager(partial(self._before_module, ordered, expected)))
            )
            self._handles.append(
                module.register_forward_hook(eager(partial(self._after_module, ordered)), always_call=True)
            )

    def _modules_owning(
        self, chunk: Callable[[ChunkState], bool]
    ) -> Iterator[tuple[nn.Module, dict[int, list[int]]]]:
        """Each module (once) whose own parameters belong to chunks `chunk` selects, with those parameters'
        positions per chunk."""
        seen: set[int] = set()
        for module in self.model.modules():
            if id(module) in seen:
                continue
            seen.add(id(module))
            expected: dict[int, list[int]] = {}
            for p in hooked_parameters(module):
                if id(p) not in self._pos:
                    continue
                c, j = self._pos[id(p)]
                if chunk(self.states[c]):
                    expected.setdefault(c, []).append(j)
            if expected:
                yield module, expected

    def _install_device_shard_hooks(self) -> None:
        """Pre/post forward hooks on each module owning parameters of device-sharded persistent chunks."""
        ds = self.device_shards
        assert ds is not None
        for module, expected in self._modules_owning(lambda st: st.index in ds):
            ordered = sorted(expected)
            self._handles.append(
                module.register_forward_pre_hook(
                    eager(partial(self._before_sharded_module, ordered, expected))
                )
            )
            self._handles.append(
                module.register_forward_hook(
                    eager(partial(self._after_sharded_module, ordered)), always_call=True
                )
            )

    def _install_persistent_hooks(self) -> None:
        """A job of several ranks: a pre-forward hook on each module owning parameters of replicated persistent
        chunks notes which of them the forward used (`ChunkState.expected`), so backward can average each chunk
        as soon as their gradients are in (`GradientFlow.average_early`). Device-sharded chunks' modules note
        theirs in `_before_sharded_module`."""
        ds = self.device_shards
        for module, expected in self._modules_owning(
            lambda st: not st.offloaded and (ds is None or st.index not in ds)
        ):
            self._handles.append(
                module.register_forward_pre_hook(eager(partial(self._before_persistent_module, expected)))
            )

    @section(timing.MODULE_FORWARD)
    def _before_sharded_module(
        self, chunks: list[int], expected: dict[int, list[int]], module: nn.Module, args: Any
    ) -> None:
        ds = self.device_shards
        assert ds is not None
        for c in chunks:
            ds.acquire(c)
            ds.pins[c] += 1
        self._note_expected(expected)

    @section(timing.MODULE_FORWARD)
    def _before_persistent_module(self, expected: dict[int, list[int]], module: nn.Module, args: Any) -> None:
        self._note_expected(expected)

    def _note_expected(self, expected: dict[int, list[int]]) -> None:
        """A module's forward with gradients (or one run under no_grad inside a forward with grad at the root:
        re-entrant checkpointing recomputes it in backward): the chunk entries whose gradients backward will
        bring (`ChunkState.expected`), its trainable parameters."""
        if torch.is_grad_enabled() or (self.phase.forward and self._root_grad):
            for c, js in expected.items():
                entries = self.states[c].spec.entries
                self.states[c].expected.update(j for j in js if entries[j].param.requires_grad)

    @section(timing.AFTER_MODULE_FORWARD)
    def _after_sharded_module(self, chunks: list[int], module: nn.Module, args: Any, output: Any) -> None:
        ds = self.device_shards
        assert ds is not None
        if torch.is_grad_enabled():
            outs = [t for t in _tensors(output) if t.requires_grad]
            if outs:  # gather again before this module's backward (FSDP2's pre-backward hook)
                pre_backward_hook(outs, eager(partial(self._before_sharded_backward, chunks)))
        ds.after_module(chunks, backward=self.phase.backward)

    def _before_sharded_backward(self, chunks: list[int]) -> None:
        self._ensure_backward()
        ds = self.device_shards
        assert ds is not None
        for c in chunks:
            ds.acquire(c)

    def _sync_grad_hooks(self) -> None:
        """Gradient hooks on every parameter that requires grad now (also ones unfrozen after wrap), each after
        the parameter's other post-accumulate-grad hooks.

        The runtime's hook takes the gradient (an offloaded chunk's goes to the host, `p.grad` to None until the
        step), so a hook the user registers after `wrap` (gradient logging, per-parameter clipping) saw
        `p.grad` None (session 32, an exploratory run); torch calls them in the order of their dict, so the
        runtime's is put behind them here, at every root forward (a length check per parameter)."""
        for e in self.layout.by_param.values():
            p = e.param
            if not p.requires_grad:
                continue
            handle = self._hooked.get(id(p))
            if handle is None:
                h = p.register_post_accumulate_grad_hook(eager(self._on_grad))
                self._handles.append(h)
                self._hooked[id(p)] = h.id
                continue
            hooks = p._post_accumulate_grad_hooks
            if hooks is not None and len(hooks) > 1 and next(reversed(hooks)) != handle and handle in hooks:
                # taken out and put back: last in the dict's own order too, the one torch's C++ side iterates
                # (`OrderedDict.move_to_end` changes only the ordered view); the handle stays valid (same key)
                hooks[handle] = hooks.pop(handle)

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
        if self.device_shards is not None:
            self.device_shards.release_all()
        self.remove_hooks()
        with torch.no_grad():
            for st in self.states:
                source = self._whole_master(st) if st.shard is not None else None
                if source is None:
                    source = st.master if st.mixed or st.offloaded else st.params
                assert source is not None
                for e, v in zip(st.spec.entries, views(source, st.spec.entries), strict=True):
                    dtype, device = self._original[id(e.param)]
                    e.param.data = v.to(device=device, dtype=dtype, copy=True)
                    e.param.grad = None
        if self.worker is not None:
            self.worker.shutdown()
        if self.shared is not None:
            self.shared.release()  # the parameters hold private copies now
            self.shared = None
        self.states = []
        if self.optimizer is not None:
            self.optimizer.steppers = []
        self.residency = None
        self._views.clear()

    def _whole_master(self, st: ChunkState) -> torch.Tensor:
        """A sharded chunk's whole master: the compute copy (fp32; complete after `publish_shards`, also when
        node-shared), or every rank's fp32 master shard gathered (mixed precision; a collective, called for the
        sharded chunks in chunk order on every rank)."""
        if (
            st.own is not None
        ):  # device-sharded persistent: every rank's master shard (fp32: the compute shard)
            assert self.device_shards is not None and st.master is not None
            return self.device_shards.whole(st, st.master)
        assert st.shard is not None and st.host_params is not None and st.master is not None
        if not st.mixed:
            return st.host_params
        assert self.group is not None
        whole = torch.empty(st.shard.total, dtype=st.master.dtype)
        self.group.all_gather(whole, st.master.clone())
        return whole

    # ======================================================================================= phases
    @section(timing.ROOT_FORWARD)
    def _on_root_forward(self, module: nn.Module, args: Any) -> None:
        self._recover_if_aborted()
        if self.phase.backward:
            if self.saved is not None:
                self.saved.skip_root_forward()
            return  # a forward re-run inside backward (recomputation)
        self._check_bindings()
        self.phase.state = TrainingState.FORWARD
        training = self.has_offload and torch.is_grad_enabled()
        if training:
            self.gradients.retract()  # gradients of this forward's backward add to the host gradients
        elif self.host_steps is not None:
            # an evaluation between backward and optimizer.step() sees the parameters before the step, as in
            # plain PyTorch: speculative host steps no step() confirmed yet are undone (step() takes them)
            self.host_steps.undo_for_evaluation(self.states)
        if torch.is_grad_enabled():
            # a forward with gradients: the next backward is its own (device-sharded chunks' modules do not run
            # `_before_module`, which resets this for a submodule called on its own)
            self._backward_done = False
            # as DDP decides at forward: this forward's backward averages gradients across the ranks
            # unless it runs inside `no_sync()`
            self.gradients.reduce = self.group is not None and self.sync_gradients
        # a forward with grad enabled at the root will be backpropagated through every module it runs,
        # also those run under no_grad inside it (re-entrant checkpointing recomputes them in backward)
        self._root_grad = torch.is_grad_enabled()
        self._sync_grad_hooks()
        self.schedule.start(Direction.forward, record=True)
        if self.device_shards is not None:
            self.device_shards.start(Direction.forward, self.backwards_started)
        if self.saved is not None:
            self.saved.enter_root_forward(training=training)
        if self._foreign is not None and not self._foreign_on:
            self._foreign.__enter__()
            self._foreign_on = True

    def _check_bindings(self) -> None:
        """Every managed parameter still points where the runtime put it (a device buffer, the host copy, the
        values before a speculative step, a persistent chunk), else `ParameterReplacedError` naming it.

        Code that replaces a parameter's tensor after `wrap` (`p.data = w`, `resize_token_embeddings`, which
        sets the embedding's `weight.data` to a larger tensor) was undone without a word at the chunk's next
        bind: the resize left the embedding at its old size (session 22 probe), a weight set by `.data` at its
        old values. One data-pointer and shape comparison per parameter per forward (device-sharded chunks,
        gathered per use, are not checked)."""
        for st in self.states:
            if st.own is not None:
                continue
            if st.offloaded:
                assert self.residency is not None
                bound = self.residency.bound_views(st)
            else:
                bound = self._views.get(ViewCache.PERSISTENT, st, st.params)
            for e, v in zip(st.spec.entries, bound, strict=True):
                p = e.param
                if p.data_ptr() != v.data_ptr() or p.shape != v.shape:
                    raise ParameterReplacedError(
                        f"{e.name}: its tensor was replaced after agent.wrap (now {tuple(p.shape)} "
                        f"{p.dtype}, planned {tuple(v.shape)} {v.dtype}), e.g. by `p.data = ...` or "
                        "resize_token_embeddings; the runtime would put its chunk's values back without a word. "
                        "Change parameters in place (`with torch.no_grad(): p.copy_(w)`), or unwrap, change the "
                        "model and wrap again (resize before agent.wrap)"
                    )

    @section(timing.AFTER_ROOT_FORWARD)
    def _after_root_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.saved is not None:
            self.saved.exit_root_forward()
        if self._foreign_on:
            self._end_foreign_reads()
        if self.phase.forward:
            if self.device_shards is not None:
                # every rank ends the forward's gathers here: one that skipped the last module another ran raises
                self.device_shards.agree_end()
            self.phase.state = TrainingState.IDLE
            if torch.is_grad_enabled():
                # Backward starts in the outermost graph task at the loss, before any re-entrant
                # (nested) backward a checkpointed block may run: the end-of-backward callback must be
                # queued there, not in a nested task that ends early.
                for t in _tensors(output):
                    if t.requires_grad:
                        t.register_hook(eager(self._on_output_grad))

    def _end_foreign_reads(self) -> None:
        """The root forward ended: leave the foreign-reads mode (it is the innermost torch-function mode unless
        the forward entered one it did not leave: then it stays entered, said once) and drop its kept pins."""
        assert self._foreign is not None
        self._foreign_on = False
        self._foreign.end()
        depth = torch._C._len_torch_function_stack()
        if depth and torch._C._get_function_stack_at(depth - 1) is self._foreign:
            self._foreign.__exit__(None, None, None)
        else:
            self._foreign_on = True  # (not left: the next root forward does not enter it again)
            log.warning(
                "memplan: a torch function mode entered during the forward is still active at its end; the "
                "runtime's foreign-reads mode stays entered under it"
            )

    @section(timing.OUTPUT_GRAD)
    def _on_output_grad(self, grad: torch.Tensor) -> None:
        self._ensure_backward()

    def _ensure_backward(self) -> None:
        if self.phase.backward:
            return
        if self._backward_done and (self.has_offload or self.device_shards is not None):
            raise SecondBackwardError(
                "memplan: a second backward pass before the model's next forward (loss.backward(retain_graph=True) "
                "and then another loss's backward, two forwards and then a backward for each, or "
                "torch.autograd.grad over the forward's graph and then a backward of it, as a gradient penalty "
                "does) is not supported "
                "with offloaded or sharded parameter chunks: the first backward already settled this forward's "
                "gradients on the host and may have stepped them. Sum the losses and call backward once "
                "((loss + aux_loss).backward() gives the same gradients), or run a forward and its backward in "
                "turn for each batch (gradient accumulation)."
            )
        self.backwards_started += 1
        if self._publishes:
            assert self.group is not None
            self.group.publish_backwards(self.backwards_started)
        if self.device_shards is not None:
            self.device_shards.start(Direction.backward, self.backwards_started)
        if self.gradients.reduce and (self.has_offload or self.gradients.persistent_in_backward):
            if self.device_shards is not None:
                # the ranks compare passes before the same-use check, whose rows have another size: a forward
                # made on some ranks only (with grad) is a RankArrivalError here, not a collective mismatch
                self.device_shards.agree_begin()
            # before this backward issues any collective (not at forward: a forward with grad enabled on one
            # rank alone, an evaluation without no_grad, must not wait for the others); it also decides whether
            # the persistent chunks are averaged as backward completes them
            self.gradients.check_same_use()
        self.phase.state = TrainingState.BACKWARD
        self.schedule.start(Direction.backward, record=True)
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _recover_if_aborted(self) -> None:
        """A backward that raised never ran its end callback: settle it (keep its partial gradients,
        as torch keeps partial `.grad`, and step nothing) before anything else touches the state."""
        if self.phase.backward and torch._C._current_graph_task_id() == -1:
            self._end_backward(aborted=True)

    @section(timing.END_BACKWARD)
    def _end_backward(self, *, aborted: bool = False) -> None:
        if self.device_shards is not None and not aborted:
            self.device_shards.agree_end()  # as at the end of forward, before this backward's reductions
        for st in self.states:
            if st.offloaded and (st.in_slot or (st.received and not st.complete)):
                if aborted:  # keep the partial gradients (as torch keeps partial .grad), step nothing
                    st.recompute_pins = 0
                    if st.slot is not None:
                        assert self.residency is not None
                        self.residency.pool.slots[st.slot].pins = 0
                        self.residency.evict_chunk(st)
                else:
                    self.gradients.complete(st)
        if self.device_shards is not None:
            self.device_shards.release_all()
            self.device_shards.pins = dict.fromkeys(self.device_shards.pins, 0)
        for st in self.states:
            st.expected.clear()
            st.received.clear()
            st.complete = False
            st.recompute_pins = 0
        if self.residency is not None:
            self.residency.unpin_all()
            self.residency.forget_nodes()
        self.schedule.finish_recording()
        self.phase.state = TrainingState.IDLE
        self.counters.iterations += 1
        self._backward_done = not aborted
        if aborted:
            self.gradients.deferred = False  # (its local gradients are reduced by the next synchronising one)
            self.gradients.settle_persistent()
        if not aborted:
            # a synchronising backward's collectives, in one order on every rank: the rest of the issue order
            # (chunks this rank did not complete), the stragglers' averages, one agreement on the entries with a
            # gradient, `.grad` (a sharded chunk's all-gather), the persistent chunks not averaged yet
            self.gradients.issue_rest()  # (reads `joined` of the chunks this rank did not complete)
            if self.host_steps is not None:
                self.host_steps.backwards += 1
                self.gradients.join_deferred()  # (reads `joined` too)
                self.gradients.average_stragglers()
            self.gradients.agree()
            if self.host_steps is not None:
                self.gradients.expose()
        for st in self.states:
            st.joined.clear()  # `check_same_use` sets them for one backward (merged at complete, join_deferred)
        if not aborted:
            self.gradients.reduce_persistent()
            if self.gradients.reduce and self.options.broadcast_buffers:
                self._broadcast_buffers()

    def _broadcast_buffers(self) -> None:
        """End of a synchronising backward, every rank, after the runtime's collectives (the host worker's work is
        done: no other issuer): the persistent module buffers become rank 0's, as DDP's `broadcast_buffers=True`
        makes them before the next forward (its default; review, session 27: a BatchNorm's running mean was 2.8e-2
        off DDP on rank 1 after 3 steps, each rank keeping its own). Version counters are kept, as DDP keeps them."""
        assert self.group is not None
        buffers = [
            b
            for m in self.model.modules()
            for name, b in m._buffers.items()
            if b is not None and name not in m._non_persistent_buffers_set
        ]
        if not buffers:
            return
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(tuple(buffers)):
            self.group.broadcast_coalesced_(buffers)

    # ================================================================================ module hooks
    @section(timing.MODULE_FORWARD)
    def _before_module(
        self, chunks: list[int], expected: dict[int, list[int]], module: nn.Module, args: Any
    ) -> None:
        assert self.residency is not None and self.saved is not None
        if not self.phase.backward and torch.is_grad_enabled():
            self._backward_done = False  # a forward with gradients, also one of a submodule called on its own
        for c in chunks:
            if self.phase.backward and self.states[c].stepped:
                # a recomputation in backward of a module whose chunk was stepped speculatively (a block run
                # several times under re-entrant checkpointing: its first pass completed the chunk): it must see
                # the parameters before the step (before session 26 it recomputed with the stepped ones)
                self.gradients.reuse(
                    self.states[c], why="its module is recomputed in backward after the step"
                )
            self.residency.acquire(c, pin=True)
            if self.phase.backward:
                # a recomputation (activation checkpointing) inside backward: the tensors it saves
                # point into the buffer directly, so the chunk stays put until its gradients are done
                self.states[c].recompute_pins += 1
        self._note_expected(expected)
        self.saved.enter_module(id(module))

    @section(timing.AFTER_MODULE_FORWARD)
    def _after_module(self, chunks: list[int], module: nn.Module, args: Any, output: Any) -> None:
        assert self.residency is not None and self.saved is not None
        self.saved.exit_module(id(module))
        if self.phase.backward:
            return  # recomputation: pins held until the chunk's gradients are complete
        for c in chunks:
            st = self.states[c]
            if st.slot is not None:
                slot = self.residency.pool.slots[st.slot]
                slot.pins = max(0, slot.pins - 1)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes of forwards run inside this context keep their gradients local (accumulated
        on each rank, not averaged), as `DistributedDataParallel.no_sync`; the first backward after it
        averages the accumulated gradients. A no-op without a process group."""
        before = self.sync_gradients
        self.sync_gradients = False
        try:
            yield
        finally:
            self.sync_gradients = before

    # ============================================================================== saved tensors
    def saved_scope(self) -> AbstractContextManager[None]:
        """A scope of the saved-tensor hooks around a block the activation manager replaces (see
        `SavedTensorRebinder.scope`); nothing to do without offloaded chunks."""
        return self.saved.scope() if self.saved is not None else nullcontext()

    def pack_saved(self, t: torch.Tensor) -> Any:
        """Saved-tensor pack hook (activation management calls it first from its own pack hook)."""
        return self.saved.pack(t) if self.saved is not None else t

    def unpack_saved(self, packed: Any) -> torch.Tensor:
        """Saved-tensor unpack hook (activation management calls it from its own unpack hook)."""
        return self.saved.unpack(packed) if self.saved is not None else packed

    def evict_all(self) -> None:
        """Every offloaded chunk leaves its buffer (its parameters then point at the host copy)."""
        if self.residency is not None:
            self.residency.evict_all()

    # ================================================================================== gradients
    @section(timing.GRAD_HOOK)
    def _on_grad(self, param: torch.Tensor) -> None:
        self._ensure_backward()
        got = param.grad is not None  # (receive may set it to None: an early-averaged persistent chunk's)
        self.gradients.receive(param)
        ds = self.device_shards
        if ds is not None and got:
            c, j = self._pos[id(param)]
            if c in ds:
                st = self.states[c]
                st.received.add(j)
                # every gradient expected of it arrived: no node reads its parameters any more (a chunk with
                # frozen parameters stays to the end of backward: a node may still read one)
                if (
                    st.expected
                    and st.expected <= st.received
                    and all(e.param.requires_grad for e in st.spec.entries)
                ):
                    ds.release(st)

    @section(timing.STEP)
    @torch.no_grad()
    def step(self) -> None:
        """`optimizer.step()`: persistent chunks step on the device, offloaded chunks' host steps are
        validated (speculative ones), redone or queued; then waits for them unless `async_step`."""
        self._recover_if_aborted()
        if self.phase.backward:
            raise RuntimeError("optimizer.step(): called during backward")
        self.gradients.check_synchronised()
        self.gradients.adopt_assigned()
        assert self.optimizer is not None
        hypers = self.optimizer.hyper_snapshot()
        steppers = self.optimizer.steppers
        for st in self.states:
            if st.offloaded or not st.touched:
                continue
            assert st.grad is not None and st.params is not None and st.master is not None
            self.gradients.sync_persistent(st)
            if st.own is not None:  # device-sharded: this rank's shard of the (averaged, whole) gradient
                assert st.shard is not None and self.device_shards is not None
                own_grad = st.grad[st.shard.start : st.shard.end]
                steppers[st.index].step(hypers, own_grad.float() if st.mixed else own_grad, st.touched)
                self.device_shards.refresh_own_from_master(st)
                self.counters.device_steps += 1
                continue
            grad = st.grad.float() if st.mixed else st.grad
            steppers[st.index].step(hypers, grad, st.touched, grad_offsets=st.grad_offsets)
            if st.mixed:
                st.params.copy_(st.master)
            self.counters.device_steps += 1
        if self.host_steps is None:
            return
        self.host_steps.accumulation = max(1, self.host_steps.backwards)
        self.host_steps.backwards = 0
        # in the order the host worker steps them (gradients arrive C-1..0): the check of a chunk stepped during
        # backward runs while the worker still steps the chunks before it, and only the last one waits for the
        # worker's last step (in index order, every check waited for chunk 0's step, the FIFO's last, and then ran
        # one after another: 11-15 ms of step() on an H200 for 6 offloaded 49 MiB chunks)
        for st in reversed(self.states):
            if not st.offloaded:
                continue
            st.wait_host()
            changed = self.gradients.reconcile(st)
            self.host_steps.settle(st, hypers, grad_changed=changed)
        # sharded chunks: every rank's stepped shard (all-gathers, or one barrier), the same on every rank
        self.host_steps.publish_shards(self.states)
        if not self.options.async_step:
            for st in self.states:  # parameters are final when step() returns, as in plain PyTorch
                st.wait_host()

    @section(timing.ZERO_GRAD)
    def zero_grad(self, *, set_to_none: bool = True, held: frozenset[int] | None = None) -> None:
        """Forget the chunks' gradients; `held`: the ids of the parameters the optimizer holds (its
        `zero_grad` clears those only, as torch's does), None for every parameter (`model.zero_grad()`)."""
        self._recover_if_aborted()
        self.gradients.zero(set_to_none=set_to_none, held=held)

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
        """After masters were loaded: rebuild the compute copies (mixed precision) and drop stale buffers. A
        sharded chunk: this rank's loaded shard into the compute copy, then every rank's: an all-gather per chunk
        in chunk order (private copies), or one barrier (node-shared: each rank wrote its shard in place, and no
        rank may read the copy before every rank did)."""
        self.evict_all()
        for st in self.states:
            if (
                st.own is not None
            ):  # device-sharded persistent: no collective (gathered again at its next use)
                assert self.device_shards is not None
                self.device_shards.refresh_own_from_master(st)
                continue
            if st.shard is not None:
                assert st.host_params is not None and st.master is not None and self.group is not None
                own = st.host_params[st.shard.start : st.shard.end]
                if st.mixed:  # (in fp32 the master is `own` itself)
                    own.copy_(st.master)
                if not st.node_shared:
                    self.group.all_gather(st.host_params, own.clone())
                continue
            if not st.mixed:
                continue
            target = st.host_params if st.offloaded else st.params
            assert target is not None and st.master is not None
            target.copy_(st.master)
        if self.shared is not None:
            assert self.group is not None
            self.group.barrier()
            self.counters.compute_barriers += 1

    def clip_grad_norm_(
        self, max_norm: float, *, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        """Clip every gradient by the global norm: `torch.nn.utils.clip_grad_norm_` over the model's
        parameters, which after backward all expose `.grad` (offloaded ones on the host). Speculative host
        steps whose gradients this scales are redone at `optimizer.step()`."""
        self._recover_if_aborted()
        if self.phase.backward:
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
        self._gather_device_shards("model.state_dict()")

    def _gather_device_shards(self, call: str) -> None:
        """Device-sharded chunks gathered for a whole-model read or load: a collective, checked to be made on
        every rank first (a rank-0-only call is an error naming the fix, not a hang)."""
        if self.device_shards is None:
            return
        assert self.group is not None
        self.group.check_arrival(
            call,
            "Call it on every rank (the model has chunks sharded on the device), or use "
            "agent.checkpoint.save_sharded(wrapped, directory) on every rank.",
            self.options.rank_arrival_timeout_s,
        )
        self.device_shards.gather_all()

    @contextmanager
    def summon_full_params(self) -> Iterator[None]:
        """Inside: the parameters of device-sharded persistent chunks hold their whole values (outside forward
        and backward they are zero-stride placeholders: see `device_shards.py`), as FSDP's `summon_full_params`.
        A collective (every rank); read only: writes are discarded at exit (change values with
        `load_state_dict`). A no-op without device-sharded chunks."""
        self._recover_if_aborted()
        if self.phase.backward:
            raise RuntimeError("summon_full_params(): called during backward")
        self._gather_device_shards("summon_full_params()")
        try:
            yield
        finally:
            if self.device_shards is not None:
                self.device_shards.release_all()

    def _after_state_dict(self, module: nn.Module, state: dict[str, Any], prefix: str, meta: Any) -> None:
        """Every value that views a chunk's storage becomes a private copy (tied names share one), then
        device-sharded chunks are released: the returned dict stays valid and each tensor owns its storage.

        A chunk is one flat buffer (on the device, or its host copy for offloaded chunks, where `state_dict`
        finds them after `evict_all`), so plain views of the parameters would each carry the whole chunk's
        storage: `safetensors.torch.save_model` refuses them ("None is covering the entire storage"),
        Accelerate's `save_model`/`save_state` drop all but one tensor per storage as if tied (6 of a llama-4L's
        39 tensors kept, with a warning only), and `torch.save` of a few values writes whole chunks (a LoRA
        adapter's state dict: 2.4 MB for 64 kB). FSDP1's full state dict clones for the same reason. The cost:
        the dict holds a copy of the model (as FSDP's and DeepSpeed's consolidated state dicts do), and writing
        into its values no longer changes the model (`load_state_dict` does). On CUDA a copy that does not fit
        the device is made on the host, with a warning. With `keep_vars` the values are the parameters
        themselves, left as they are."""
        storages = {
            t.untyped_storage().data_ptr()
            for st in self.states
            for t in (st.params, st.host_params)
            if t is not None and t.numel() > 0
        }
        copies: dict[tuple[torch.device, int, tuple[int, ...], tuple[int, ...]], torch.Tensor] = {}
        for key, value in state.items():
            if isinstance(value, nn.Parameter) or not isinstance(value, torch.Tensor):
                continue
            if value.untyped_storage().data_ptr() in storages:
                k = (value.device, value.data_ptr(), tuple(value.shape), tuple(value.stride()))
                if k not in copies:
                    copies[k] = self._private_copy(key, value)
                state[key] = copies[k]
        ds = self.device_shards
        if ds is not None and not self.phase.forward and not self.phase.backward:
            ds.release_all()

    def _private_copy(self, key: str, value: torch.Tensor) -> torch.Tensor:
        """`value` in a storage of its own, on its device; on the host when the device has no room for it."""
        try:
            return value.detach().clone()
        except torch.OutOfMemoryError:
            if not self._state_dict_on_host_warned:
                self._state_dict_on_host_warned = True
                log.warning(
                    "memplan: model.state_dict(): no device memory left for a copy of %r (%d bytes): it and "
                    "later such values are returned on the host (load_state_dict takes them as they are)",
                    key,
                    value.numel() * value.element_size(),
                )
            return value.detach().to("cpu", copy=True)

    def _before_load_state_dict(self, module: nn.Module, *args: Any) -> None:
        self.synchronize()
        self.evict_all()
        self._gather_device_shards("model.load_state_dict()")

    @torch.no_grad()
    def _after_load_state_dict(self, module: nn.Module, incompatible_keys: Any) -> None:
        for st in self.states:
            if st.node_shared:
                # the load wrote the node's shared copy through the parameters: the runtime's path, not a user's
                st.host_versions = st.param_versions()
            if st.own is not None:  # device-sharded persistent: every rank loaded the whole chunk
                assert st.shard is not None and st.params is not None and st.master is not None
                assert self.device_shards is not None
                st.own.copy_(st.params[st.shard.start : st.shard.end])
                if st.mixed:
                    st.master.copy_(st.own)
                self.device_shards.release(st)
                continue
            if st.mixed:
                source = st.host_params if st.offloaded else st.params
                assert st.master is not None and source is not None
                if st.shard is not None:
                    source = source[st.shard.start : st.shard.end]  # every rank loaded the whole chunk
                st.master.copy_(source)

    # ================================================================================= accounting
    def memory_report(self) -> MemoryReport:
        return measure_memory(self.states, self.steppers, self.pool, self.ctx, self.shared)

    def report(self, host_optimizer: str) -> RuntimeReport:
        self.synchronize()
        self.ctx.synchronize()  # upload timings need their events completed
        upload_s = None
        timings = self.residency.upload_timings if self.residency is not None else []
        if timings:
            upload_s = sum(a.elapsed_time(b) for a, b in timings if a is not None and b is not None) / 1e3
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
        if self.residency is None:
            return []
        out, self.residency.upload_timings = self.residency.upload_timings, []
        return out

    def reset_stall_timings(self) -> list[tuple[Event, Event]]:
        """Per wait of compute on an upload: (compute reached the wait, upload done). A positive
        `a.elapsed_time(b)` is upload time exposed to compute (with measure_uploads)."""
        if self.residency is None:
            return []
        out, self.residency.stall_timings = self.residency.stall_timings, []
        return out


def _tensors(value: Any) -> list[torch.Tensor]:
    """Tensors inside a module output (tensor, tuple/list, dict or Hugging Face ModelOutput)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []
