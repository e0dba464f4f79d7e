"""`agent.wrap`: get a plan, apply it to a model and optimizer, measure, report; `agent.unwrap`: give them back.

    wrapped = agent.wrap(model, optimizer, sample_batch=batch, device_memory=8 << 30)  # or plan=...
    for batch in data:
        loss = wrapped.model(**batch).loss
        loss.backward()
        wrapped.optimizer.step()          # a scheduler built on wrapped.optimizer works as usual
        wrapped.optimizer.zero_grad()
    print(wrapped.report())               # plan, predicted vs measured, feedback, runtime figures
    model = agent.unwrap(wrapped)         # ordinary parameters again; the original optimizer gets the state

Without `plan=`, the plan comes from the service's history (same model fingerprint, hardware and
workload), from the service (`server=` or MEMPLAN_SERVER: upload the profiled trace, request, wait), or
from the same solver in-process (the embedded default, and the fallback when the service is down or
slow; see `agent/planning.py`). Then, in order: every check that can fail (plan, activation modes,
optimizer, layout) before the model is touched; the model-state runtime (chunks, offload, host
optimizer: `apply_plan`); the activation modes (`runtime/activations.py`); a step monitor that sends
feedback after `feedback_steps` steps (`feedback.py`).

Why one module over 400 lines: it is the one call a user makes, read in order (plan, apply, measure, report)
with its undo `unwrap`; the steps' work is in `planning.py`, `runtime/` and `feedback.py`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from agent.allocator.install import attach_managed_allocation, install_planned_first, planned_cuda_device
from agent.allocator.select import MODES, select
from agent.batch_guard import BatchShapeGuard, batch_shape
from agent.feedback import LocalSink, ServiceSink, StepMonitor, local_feedback_path
from agent.kv_cache import KVCacheOff
from agent.model_guards import MoveGuard, byte_size, check_not_compiled
from agent.planning import PlanSource, obtain_plan
from agent.report import WrapReport
from agent.runtime.activations import apply_activation_policy, block_targets
from agent.runtime.arena import runtime_arena_context
from agent.runtime.device import DeviceContext
from agent.runtime.host_arena import host_arena_for
from agent.runtime.layout import ChunkLayout
from agent.runtime.manager import ModelStateManager
from agent.runtime.optimizer import ChunkedOptimizer, check_parameters, check_supported
from agent.runtime.options import RuntimeOptions
from agent.runtime.process_group import resolve

if TYPE_CHECKING:
    from pathlib import Path

    from torch import nn

    from agent.allocator.select import AllocatorSelection
    from agent.feedback import StepMonitor
    from agent.runtime.accounting import RuntimeReport
    from agent.runtime.activations import ActivationManager
    from agent.runtime.process_group import RankGroup
    from client.contract import Feedback, Plan


log = logging.getLogger(__name__)

DEFAULT_FEEDBACK_STEPS = 20
"""Optimizer steps after which `wrap`'s monitor sends feedback."""


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
    batch_guard: BatchShapeGuard | None = field(default=None, repr=False)
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


