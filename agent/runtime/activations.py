"""Block-wise activation manager: applies a plan's keep / checkpoint / swap mode to each repeated block.

- keep: the block is left as it is.
- checkpoint: the block's forward is replaced by `torch.utils.checkpoint.checkpoint(original_forward,
  *args, use_reentrant=False, preserve_rng_state=True, **kwargs)`: only the inputs are retained; the
  forward runs again inside backward with the CPU (and CUDA) RNG state it first saw, so dropout masks
  are identical and gradients equal un-checkpointed training; the buffers the forward changed (BatchNorm's
  running statistics) are put back after the recompute (`context_fn`, `module_buffers.py`), so they are updated
  once per forward, as un-checkpointed.
- swap: the block's forward runs inside `SwapStore.swapping(block)` (see `swap.py`): its saved tensors
  are copied to host memory during forward and prefetched back one block ahead during backward.

Modes are applied by setting an instance attribute `forward` on the block module (the class and the
user's code are not edited); `remove()` deletes it again (or puts back an instance `forward` the module
already had), so the module is exactly as before. Every check runs before any module is touched.

Prefetch order: a forward hook on every repeated block puts a gradient hook on the block's outputs; it
fires when that block's backward starts. The manager records the order in which blocks' backwards start
and, when block b starts, prefetches the swap block that followed b in the previous iteration's order (in
the first iteration, before any order is known: the block that ran just before b in forward). A block
whose tensors are needed before they were prefetched is fetched on demand, and counted.

What the cost model assumes (docs/architecture/solver.md) and this does: keep retains the block's saved
tensors; checkpoint retains its inputs and holds input + recomputed activations during its backward;
swap retains nothing on device after the copy-out, and while block b runs backward block b-1's swapped
tensors are being brought back.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.hooks import RemovableHandle

from agent.runtime.eager import eager, eager_frame
from agent.runtime.module_buffers import ChangedBuffers
from agent.runtime.swap import SwapStore
from client.contract import ActivationMode, Policy

if TYPE_CHECKING:
    from agent.runtime.host_arena import HostArena
    from agent.runtime.manager import ModelStateManager


class ActivationPlanError(ValueError):
    """The plan's activation modes cannot be applied to this model (the model is left untouched)."""


@dataclass(frozen=True)
class BlockTarget:
    """One repeated block and the mode the plan gives it."""

    index: int  # the block's index in the plan / trace
    name: str  # module path
    module: nn.Module
    mode: ActivationMode


def block_targets(model: nn.Module, policy: Policy) -> list[BlockTarget]:
    """The plan's blocks resolved to the model's modules; raises ActivationPlanError naming the field."""
    modules = dict(model.named_modules())
    out: list[BlockTarget] = []
    for i, bp in enumerate(policy.blocks):
        module = modules.get(bp.module)
        if module is None:
            if bp.mode == ActivationMode.keep:
                continue  # prologue[...] / epilogue[...] are not single modules; keep needs none
            raise ActivationPlanError(
                f"policy.blocks[{i}].module: {bp.module!r} is not a module of {type(model).__name__}; only repeated "
                f"blocks (module paths such as 'model.layers.3') can be in mode {bp.mode.value!r}"
            )
        if module is model:
            raise ActivationPlanError(
                f"policy.blocks[{i}].module: names the whole model; a block must be a submodule"
            )
        out.append(BlockTarget(bp.block, bp.module, module, bp.mode))
    seen: dict[int, str] = {}
    for t in out:
        if id(t.module) in seen:
            raise ActivationPlanError(
                f"policy.blocks[{t.index}].module: {t.name!r} is also block {seen[id(t.module)]!r}"
            )
        seen[id(t.module)] = t.name
    _check_checkpoint_buffers(policy, out)
    names = [t.name for t in out if t.mode != ActivationMode.keep]
    for a in names:
        for b in names:
            if a != b and b.startswith(a + "."):
                raise ActivationPlanError(
                    f"policy.blocks: {b!r} is inside {a!r}; checkpointed or swapped blocks must not nest"
                )
    return out


def _check_checkpoint_buffers(policy: Policy, targets: list[BlockTarget]) -> None:
    """A checkpointed block's recompute needs all its offloaded chunks in buffers at once (the runtime pins what a recompute acquires)."""
    chunk_of: dict[str, int] = {}
    for c in policy.chunks:
        if c.placement.value == "offloaded":
            chunk_of.update((name, c.index) for name in c.parameters)
    for t in targets:
        if t.mode != ActivationMode.checkpoint:
            continue
        chunks = sorted(
            {chunk_of[f"{t.name}.{n}"] for n, _ in t.module.named_parameters() if f"{t.name}.{n}" in chunk_of}
        )
        if len(chunks) > policy.n_buffers:
            raise ActivationPlanError(
                f"policy.blocks[{t.index}]: checkpointed block {t.name!r} has parameters in offloaded chunks {chunks} "
                f"but policy.n_buffers is {policy.n_buffers}: its recompute needs them on the device at once"
            )


