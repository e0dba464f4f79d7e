"""Installing the planned CUDA allocator before anything initialises CUDA (issue 19 defect 3).

PyTorch swaps its CUDA allocator only before its first CUDA allocation. So everything `wrap(...,
allocation="planned")` does on the way to the install must leave CUDA alone:

1. `planned_cuda_device` finds the device without `torch.cuda.current_device()` (which initialises CUDA;
   `torch.cuda.is_available()` does not);
2. a plan given to `wrap` that already carries its managed allocation (`iteration="managed"` with its
   events) is installed at once; any other plan gets one: the managed iteration is recorded on a CPU copy
   of the job (`agent.allocator.managed`, no CUDA);
3. without a plan, profiling and solving would initialise CUDA, so they run in a child process
   (`plan_subprocess.obtain_plan_in_subprocess`), and only the plan comes back;
4. then `select("planned", plan)` installs the allocator, and `wrap` goes on (the runtime's buffers,
   the model's move to the GPU: all served by the planned allocator).

Two calls for scripts that manage the order themselves:
* `plan_with_allocation(model, optimizer, sample_batch, path=...)`: a plan with its managed allocation,
  saved as JSON (run once, e.g. in a preparation script; it may use the GPU);
* `install_allocator(plan_file)`: the first line of the training script; `wrap(..., plan=same plan,
  allocation="planned")` then uses the allocator already installed.

Not run on a GPU where this was written: the ordering is tested on CPU by observing `torch.cuda`'s lazy
initialisation and the install call (tests/agent/allocator/test_install_order.py).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from pydantic import ValidationError

from agent.allocator import cuda as cuda_allocator
from agent.allocator.core import MatchRules
from agent.allocator.cuda import check_can_install, installed
from agent.allocator.managed import has_managed_allocation, record_managed_trace
from agent.allocator.plan_subprocess import obtain_plan_in_subprocess
from agent.allocator.publish import place_and_publish
from agent.allocator.select import AllocatorSelection, plan_key, select
from agent.planning import PlanSource, obtain_plan
from client.contract import Plan
from client.errors import first_problem

if TYPE_CHECKING:
    from torch import nn

    from agent.allocator.cuda import CudaPlannedAllocator
    from agent.runtime.options import RuntimeOptions

log = logging.getLogger(__name__)


def planned_cuda_device(model: nn.Module, options: RuntimeOptions | None) -> torch.device | None:
    """The CUDA device `wrap` will use (None: not CUDA), found without initialising CUDA: the option, else the
    model's device, else cuda:0 when a GPU is visible; an index-less "cuda" is the current device, which is
    device 0 until CUDA is initialised."""

    params = list(model.parameters())
    if options is not None and options.device is not None:
        device = torch.device(options.device)
    elif params and params[0].device.type != "cpu":
        device = params[0].device
    elif torch.cuda.is_available():
        device = torch.device("cuda")
    else:
        return None
    if device.type != "cuda":
        return None
    if device.index is None:
        index = torch.cuda.current_device() if torch.cuda.is_initialized() else 0
        device = torch.device("cuda", index)
    return device


def install_planned_first(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    plan: Plan | None,
    *,
    sample_batch: Any,
    loss_fn: Any,
    options: RuntimeOptions | None,
    blocks: Any,
    device: torch.device,
    obtain_kwargs: dict[str, Any],
) -> tuple[PlanSource, AllocatorSelection]:
    """Steps 2-4 of the module doc: the plan with its managed allocation, and the allocator installed from it,
    with no CUDA initialisation in this process before the install."""

    handle = installed()
    if handle is None:  # fail before any profiling or copying when the switch is already impossible
        check_can_install(
            cuda_available=True, cuda_initialized=torch.cuda.is_initialized(), already_installed=False
        )
    if plan is not None:
        source = PlanSource(plan, "given", message="plan given to wrap")
    else:
        source = obtain_plan_in_subprocess(
            model,
            optimizer,
            sample_batch,
            loss_fn=loss_fn,
            blocks=blocks,
            options=options,
            **obtain_kwargs,
        )
    if not has_managed_allocation(source.plan):
        events = record_managed_trace(
            model, optimizer, source.plan, sample_batch, loss_fn=loss_fn, options=options
        )
        source = place_and_publish(source, events)
    a = source.plan.allocation
    assert a is not None and a.events is not None
    if handle is not None:
        if handle.plan_key is not None and handle.plan_key != plan_key(source.plan):
            log.warning(
                "memplan: the planned CUDA allocator installed earlier (agent.install_allocator) replays another "
                "plan's allocation than the plan wrap applies; its statistics will show fallbacks"
            )
        selection = AllocatorSelection(
            "planned", "planned", f"planned CUDA allocator installed earlier on cuda:{handle.device}", handle
        )
        return source, selection
    return source, select("planned", source.plan, a.events, device=device)


def attach_managed_allocation(
    source: PlanSource,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    sample_batch: Any,
    *,
    loss_fn: Any,
    options: RuntimeOptions | None,
    arena: bool,
    metered: bool = False,
) -> PlanSource:
    """Give a plan from the service, its history or the in-process solver the allocation of its managed
    iteration (unless it has one) and send it to the service, so the plan's record shows that plan's arena.
    Best effort: a failure is logged and the plan keeps the placement of the profiled iteration (the training
    job goes on).

    Recorded here, on a CPU copy of the job, only where it is needed before the job runs or cheap and no
    step of the job will be metered: the planned arena (`arena`) places the runtime's buffers from it; a job
    that trains on the CPU with no feedback monitor. With `metered` (a feedback monitor will meter a step
    of the job on PyTorch's allocator) nothing is recorded here: that step is the managed iteration, and
    `agent.allocator.managed_step` records, places and sends it (CPU or CUDA), with no copy of the model.
    A CUDA job on the caching allocator with no monitor is not recorded: it would pay a host copy of its
    model and optimizer and three CPU iterations for a chart (its plan's record keeps the profiled
    iteration's arena, labelled so). Nor is a multi-rank plan with sharded chunks (issue 20): the recording
    runs one process, which cannot hold a chunk sharded across the job's ranks."""
    if has_managed_allocation(source.plan) or source.origin == "given":
        return source
    if not arena and (metered or planned_cuda_device(model, options) is not None):
        return source
    policy = source.plan.policy
    if policy is not None and any(c.sharded for c in policy.chunks):
        # the recording runs the job in this one process; a sharded chunk needs the ranks it is sharded across
        log.info(
            "memplan: the managed iteration of a plan with chunks sharded across %d ranks is not recorded "
            "(the recording runs one process); the plan keeps the allocation of the profiled iteration",
            policy.world_size,
        )
        return source
    if sample_batch is None:
        return source
    try:
        events = record_managed_trace(
            model, optimizer, source.plan, sample_batch, loss_fn=loss_fn, options=options, arena=arena
        )
        return place_and_publish(source, events)
    except Exception as exc:  # noqa: BLE001 - an extra the job does not need must not stop it
        log.warning(
            "memplan: the managed iteration could not be recorded (%s: %s); the plan keeps the allocation "
            "of the profiled iteration",
            type(exc).__name__,
            exc,
        )
        return source


def plan_with_allocation(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    sample_batch: Any,
    *,
    path: str | Path | None = None,
    loss_fn: Any = None,
    options: RuntimeOptions | None = None,
    blocks: Any = None,
    **obtain_kwargs: Any,
) -> Plan:
    """A plan for the job (history, service or in-process, as `wrap` gets one) with the allocation of its
    managed iteration, saved as JSON at `path` if given: what `install_allocator` needs. It may initialise
    CUDA (it profiles on the GPU): run it before the training script, or in another process."""

    source = obtain_plan(
        model, optimizer, sample_batch, loss_fn=loss_fn, options=options, blocks=blocks, **obtain_kwargs
    )
    if not has_managed_allocation(source.plan):
        events = record_managed_trace(
            model, optimizer, source.plan, sample_batch, loss_fn=loss_fn, options=options
        )
        source = place_and_publish(source, events)
    plan = source.plan
    if path is not None:
        Path(path).write_text(plan.model_dump_json())
    return plan


def load_plan(plan: Plan | str | Path | Mapping[str, Any]) -> Plan:
    """A Plan, one read from a JSON file (a Plan, or a plan record whose `plan` field is one, as `memplan plans
    solve -o` and `plan_with_allocation(path=)` write), or one from a dict of the plan's JSON. Anything else,
    or a document that is no plan, is one ValueError (TypeError for another type) naming `plan`."""

    if isinstance(plan, Plan):
        return plan
    if isinstance(plan, Mapping):
        where, data = "the dict given", dict(plan)
    elif isinstance(plan, (str, Path)):
        path = Path(plan)
        where = str(path)
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"plan: cannot read a plan from {path} ({type(exc).__name__}: {exc})") from exc
    else:
        raise TypeError(
            f"plan: must be a Plan, a path to a plan's JSON or a dict of it, got {type(plan).__name__}"
        )
    if isinstance(data, dict) and "plan" in data and "trace_hash" not in data:
        data = data["plan"]
    try:
        return Plan.model_validate(data)
    except ValidationError as exc:
        kind = " (it looks like a trace)" if isinstance(data, dict) and "measurements" in data else ""
        raise ValueError(
            f"plan: {where} is not a plan{kind}: {exc.error_count()} invalid field(s), first "
            f"{first_problem(exc, '<root>')}"
        ) from None


def install_allocator(
    plan: Plan | str | Path | Mapping[str, Any], *, device: int = 0, debug: bool = False, **rules: Any
) -> CudaPlannedAllocator:
    """Make the planned allocator PyTorch's CUDA allocator, from a plan that carries its managed allocation
    (`plan_with_allocation`). Call it first thing in the training script, before any CUDA tensor exists.
    Raises AllocatorSwitchError (CUDA already initialised, installed twice, no GPU) or ValueError naming the
    field the plan lacks."""
    p = load_plan(plan)
    a = p.allocation
    if a is None:
        raise ValueError("plan.allocation: absent; save the plan with agent.plan_with_allocation(...)")
    if a.events is None:
        raise ValueError(
            "plan.allocation.events: absent (a plan from before allocations carried their events); save the "
            "plan again with agent.plan_with_allocation(...)"
        )
    if a.iteration != "managed":
        log.warning(
            "memplan: plan.allocation places the profiled (un-managed) iteration, not the iteration this plan "
            "runs; the allocator will fall back often. Save it with agent.plan_with_allocation(...)"
        )
    handle = cuda_allocator.install_cuda_planned_allocator(  # module attribute: tests replace it
        a, a.events.events, device=device, debug=debug, rules=MatchRules(**rules)
    )
    handle.plan_key = plan_key(p)
    return handle