def wrap(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    sample_batch: Any = None,
    max_batch: Any = None,
    server: str | None = None,
    device_memory: int | float | str | None = None,
    host_memory: int | float | str | None = None,
    blocks: Sequence[nn.Module] | None = None,
    plan: Plan | None = None,
    options: RuntimeOptions | None = None,
    loss_fn: Any = None,
    feedback_steps: int | None = DEFAULT_FEEDBACK_STEPS,
    feedback_path: Path | None = None,
    wait_s: float = 120.0,
    service_budget_s: float | None = None,
    reuse: bool = True,
    allocation: str = "caching",
    clips_gradients: bool = False,
    process_group: Any = None,
) -> Wrapped:
    """Plan (unless `plan` is given), apply model-state and activation policies, and measure.

    `sample_batch`: one batch as the model takes it (needed without `plan`, to profile); `max_batch`: the
    largest batch you will train on (rows and sequence length), profiled and planned for instead of
    `sample_batch`; a larger batch at run time warns once (CPU) or raises BatchShapeError before the forward
    (GPU). `loss_fn(output,
    batch)` if the model does not return `.loss`. `server`: planner service URL (default MEMPLAN_SERVER;
    neither: solve in-process). `device_memory` / `host_memory`: limits as bytes (an int, or a float with
    no fraction such as 80e9) or a size string ("80GiB", "24GB"); default: the device's and the host's.
    `blocks`: the model's repeated blocks in execution order, when they are not found by themselves (an
    `nn.ModuleList` or `nn.Sequential` of same-class modules is). `feedback_steps`: after this many optimizer steps the measured iteration time and peaks go
    to the service (plans from it) or to `feedback_path` (default MEMPLAN_FEEDBACK_PATH, else
    ~/.memplan/feedback.jsonl); None: no
    monitor. `wait_s`: longest wait for the service's plan before solving in-process; `service_budget_s`: the most time the
    whole service path may take (history look-up, upload, request, wait; default `wait_s` + 15 s), after
    which `wrap` solves in-process and says so once. `reuse=False`:
    profile and plan afresh even when the service's history has a plan for this job. `clips_gradients`: the
    job scales gradients after backward on most steps (clipping): the plan then counts the redo of the
    overlapped host steps (clipping works either way; this only informs the prediction).
    `process_group`: the `torch.distributed` group the job trains in (default: the default group when
    torch.distributed is initialised with more than one rank). Under a group, rank 0 obtains the plan and
    broadcasts it, rank 0's parameters and buffers are broadcast (as DDP does), gradients are averaged
    across the ranks after every backward outside `wrapped.no_sync()`, and feedback is the slowest rank's
    time and the largest rank's peaks, sent by rank 0. Call `wrap` on every rank. See
    docs/architecture/runtime.md, "Multi-process jobs".

    The model's parameters become views into chunk buffers laid out as the plan says; use the returned
    `.model` and `.optimizer` from here on (the optimizer passed in is left untouched and goes stale).
    After backward every parameter has `.grad` (offloaded ones on the host), so clipping with
    `torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`, Accelerate's or `wrapped.clip_grad_norm_` gives
    torch's result.
    Raises, leaving model and optimizer untouched: BlockDetectionError (no repeated blocks to plan for),
    PlanInfeasibleError (nothing fits; says what would), PlanMismatchError / ActivationPlanError (the plan
    does not match the model, naming the parameter or block), UnsupportedOptimizerError, CompiledModelError
    (a torch.compile'd model or block), ValueError/TypeError naming a bad argument.
    While wrapped: the KV cache is off (`use_cache=False`; `unwrap` restores it), `.model.to()` to where the
    model is is a no-op and any other move or cast raises WrappedModelMoveError, and a batch larger than
    planned warns once (CPU) or raises BatchShapeError (GPU). See docs/architecture/wrap.md.
    """

    if getattr(model, "_memplan_wrapped", False):
        raise RuntimeError("model: is already wrapped; unwrap it first")
    if allocation not in MODES:
        raise ValueError(f"allocation: must be one of {', '.join(MODES)}, got {allocation!r}")
    device_bytes = byte_size("device_memory", device_memory)
    host_bytes = byte_size("host_memory", host_memory)
    check_not_compiled(model)
    check_supported(optimizer)

    group = resolve(process_group)
    cache_off = KVCacheOff(model)  # training never uses the KV cache; unwrap restores the user's setting
    try:
        wrapped = _wrap(
            model,
            optimizer,
            cache_off,
            plan=plan,
            sample_batch=max_batch if max_batch is not None else sample_batch,
            server=server,
            device_memory=device_bytes,
            host_memory=host_bytes,
            blocks=blocks,
            options=options,
            loss_fn=loss_fn,
            feedback_steps=feedback_steps,
            feedback_path=feedback_path,
            wait_s=wait_s,
            service_budget_s=service_budget_s,
            reuse=reuse,
            allocation=allocation,
            clips_gradients=clips_gradients,
            group=group,
        )
    except BaseException:
        cache_off.restore()
        raise
    return wrapped