def default_state_storages(model: nn.Module) -> Callable[[], set[int]]:
    """Storage addresses of the model's parameters and buffers, read when called (they may move)."""

    def storages() -> set[int]:
        out = {p.untyped_storage().data_ptr() for p in model.parameters()}
        out.update(b.untyped_storage().data_ptr() for b in model.buffers())
        return out

    return storages


def runtime_state_storages(manager: ModelStateManager, model: nn.Module) -> Callable[[], set[int]]:
    """Model-state storages under the chunk runtime: every chunk buffer (persistent chunks, host copies,
    device buffers of offloaded chunks, whichever chunk they hold) plus the model's parameters and buffers."""
    fixed: set[int] = set()
    for st in manager.states:
        for t in (st.params, st.grad, st.master, st.host_params, st.host_grad):
            if t is not None:
                fixed.add(t.untyped_storage().data_ptr())
    if manager.pool is not None:
        for slot in manager.pool.slots:
            fixed.add(slot.params.untyped_storage().data_ptr())
            fixed.add(slot.grad.untyped_storage().data_ptr())
    base = default_state_storages(model)
    return lambda: fixed | base()


@dataclass
class ActivationCounters:
    checkpointed_forwards: int = 0
    swapped_forwards: int = 0
    backward_order_changes: int = 0


@dataclass
class _Installed:
    target: BlockTarget
    had_instance_forward: bool
    instance_forward: Any
    handles: list[RemovableHandle] = field(default_factory=list)


