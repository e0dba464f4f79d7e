"""A plan applied to a model and optimizer, and undone: `apply_plan` (the model-state runtime: chunks, offload,
host optimizer), the `Wrapped` it returns, and `unwrap`.

Apart from `wrapping.py` (the one call, `wrap`, which plans, applies and measures) because what applies a
plan is also used below `wrap`: the managed iteration that the allocation plan places is recorded by
applying the plan to a CPU copy of the job (`agent/allocator/managed.py`), which `wrap` itself reaches. With
both in one module the two would import each other.
"""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from agent.model_guards import check_one_dtype_and_device
from agent.report import WrapReport
from agent.runtime.arena import runtime_arena_context
from agent.runtime.device import DeviceContext
from agent.runtime.host_arena import host_arena_for
from agent.runtime.layout import ChunkLayout, check_world
from agent.runtime.manager import ModelStateManager
from agent.runtime.node_shared import NodeSharing, open_node_shared
from agent.runtime.optimizer import ChunkedOptimizer, check_parameters, check_supported
from agent.runtime.optimizer_alias import OptimizerAlias
from agent.runtime.options import RuntimeOptions
from agent.runtime.process_group import release

if TYPE_CHECKING:
    from torch import nn

    from agent.allocator.select import AllocatorSelection
    from agent.batch_guard import BatchShapeGuard
    from agent.feedback import StepMonitor
    from agent.kv_cache import KVCacheOff
    from agent.model_guards import DDPGuard, MoveGuard, SyncedGenerate
    from agent.planning import PlanSource
    from agent.runtime.accounting import RuntimeReport
    from agent.runtime.activations import ActivationManager
    from agent.runtime.process_group import RankGroup
    from client.contract import Feedback, Plan

log = logging.getLogger(__name__)


@dataclass
class Wrapped:
    """What `wrap` returns: the managed model and optimizer, the plan applied, where it came from, and the
    runtime parts (model state, activation modes, step monitor)."""

    model: nn.Module
    optimizer: ChunkedOptimizer
    plan: Plan
    runtime: ModelStateManager
    original_optimizer: torch.optim.Optimizer = field(repr=False)
    source: PlanSource | None = None
    activations: ActivationManager | None = field(default=None, repr=False)
    monitor: StepMonitor | None = field(default=None, repr=False)
    allocator: AllocatorSelection | None = field(default=None, repr=False)
    kv_cache: KVCacheOff | None = field(default=None, repr=False)
    move_guard: MoveGuard | None = field(default=None, repr=False)
    ddp_guard: DDPGuard | None = field(default=None, repr=False)
    synced_generate: SyncedGenerate | None = field(default=None, repr=False)
    batch_guard: BatchShapeGuard | None = field(default=None, repr=False)
    # the optimizer given to `wrap` does what `optimizer` does, until unwrap (`optimizer_alias.py`)
    optimizer_alias: OptimizerAlias | None = field(default=None, repr=False)
    unwrapped: bool = False

    def report(self) -> WrapReport:
        """Plan summary, predicted vs measured (once the monitor has measured), feedback, runtime figures."""

        self._check()
        policy = self.plan.policy
        assert policy is not None
        pred = self.plan.predictions
        if self.monitor is not None:
            self.monitor.wait_sent()
        m = self.monitor.measured if self.monitor is not None else None
        store = self.activations.store if self.activations is not None else None
        origin = self.source.origin if self.source is not None else "given"
        return WrapReport(
            origin=origin,
            message=(self.source.message if self.source is not None else "") or origin,
            solver=self.plan.solver.solver,
            solver_status=self.plan.solver.status.value,
            mode_strip=policy.mode_strip(),
            chunks=len(policy.chunks),
            offloaded_chunks=sum(c.placement.value == "offloaded" for c in policy.chunks),
            n_buffers=policy.n_buffers,
            predicted_iteration_s=pred.iteration_s if pred else None,
            predicted_peak_device_bytes=pred.peak_device_bytes if pred else None,
            predicted_peak_host_bytes=pred.peak_host_bytes if pred else None,
            predicted_phases=pred.phases() if pred else None,
            predicted_uploads=pred.uploads_per_iteration if pred else None,
            measured=(m.sent or m.feedback()) if m is not None else None,
            feedback_to=m.sent_to if m is not None else None,
            runtime=self.runtime_report(),
            swap=store.counters if store is not None else None,
        )

    def runtime_report(self) -> RuntimeReport:
        """Bytes held on device and host by category, and what moved (uploads, hits, host steps)."""
        self._check()
        impls = {s.impl for s in self.runtime.steppers if s.state.offloaded and s.inner is not None}
        return self.runtime.report(host_optimizer="/".join(sorted(impls)) or "none")

    def feedback(self) -> Feedback | None:
        """Send the feedback now, before `feedback_steps` steps (None if too few steps were measured)."""
        self._check()
        return self.monitor.flush() if self.monitor is not None else None

    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        """Clip gradients by their global norm across persistent and offloaded chunks (torch semantics).

        Call after backward, before `optimizer.step()`; the same as `torch.nn.utils.clip_grad_norm_` over
        `wrapped.model.parameters()`. Overlapped host steps whose gradients it scales are redone at `step()`.
        """
        self._check()
        return self.runtime.clip_grad_norm_(
            max_norm, norm_type=norm_type, error_if_nonfinite=error_if_nonfinite
        )

    def no_sync(self) -> AbstractContextManager[None]:
        """Under a process group: forwards (and their backwards) inside keep gradients local, as
        `DistributedDataParallel.no_sync` (gradient accumulation without communication); the first
        backward outside averages the accumulated gradients. A no-op in a single-process job."""
        self._check()
        return self.runtime.no_sync()

    def synchronize(self) -> None:
        """Wait for host optimizer work in flight (before reading offloaded parameters directly)."""
        self._check()
        self.runtime.synchronize()

    def _check(self) -> None:
        if self.unwrapped:
            raise RuntimeError("this wrapped model was unwrapped; wrap it again to use the runtime")