def _wrap(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    cache_off: KVCacheOff,
    *,
    plan: Plan | None,
    sample_batch: Any,
    server: str | None,
    device_memory: int | None,
    host_memory: int | None,
    blocks: Sequence[nn.Module] | None,
    options: RuntimeOptions | None,
    loss_fn: Any,
    feedback_steps: int | None,
    feedback_path: Path | None,
    wait_s: float,
    service_budget_s: float | None,
    reuse: bool,
    allocation: str,
    clips_gradients: bool,
    group: RankGroup | None = None,
) -> Wrapped:
    """`wrap` after its argument checks, with the KV cache already off."""

    obtain_kwargs: dict[str, Any] = dict(
        server=server,
        device_memory=device_memory,
        host_memory=host_memory,
        wait_s=wait_s,
        service_budget_s=service_budget_s,
        reuse=reuse,
        clips_gradients=clips_gradients,
    )
    selection: AllocatorSelection | None = None
    cuda = planned_cuda_device(model, options) if allocation == "planned" else None
    if cuda is not None and group is not None:
        raise ValueError(
            "allocation: 'planned' on CUDA is single-process only for now (the planned allocator is installed "
            "before CUDA starts, from a plan each rank would need before any collective); use 'caching'"
        )
    if group is not None and not group.is_main:
        # the plan is solved (and the model profiled) once, by rank 0 (issue 20)
        received = group.broadcast_object(None)
        if isinstance(received, str):
            raise RuntimeError(f"memplan: rank 0 could not obtain the plan: {received}")
        source = received
    elif cuda is not None:
        # Level 2 on CUDA: the allocator goes in before anything here initialises CUDA (agent/allocator/install.py)
        source, selection = install_planned_first(
            model,
            optimizer,
            plan,
            sample_batch=sample_batch,
            loss_fn=loss_fn,
            options=options,
            blocks=blocks,
            device=cuda,
            obtain_kwargs=obtain_kwargs,
        )
        log.info("memplan: %s; %s", source.message, selection.reason)
    elif plan is not None:
        source = PlanSource(plan, "given", message="plan given to wrap")
    else:
        try:
            source = obtain_plan(
                model,
                optimizer,
                sample_batch,
                loss_fn=loss_fn,
                blocks=blocks,
                options=options,
                **obtain_kwargs,
            )
            log.info("memplan: %s", source.message)
            source = attach_managed_allocation(
                source,
                model,
                optimizer,
                sample_batch,
                loss_fn=loss_fn,
                options=options,
                arena=allocation == "planned",
            )
        except BaseException as exc:
            if group is not None:  # the other ranks wait for the plan: tell them why none comes
                group.broadcast_object(f"{type(exc).__name__}: {exc}")
            raise
    if group is not None and group.is_main:
        group.broadcast_object(source)
    plan = source.plan
    if plan.policy is None:
        raise ValueError(f"plan.policy: absent (solver status {plan.solver.status.value}); nothing to apply")
    block_targets(model, plan.policy)  # activation checks before the model is touched
    if selection is None:
        selection = _select_allocator(allocation, plan, source, target_device(model, options))
    # the runtime's own arena (Level 1) only where no planned allocator places every tensor (Level 2 places
    # the runtime's buffers too: they are long-lived slots of the managed iteration it replays)
    wrapped = apply_plan(
        model, optimizer, plan, options, arena=allocation == "planned" and selection is None, group=group
    )
    wrapped.source = source
    wrapped.allocator = selection
    wrapped.kv_cache = cache_off
    if selection is not None:
        selection.attach(model)
    try:
        wrapped.activations = apply_activation_policy(
            model, plan.policy, wrapped.runtime.ctx.device, wrapped.runtime
        )
    except BaseException:
        unwrap(wrapped)
        raise
    wrapped.move_guard = MoveGuard(model, wrapped.runtime.ctx.device, next(model.parameters()).dtype)
    planned_shape = batch_shape(sample_batch) if sample_batch is not None else None
    if planned_shape is not None:
        wrapped.batch_guard = BatchShapeGuard(model, planned_shape, wrapped.runtime.ctx.device)
    if feedback_steps:
        local = LocalSink(
            feedback_path or local_feedback_path(), plan_id=source.plan_id, trace_hash=plan.trace_hash
        )
        sink = (
            ServiceSink(source.server, source.plan_id, fallback=local)
            if (source.server and source.plan_id)
            else local
        )
        strip = plan.policy.mode_strip()
        wrapped.monitor = StepMonitor(
            model,
            wrapped.optimizer,
            wrapped.runtime.ctx.device,
            manager=wrapped.runtime,
            activations=wrapped.activations,
            sink=sink,
            steps=feedback_steps,
            notes=lambda: f"memplan agent; plan origin {source.origin}; modes {strip}",
            group=group,
        )
    return wrapped


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


