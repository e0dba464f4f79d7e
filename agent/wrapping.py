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
feedback after `feedback_steps` steps (`feedback.py`) and whose metered step becomes the plan's managed
allocation when the plan has none (`allocator/managed_step.py`).

Why one module over 400 lines: it is the one call a user makes, read in order (plan, apply, measure, report)
with its undo `unwrap`; the steps' work is in `planning.py`, `runtime/` and `feedback.py`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from agent.allocator.install import (
    attach_managed_allocation,
    install_planned_first,
    load_plan,
    planned_cuda_device,
)
from agent.allocator.managed import has_managed_allocation
from agent.allocator.managed_step import ManagedStepRecorder
from agent.allocator.select import MODES, select
from agent.applied import Wrapped, apply_plan, target_device, unwrap
from agent.batch_guard import BatchShapeGuard, batch_shape
from agent.feedback import LocalSink, ServiceSink, StepMonitor, check_feedback_steps, local_feedback_path
from agent.group_profiling import ProfileEveryRank, RankProfilingError, profile_on_every_rank
from agent.kv_cache import KVCacheOff
from agent.model_guards import (
    DDPGuard,
    MoveGuard,
    SyncedGenerate,
    byte_size,
    check_dense_gradients,
    check_not_compiled,
    check_one_dtype_and_device,
    check_seconds,
)
from agent.planning import PlanSource, job_hardware, obtain_plan, profile_job
from agent.profiler.collectives import probe_for_planning
from agent.profiler.lockstep import meetings
from agent.profiler.profiling import REPEATS
from agent.profiler.session import check_grad_mode
from agent.runtime.activations import apply_activation_policy, block_targets
from agent.runtime.optimizer import check_owned, check_supported
from agent.runtime.options import RuntimeOptions
from agent.runtime.process_group import check_same_job, resolve

if TYPE_CHECKING:
    import os
    from pathlib import Path

    from torch import nn

    from agent.allocator.select import AllocatorSelection
    from agent.feedback import StepMonitor
    from agent.runtime.process_group import RankGroup
    from client.contract import Plan, Trace


__all__ = ["DEFAULT_FEEDBACK_STEPS", "Wrapped", "apply_plan", "target_device", "unwrap", "wrap"]

log = logging.getLogger(__name__)