def target_device(model: nn.Module, options: RuntimeOptions | None = None) -> torch.device:
    """Where the runtime puts device state: the option, else the model's device, else CUDA if present."""

    params = list(model.parameters())
    if options is not None and options.device is not None:
        device = torch.device(options.device)
    elif params and params[0].device.type != "cpu":
        device = params[0].device
    else:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda" and device.index is None:
        # current_device() initialises CUDA; until then the current device is 0 (the planned allocator must be
        # installed before CUDA is initialised, issue 19 defect 3)
        device = torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_initialized() else 0)
    return device


def apply_plan(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    plan: Plan,
    options: RuntimeOptions | None = None,
    *,
    arena: bool = False,
    group: RankGroup | None = None,
) -> Wrapped:
    """The model-state part of `wrap`: chunks, offload and host optimizer as the plan says (no activation
    modes, no monitor). `arena`: the runtime's device buffers are views into one planned arena (nothing of
    the runtime's is allocated after warm-up). Raises PlanMismatchError (naming the parameter) when the
    layout does not match. `group`: the job's process group (rank 0's parameters and buffers are broadcast,
    gradients averaged across the ranks)."""

    if plan.policy is None:
        raise ValueError(f"plan.policy: absent (solver status {plan.solver.status.value}); nothing to apply")
    if getattr(model, "_memplan_wrapped", False):
        raise RuntimeError("model: is already wrapped; unwrap it first")
    check_supported(optimizer)
    check_one_dtype_and_device(model)
    opts = options or RuntimeOptions()
    params = list(model.parameters())
    if not params:
        raise ValueError("model: has no parameters")
    model_dtype = params[0].dtype
    compute_dtype = opts.compute_dtype or model_dtype
    device = target_device(model, opts)
    layout = ChunkLayout.from_policy(plan.policy, model, compute_dtype)
    check_world(layout, group.world_size if group is not None else 1)
    check_parameters(optimizer, layout)  # every check before the model is touched
    user_state = optimizer.state_dict() if optimizer.state else None
    ctx = runtime_arena_context(device, layout) if arena else DeviceContext(device)
    # sharded chunks on one node: their compute copies in node-shared memory (a collective; None: private)
    sharing = open_node_shared(layout, group, opts, device) if group is not None else NodeSharing(None, False)
    ctx.host_arena = host_arena_for(  # pinned: one arena (without the node-shared copies)
        plan,
        layout,
        device,
        fp32_master=opts.fp32_master,
        shared_compute=sharing.copy is not None,
        plan_shares=sharing.planned,
    )
    if group is not None:
        broadcast_model(model, group)
    manager = ModelStateManager(model, layout, ctx, opts, group, sharing.copy)
    wrapped_opt = ChunkedOptimizer(optimizer, layout, manager)
    manager.attach_optimizer(wrapped_opt)
    if user_state is not None:
        wrapped_opt.load_state_dict(user_state)  # wrapping mid-training keeps the optimizer's state
    model._memplan_wrapped = True  # type: ignore[assignment]
    return Wrapped(
        model=model,
        optimizer=wrapped_opt,
        plan=plan,
        runtime=manager,
        original_optimizer=optimizer,
        optimizer_alias=OptimizerAlias(optimizer, wrapped_opt),
    )


