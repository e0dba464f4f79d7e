"""The allocation plan of the managed iteration (issue 19 defect 3): one iteration run under the plan, placed.

The service places the buffers of the *profiled* iteration (the trace's allocation trace: every parameter
on the device, every activation kept). A run under an offload, checkpoint or swap plan allocates something
else: offloaded chunks stream through a few device buffers, checkpointed blocks free their activations and
recompute them in backward, swapped activations come back from the host. The planned allocator replays
the plan slot by slot, so its plan must be the plan of *that* iteration.

`record_managed_trace` applies the plan to a copy of the job on the CPU (the runtime runs there: chunks,
offload, host optimizer, activation modes), runs one warm-up iteration (optimizer state comes into being),
and records the next one with the profiler's CPU storage tracker, registered exactly as the feedback's
`DevicePeakMeter` registers its window (`agent.measure.device_state_tensors`: persistent chunks, their
gradients, masters and optimizer state, the device buffers of offloaded chunks, the model's buffers are
long-lived; the batch is external). The runtime's host copies are made before the window and swap's host
staging is made with dispatch modes off, so what is recorded is what the device would hold. The result is
an `AllocationTrace` (source "dispatch_tracker"); `plan_managed_allocation` places it with the service's
allocation planner (`planner_service.solver.plan.solve_allocation`, validated) and puts it in the plan as
`allocation` with `iteration="managed"` and the events it places, so the plan alone is what the planned
CUDA allocator needs.

Costs: a second copy of the model and its optimizer in host memory while recording, and two CPU
iterations. The copy is on the CPU whatever device the job trains on, so recording never touches CUDA
(the planned allocator has to be installed before CUDA is initialised). Where the feedback monitor meters a
step of the job itself, `wrap` records that step instead and copies nothing (`agent.allocator.managed_step`,
issue 16); both hand their events to `agent.allocator.publish.place_and_publish`.

Not verified on a GPU (none where this was written): that the CUDA iteration makes its allocations in the
order the CPU iteration does. Kernels that allocate differently on CUDA (cuBLAS workspaces, SDPA's
backend choice) are what the allocator's matching rules (lookahead, shrink, the guarded pool) absorb,
and its statistics (`planned`, `pool_fallbacks`, `device_fallbacks`) say how well the plan was followed.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
from typing import TYPE_CHECKING, Any

import torch

from agent.applied import apply_plan, unwrap
from agent.measure import device_state_tensors
from agent.profiler.allocation_trace import build_allocation_trace
from agent.profiler.session import TrainingStep, move_batch
from agent.profiler.storage_tracker import StorageTracker
from agent.profiler.tensors import iter_tensors
from agent.random_states import RandomStates
from agent.runtime.activations import apply_activation_policy
from agent.runtime.options import RuntimeOptions
from client.contract import AllocationTrace, Plan

if TYPE_CHECKING:
    from torch import nn


WARMUP_ITERATIONS = 2
"""Iterations run before the recorded one (as the feedback monitor meters its third step)."""

MANAGED_ALLOCATION_TIME_LIMIT_S = 10.0
"""Time limit of placing the managed iteration's buffers (the planner always returns a valid placement)."""


class ManagedTraceError(ValueError):
    """The managed iteration cannot be recorded as asked (message names the argument)."""