def _select_allocator(
    allocation: str, plan: Plan, source: PlanSource, device: torch.device
) -> AllocatorSelection | None:
    """allocation="planned": the planned CUDA allocator for every tensor of the iteration (Level 2), installed
    before the runtime allocates anything; on a device without a pluggable allocator (CPU) only the runtime's
    own buffers are planned (Level 1, the arena in `apply_plan`)."""
    if allocation != "planned":
        return None

    if device.type != "cuda":
        log.info(
            "memplan: allocation='planned' on %s: the runtime's buffers use the planned arena; "
            "other tensors keep PyTorch's allocator (no pluggable allocator off CUDA)",
            device.type,
        )
        return None
    events = (
        source.trace.allocation_trace
        if plan.allocation is not None and plan.allocation.events is None and source.trace is not None
        else None
    )  # None: the plan's own allocation.events
    return select("planned", plan, events, device=device)


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
    opts = options or RuntimeOptions()
    params = list(model.parameters())
    if not params:
        raise ValueError("model: has no parameters")
    model_dtype = params[0].dtype
    compute_dtype = opts.compute_dtype or model_dtype
    device = target_device(model, opts)
    layout = ChunkLayout.from_policy(plan.policy, model, compute_dtype)
    check_parameters(optimizer, layout)  # every check before the model is touched
    user_state = optimizer.state_dict() if optimizer.state else None
    ctx = runtime_arena_context(device, layout) if arena else DeviceContext(device)
    ctx.host_arena = host_arena_for(plan, layout, device, fp32_master=opts.fp32_master)  # pinned: one arena
    if group is not None:
        broadcast_model(model, group)
    manager = ModelStateManager(model, layout, ctx, opts, group)
    wrapped_opt = ChunkedOptimizer(optimizer, layout, manager)
    manager.attach_optimizer(wrapped_opt)
    if user_state is not None:
        wrapped_opt.load_state_dict(user_state)  # wrapping mid-training keeps the optimizer's state
    model._memplan_wrapped = True  # type: ignore[assignment]
    return Wrapped(
        model=model, optimizer=wrapped_opt, plan=plan, runtime=manager, original_optimizer=optimizer
    )


def broadcast_model(model: nn.Module, group: RankGroup) -> None:
    """Every rank's parameters and buffers become rank 0's, as `DistributedDataParallel` does at
    construction (ranks seeded differently start from the same model)."""

    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            group.broadcast_(t.data)


def unwrap(wrapped: Wrapped) -> nn.Module:
    """Undo `wrap`: remove the monitor and the activation modes (block modules exactly as before), turn
    the parameters back into ordinary tensors holding their trained values, on their original device and
    dtype, remove every hook, and load the trained optimizer state into the original optimizer (so plain
    PyTorch training continues exactly). Returns the model."""
    wrapped._check()
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
    state = wrapped.optimizer.state_dict()
    wrapped.runtime.detach()
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