class ActivationManager:
    """Applies per-block activation modes to `model`; `remove()` restores it exactly."""

    def __init__(
        self,
        model: nn.Module,
        targets: list[BlockTarget],
        device: torch.device,
        state_storages: Callable[[], set[int]] | None = None,
        saved_scope: Callable[[], AbstractContextManager[None]] | None = None,
        host_arena: HostArena | None = None,
    ) -> None:
        self.model = model
        # entered around a swapped or checkpointed block's forward, outside the mode's own saved-tensor
        # hooks: the chunk runtime's hooks for the tensors saved inside (`ModelStateManager.saved_scope`)
        self._saved_scope = saved_scope or nullcontext
        self.device = device
        self.targets = sorted(targets, key=lambda t: t.index)
        self.counters = ActivationCounters()
        self._state_storages = state_storages or default_state_storages(model)
        # model-state storages, read once per root forward (walking the model's parameters for every
        # swapped block cost O(model) per block); a block run outside a root forward reads them afresh
        self._state_now: set[int] = set()
        self._in_root_forward = False
        swaps = [t for t in self.targets if t.mode == ActivationMode.swap]
        # swapped host copies: ranges of the runtime's host arena when it has one (its swap region)
        self.store: SwapStore | None = SwapStore(device, self._is_model_state, host_arena) if swaps else None
        self._swap_blocks = {t.index for t in swaps}
        self._forward_order = [t.index for t in self.targets]
        self._order_prev: list[int] = []  # backward start order of the previous iteration
        self._order_now: list[int] = []
        self._in_backward = False
        self._installed: list[_Installed] = []
        self._root_handles: list[RemovableHandle] = []
        try:
            if swaps:
                self._root_handles = [
                    model.register_forward_pre_hook(eager(self._root_forward_started)),
                    model.register_forward_hook(eager(self._root_forward_ended), always_call=True),
                ]
            for t in self.targets:
                self._install(t)
        except BaseException:
            self.remove()
            raise

    # ------------------------------------------------------------------------ install/remove
    def _install(self, t: BlockTarget) -> None:
        had = "forward" in t.module.__dict__
        rec = _Installed(t, had, t.module.__dict__.get("forward"))
        self._installed.append(rec)
        original = t.module.forward  # bound method (or the instance attribute already there)
        if t.mode == ActivationMode.checkpoint:
            t.module.forward = self._checkpointed(original, t.module)
        elif t.mode == ActivationMode.swap:
            t.module.forward = self._swapped(original, t.index)
        if self.store is not None:  # backward-start triggers drive the prefetch
            rec.handles.append(t.module.register_forward_hook(eager(self._trigger_hook(t.index))))

    def remove(self) -> None:
        """Undo every change: instance `forward` attributes and hooks; the modules are as they were."""
        for h in self._root_handles:
            h.remove()
        self._root_handles = []
        for rec in reversed(self._installed):
            for h in rec.handles:
                h.remove()
            d = rec.target.module.__dict__
            if rec.had_instance_forward:
                d["forward"] = rec.instance_forward
            else:
                d.pop("forward", None)
        self._installed.clear()
        if self.store is not None:
            self.store.end_iteration()

    # ------------------------------------------------------------------------------ modes
    def _checkpointed(self, original: Callable[..., Any], module: nn.Module) -> Callable[..., Any]:

        def contexts() -> tuple[AbstractContextManager[None], AbstractContextManager[None]]:
            # the recompute leaves the buffers the forward changed as the forward left them: BatchNorm's running
            # statistics are updated once per forward, as without checkpointing (`module_buffers.py`)
            changed = ChangedBuffers(module)
            return changed.watching(), changed.restoring()

        @eager  # under torch.compile a checkpointed block runs eagerly (docs/architecture/wrap.md)
        def forward(*args: Any, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():
                return original(*args, **kwargs)
            self.counters.checkpointed_forwards += 1
            with self._saved_scope():
                return checkpoint(
                    original,
                    *args,
                    use_reentrant=False,
                    preserve_rng_state=True,
                    context_fn=contexts,
                    **kwargs,
                )

        return forward

    def _swapped(self, original: Callable[..., Any], index: int) -> Callable[..., Any]:
        store = self.store
        assert store is not None

        @eager
        def enter() -> ExitStack | None:
            if not torch.is_grad_enabled():
                return None
            self.counters.swapped_forwards += 1
            if not self._in_root_forward:
                self._state_now = self._state_storages()
            scopes = ExitStack()
            scopes.enter_context(self._saved_scope())
            scopes.enter_context(store.swapping(index))
            return scopes

        @eager
        def leave(scopes: ExitStack, exc: BaseException | None) -> None:
            if exc is None:
                scopes.close()
            else:
                scopes.__exit__(type(exc), exc, exc.__traceback__)

        # Only this frame is skipped by torch.compile: `enter`/`leave` (the saved-tensor hooks) run eagerly,
        # the block's own forward (`original`) is still compiled when the user compiled the block or model.
        @eager_frame
        def forward(*args: Any, **kwargs: Any) -> Any:
            scopes = enter()
            if scopes is None:
                return original(*args, **kwargs)
            try:
                out = original(*args, **kwargs)
            except BaseException as exc:
                leave(scopes, exc)
                raise
            leave(scopes, None)
            return out

        return forward

    def _root_forward_started(self, module: nn.Module, args: Any) -> None:
        self._state_now = self._state_storages()
        self._in_root_forward = True
        if self.store is not None:
            self.store.begin_forward()

    def _root_forward_ended(self, module: nn.Module, args: Any, output: Any) -> None:
        self._in_root_forward = False
        if self.store is not None:
            self.store.end_forward()
            self.store.settle_through(None)  # the last swapped block's storages (`SwapStore.settle_through`)

    def _is_model_state(self, t: torch.Tensor) -> bool:
        return t.untyped_storage().data_ptr() in self._state_now

    # ------------------------------------------------------------------------- prefetch
    def _trigger_hook(self, index: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if self.store is not None:
                # block `index` ran its forward: the blocks before it let their swapped storages go (in a
                # recomputation inside backward nothing is left to let go)
                self.store.settle_through(index - 1)
            if not torch.is_grad_enabled():
                return
            for t in _tensors(output):
                if t.requires_grad:
                    t.register_hook(eager(self._backward_started(index)))
                    break

        return hook

    def _backward_started(self, index: int) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            if not self._in_backward:
                self._in_backward = True
                self._order_now = []
                torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
            if index in self._order_now:
                return
            self._order_now.append(index)
            store = self.store
            assert store is not None
            if index in self._swap_blocks:
                store.prefetch(index, late=True)  # no-op when it was prefetched while the previous block ran
            nxt = self._next_in_backward(index)
            if nxt is not None and nxt in self._swap_blocks:
                store.prefetch(nxt)

        return hook

    def _next_in_backward(self, index: int) -> int | None:
        order = self._order_prev
        if index in order:
            pos = order.index(index)
            return order[pos + 1] if pos + 1 < len(order) else None
        pos = self._forward_order.index(index)  # first iteration: the block that ran before it in forward
        return self._forward_order[pos - 1] if pos > 0 else None

    def _end_backward(self) -> None:
        if self._order_prev and self._order_now != self._order_prev:
            self.counters.backward_order_changes += 1
        self._order_prev = self._order_now
        self._in_backward = False

    # ------------------------------------------------------------------------------ report
    def mode_strip(self) -> str:
        return "".join(t.mode.letter for t in self.targets)


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    if hasattr(value, "to_tuple"):  # transformers ModelOutput
        return _tensors(value.to_tuple())
    return []


def apply_activation_policy(
    model: nn.Module, policy: Policy, device: torch.device, runtime: ModelStateManager | None = None
) -> ActivationManager:
    """Check the policy's blocks against `model` (raising before any change), then apply their modes.

    With the chunk runtime (`runtime`), a swapped or checkpointed block's forward runs inside the runtime's
    saved-tensor scope (its hooks outermost), and swap passes the runtime's buffers' tensors on to them. A checkpointed block's recompute saves tensors that point straight into a device
    buffer (checkpoint keeps them itself, past any hooks): the runtime pins chunks acquired during a
    recompute until their gradients are complete, and `block_targets` refuses a checkpointed block whose
    offloaded chunks would not fit the buffers at once.
    """
    targets = block_targets(model, policy)
    if runtime is None:
        return ActivationManager(model, targets, device)
    return ActivationManager(
        model,
        targets,
        device,
        runtime_state_storages(runtime, model),
        runtime.saved_scope,
        host_arena=runtime.ctx.host_arena,
    )