def broadcast_model(model: nn.Module, group: RankGroup) -> None:
    """Every rank's parameters and buffers become rank 0's, as `DistributedDataParallel` does at
    construction (ranks seeded differently start from the same model)."""

    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            group.broadcast_(t.data)


def remove_guards(wrapped: Wrapped) -> None:
    """Remove the monitor, the activation modes and the guards (`.to()`, batch shape, DDP, generate's default)
    on this rank alone, without a collective: the first part of `unwrap`, and all a rank that raised on its own
    can undo (the Lightning callback's `on_exception` under several processes), where `unwrap`'s gathers would
    wait for ranks that are not coming. The parameters stay the runtime's: the model cannot train on."""
    if wrapped.monitor is not None:
        wrapped.monitor.close()
        wrapped.monitor = None
    if wrapped.activations is not None:
        wrapped.activations.remove()
        wrapped.activations = None
    if wrapped.move_guard is not None:
        wrapped.move_guard.remove()
        wrapped.move_guard = None
    if wrapped.batch_guard is not None:
        wrapped.batch_guard.remove()
        wrapped.batch_guard = None
    if wrapped.ddp_guard is not None:
        wrapped.ddp_guard.remove()
        wrapped.ddp_guard = None
    if wrapped.synced_generate is not None:
        wrapped.synced_generate.remove()
        wrapped.synced_generate = None
    if wrapped.optimizer_alias is not None:
        wrapped.optimizer_alias.remove()
        wrapped.optimizer_alias = None


def unwrap(wrapped: Wrapped) -> nn.Module:
    """Undo `wrap`: remove the monitor and the activation modes (block modules exactly as before), turn
    the parameters back into ordinary tensors holding their trained values, on their original device and
    dtype, remove every hook, and load the trained optimizer state into the original optimizer (so plain
    PyTorch training continues exactly). Returns the model. With sharded chunks a collective: every rank."""
    wrapped._check()
    wrapped.optimizer.check_every_rank("agent.unwrap(wrapped)", "Call agent.unwrap on every rank.")
    remove_guards(wrapped)
    state = wrapped.optimizer.gathered_state_dict()
    wrapped.runtime.detach()
    release(wrapped.runtime.group)  # (detached: its host worker has stopped) the next wrap may reuse it
    wrapped.runtime.ctx.close_host_arena()  # unregister the page-locked arena (CUDA)
    model = wrapped.model
    model._memplan_wrapped = False  # type: ignore[assignment]
    for g_orig, g_new in zip(
        wrapped.original_optimizer.param_groups, wrapped.optimizer.param_groups, strict=True
    ):
        g_orig.update({k: v for k, v in g_new.items() if k != "params"})
    if state["state"]:
        state = {
            **state,
            "state": {
                k: {n: v for n, v in s.items() if n != "master_param"} for k, s in state["state"].items()
            },
        }
        wrapped.original_optimizer.load_state_dict(state)
    if wrapped.kv_cache is not None:
        wrapped.kv_cache.restore()
        wrapped.kv_cache = None
    wrapped.unwrapped = True
    return model