DEFAULT_FEEDBACK_STEPS = 20
"""Optimizer steps after which `wrap`'s monitor sends feedback."""


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
    plan: Plan | str | Path | Mapping[str, Any] | None = None,
    options: RuntimeOptions | None = None,
    loss_fn: Any = None,
    feedback_steps: int | None = DEFAULT_FEEDBACK_STEPS,
    feedback_path: str | os.PathLike[str] | None = None,
    wait_s: float = 120.0,
    service_budget_s: float | None = None,
    reuse: bool = True,
    allocation: str = "caching",
    clips_gradients: bool = False,
    process_group: Any = None,
) -> Wrapped:
    """Plan (unless `plan` is given), apply model-state and activation policies, and measure.

    `plan`: a Plan, a path to its JSON (`memplan plans solve -o`) or a dict of it.
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
    torch.distributed is initialised with more than one rank). Under a group, every rank first measures the
    group's collectives when the job will be profiled (`collectives.probe_for_planning`); unless the
    service's history has the plan, every rank profiles its own model on its own batch at once and the
    trace of the largest batch, then of the slowest rank (it carries the world size and the collectives), is
    the job's (`group_profiling`; every rank's batch guard compares against that largest batch);
    rank 0 obtains a plan for the whole group and broadcasts it, rank 0's
    parameters and buffers are broadcast (as DDP does), gradients are averaged
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
    check_grad_mode("wrap")  # before the hardware probe, whose copies fail on inference tensors otherwise
    check_feedback_steps(feedback_steps)
    check_seconds("wait_s", wait_s)
    if service_budget_s is not None:
        check_seconds("service_budget_s", service_budget_s)
    device_bytes = byte_size("device_memory", device_memory)
    host_bytes = byte_size("host_memory", host_memory)
    check_not_compiled(model)
    check_dense_gradients(model)
    check_one_dtype_and_device(model)
    check_supported(optimizer)
    check_owned(optimizer, model)
    given = load_plan(plan) if plan is not None else None  # a path or dict too; an error names `plan`

    group = resolve(process_group)
    cache_off = KVCacheOff(model)  # training never uses the KV cache; unwrap restores the user's setting
    try:
        wrapped = _wrap(
            model,
            optimizer,
            cache_off,
            plan=given,
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
    feedback_path: str | os.PathLike[str] | None,
    wait_s: float,
    service_budget_s: float | None,
    reuse: bool,
    allocation: str,
    clips_gradients: bool,
    group: RankGroup | None = None,
) -> Wrapped:
    """`wrap` after its argument checks, with the KV cache already off."""

    # the batch shape the plan is made for, which the batch guard compares every batch against
    planned_shape = batch_shape(sample_batch) if sample_batch is not None else None
    if group is not None:  # before anything else collective: a clear error where the ranks' jobs differ
        agreed = check_same_job(
            group, model, batch=planned_shape, device_memory=device_memory, host_memory=host_memory
        )
        device_memory, host_memory = agreed.device_memory, agreed.host_memory
        planned_shape = agreed.batch  # the largest any rank gave: the job's trace is that batch's

    obtain_kwargs: dict[str, Any] = dict(
        server=server,
        device_memory=device_memory,
        host_memory=host_memory,
        wait_s=wait_s,
        service_budget_s=service_budget_s,
        reuse=reuse,
        clips_gradients=clips_gradients,
    )
    # the monitor's metered step records the plan's managed iteration (single process, PyTorch's allocator)
    metered = bool(feedback_steps) and allocation == "caching" and group is None
    selection: AllocatorSelection | None = None
    cuda = planned_cuda_device(model, options) if allocation == "planned" else None
    if cuda is not None and group is not None:
        raise ValueError(
            "allocation: 'planned' on CUDA is single-process only for now (the planned allocator is installed "
            "before CUDA starts, from a plan each rank would need before any collective); use 'caching'"
        )
    # a plan profiled for is the job's: every rank measures the group for its trace first (issue 20)
    distributed = (
        probe_for_planning(group, model if plan is None and sample_batch is not None else None)
        if group is not None
        else None
    )
    if group is not None and not group.is_main:
        # the plan is solved once, by rank 0, from a trace every rank profiles at once (issue 20)
        source = _receive_plan(
            group,
            lambda: job_hardware(model, device_memory, distributed),
            lambda lockstep: profile_job(
                model,
                optimizer,
                sample_batch,
                loss_fn=loss_fn,
                blocks=blocks,
                device_memory=device_memory,
                distributed=distributed,
                lockstep=lockstep,
            ),
        )
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
                distributed=distributed,
                group=group,
                job_batch=planned_shape if group is not None else None,
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
                metered=metered,
            )
        except BaseException as exc:
            # the other ranks wait for the plan: tell them why none comes (a failed profile they know of)
            if group is not None and not isinstance(exc, RankProfilingError):
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
    try:
        _finish(wrapped, planned_shape, feedback_steps, feedback_path, metered, group)
    except BaseException:
        # nothing half-wrapped: the model comes back as it was (parameters ordinary tensors, hooks off), so the
        # caller can fix the cause and wrap it again (with several ranks a collective: every rank failed alike)
        unwrap(wrapped)
        raise
    return wrapped


def _finish(
    wrapped: Wrapped,
    planned_shape: tuple[int, int] | None,
    feedback_steps: int | None,
    feedback_path: str | os.PathLike[str] | None,
    metered: bool,
    group: RankGroup | None,
) -> None:
    """`wrap` after the plan is applied: the allocator, activation modes, guards and the step monitor."""
    model, plan, selection = wrapped.model, wrapped.plan, wrapped.allocator
    source = wrapped.source
    assert plan.policy is not None and source is not None
    if selection is not None:
        selection.attach(model)
    wrapped.activations = apply_activation_policy(
        model, plan.policy, wrapped.runtime.ctx.device, wrapped.runtime
    )
    wrapped.move_guard = MoveGuard(model, wrapped.runtime.ctx.device, next(model.parameters()).dtype)
    wrapped.ddp_guard = DDPGuard(model)
    if wrapped.runtime.device_shards is not None and callable(getattr(model, "generate", None)):
        wrapped.synced_generate = SyncedGenerate(model)  # several ranks, chunks sharded on the device
    if planned_shape is not None:
        wrapped.batch_guard = BatchShapeGuard(model, planned_shape, wrapped.runtime.ctx.device)
    if feedback_steps:
        local = LocalSink(
            # (a str or a `~/...` path: LocalSink makes it a Path)
            feedback_path or local_feedback_path(),  # type: ignore[arg-type]
            plan_id=source.plan_id,
            trace_hash=plan.trace_hash,
        )
        sink = (
            ServiceSink(source.server, source.plan_id, fallback=local)
            if (source.server and source.plan_id)
            else local
        )
        strip = plan.policy.mode_strip()
        recorder = (
            ManagedStepRecorder(
                model, wrapped.runtime, wrapped.runtime.ctx.device, source, on_placed=_adopt_into(wrapped)
            )
            if metered and source.origin != "given" and not has_managed_allocation(plan)
            else None
        )
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
            recorder=recorder,
            planned_shape=planned_shape,
        )


def _receive_plan(
    group: RankGroup, hardware: Callable[[], object], profile: Callable[[Callable[[], None]], Trace]
) -> PlanSource:
    """On a rank other than 0: the plan rank 0 obtains for the job, profiling this rank's model with every
    other rank when rank 0 asks (`group_profiling`: no plan in the history). Raises when rank 0 could not
    obtain one, or `RankProfilingError` (on every rank) when profiling failed on any rank."""
    received = group.broadcast_object(None)
    if isinstance(received, ProfileEveryRank):
        profile_on_every_rank(group, profile, meetings(REPEATS), prepare=hardware)
        received = group.broadcast_object(None)
    if isinstance(received, str):
        raise RuntimeError(f"memplan: rank 0 could not obtain the plan: {received}")
    assert isinstance(received, PlanSource), type(received)
    return received


def _adopt_into(wrapped: Wrapped) -> Callable[[PlanSource], None]:
    """Where the managed step's placement goes (from its background thread): the wrapped job's plan and
    source, whose allocation it replaces (the policy applied is the same plan's)."""

    def adopt(placed: PlanSource) -> None:
        wrapped.source = placed
        wrapped.plan = placed.plan

    return adopt


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