def copy_job(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A CPU copy of `model` and an optimizer of the same class and settings (and state) over the copy."""

    if any(p.device.type != "cpu" for p in model.parameters()):
        raise ManagedTraceError(
            "model: the managed iteration is recorded on a CPU copy of the model; this model's parameters are "
            "on another device already (wrap the model while it is still on the CPU)"
        )
    twin = copy.deepcopy(model)
    by_id = {id(p): q for p, q in zip(model.parameters(), twin.parameters(), strict=True)}
    groups: list[dict[str, Any]] = []
    for i, g in enumerate(optimizer.param_groups):
        missing = [k for k, p in enumerate(g["params"]) if id(p) not in by_id]
        if missing:
            raise ManagedTraceError(
                f"optimizer.param_groups[{i}].params[{missing[0]}]: is not a parameter of the model"
            )
        groups.append(
            {**{k: v for k, v in g.items() if k != "params"}, "params": [by_id[id(p)] for p in g["params"]]}
        )
    accepted = inspect.signature(type(optimizer)).parameters
    twin_opt = type(optimizer)(groups, **{k: v for k, v in optimizer.defaults.items() if k in accepted})
    if optimizer.state:
        twin_opt.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    assert all(p.device == torch.device("cpu") for p in twin.parameters())
    return twin, twin_opt


def record_managed_trace(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    plan: Plan,
    batch: Any,
    *,
    loss_fn: Any = None,
    options: RuntimeOptions | None = None,
    arena: bool = False,
) -> AllocationTrace:
    """The allocation trace of one steady-state iteration of `model` run under `plan` (on a CPU copy).

    `options` as `wrap` applies them (the device is replaced by the CPU); `arena`: the runtime's buffers are
    views into one planned arena, as `wrap(..., allocation="planned")` does where no pluggable allocator
    exists. Leaves `model` and `optimizer` untouched."""

    if plan.policy is None:
        raise ManagedTraceError(
            f"plan.policy: absent (solver status {plan.solver.status.value}); there is no managed iteration"
        )
    if batch is None:
        raise ManagedTraceError(
            "sample_batch: needed to run the managed iteration (one batch, as the model takes it)"
        )
    cpu = torch.device("cpu")
    opts = dataclasses.replace(
        options or RuntimeOptions(), device=cpu, async_step=False, measure_uploads=False
    )
    twin, twin_opt = copy_job(model, optimizer)
    rng = RandomStates.capture()
    wrapped = apply_plan(twin, twin_opt, plan, opts, arena=arena)
    try:
        wrapped.activations = apply_activation_policy(twin, plan.policy, cpu, wrapped.runtime)
        step = TrainingStep(twin, move_batch(batch, cpu), loss_fn, wrapped.optimizer, n_blocks=1)
        for _ in range(
            WARMUP_ITERATIONS
        ):  # optimizer state, undo backups, swap buffers, caches come into being
            step.run()
        wrapped.optimizer.zero_grad(set_to_none=True)
        tracker = StorageTracker()
        for t, cat in device_state_tensors(twin, wrapped.runtime):
            tracker.register_existing(t, cat, None)
        for t in iter_tensors(step.batch):
            tracker.register_external(t)
        with tracker:
            loss = step.forward_loss()
            loss.backward()
            del loss
            wrapped.optimizer.step()
            grad_sids = {
                rec.sid
                for p in twin.parameters()
                if p.grad is not None
                for rec in [tracker.record_of(p.grad)]
                if rec is not None
            }
        return build_allocation_trace(
            tracker.records, tracker.n_events, grad_sids=grad_sids, grad_blocks={}, source="dispatch_tracker"
        )
    finally:
        unwrap(wrapped)
        rng.restore()


def plan_managed_allocation(
    plan: Plan, events: AllocationTrace, *, time_limit_s: float = MANAGED_ALLOCATION_TIME_LIMIT_S
) -> Plan:
    """`plan` with its `allocation` replaced by the placement of `events` (the managed iteration), validated."""
    # local import: the solver (ortools, numba) loads only when an allocation is solved in-process
    from planner_service.solver.plan import solve_allocation

    return plan.model_copy(update={"allocation": solve_allocation(events, time_limit_s, iteration="managed")})


def with_managed_allocation(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    plan: Plan,
    batch: Any,
    *,
    loss_fn: Any = None,
    options: RuntimeOptions | None = None,
    arena: bool = False,
    time_limit_s: float = MANAGED_ALLOCATION_TIME_LIMIT_S,
) -> Plan:
    """Record the managed iteration of `plan` and return the plan with its allocation (see the module doc)."""
    events = record_managed_trace(
        model, optimizer, plan, batch, loss_fn=loss_fn, options=options, arena=arena
    )
    return plan_managed_allocation(plan, events, time_limit_s=time_limit_s)


def has_managed_allocation(plan: Plan | None) -> bool:
    """The plan carries the placement of its own (managed) iteration, with the events it places."""
    a = plan.allocation if plan is not None else None
    return a is not None and a.iteration == "managed" and a.events is not None
