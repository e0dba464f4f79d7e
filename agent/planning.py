"""Getting a plan for a job inside `agent.wrap`: reuse one from history, ask the service, or solve in-process.

Order of `obtain_plan` (the training job comes first: nothing here may crash or stall it):
1. with a server (argument or `MEMPLAN_SERVER`): look in the service's history for a finished plan of
   the same model fingerprint, hardware key and workload key under the same limits, and reuse it at
   once (no profiling, no solve; `reuse=False` skips this);
2. otherwise profile the job (`agent.profile`, one real iteration and its measurements);
3. with a server: upload the trace, request a plan, wait for it with a progress indicator (at most
   `wait_s`); without one, or when the service is down, errors or is slower than `wait_s`: solve
   in-process with the same solver the service runs (`planner_service.solver.solve`), saying so once
   in the log. Every exchange with the service shares one total budget (`service_budget_s`, see
   `service_call.py`), so a server that trickles bytes or hangs cannot stall the job. Only the service's
   failures lead to the fallback (down or busy: a warning; an answer the agent did not expect, such as a
   4xx: an ERROR); a bug in the agent's own code is raised, never reported as "service down".
An infeasible answer is an error (`PlanInfeasibleError`) that says how much device memory would fit.
"""

from __future__ import annotations

import itertools
import logging
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn

import agent
from agent.group_profiling import profile_on_every_rank
from agent.profiler import parameters  # module attribute: tests replace parameters.fingerprint
from agent.profiler.hardware import host_memory_bytes, in_group, probe_hardware
from agent.profiler.lockstep import meetings
from agent.profiler.optimizer_probe import optimizer_kind
from agent.profiler.profiling import _PRECISION, REPEATS, _batch_shape, _majority_dtype
from agent.runtime.activations import ActivationPlanError, block_targets
from agent.runtime.device import element_size
from agent.runtime.layout import ChunkLayout, PlanMismatchError
from agent.runtime.options import RuntimeOptions, job_trace
from agent.service_call import ServiceBudget, classify
from client.contract import Constraints, Plan, PlanStatus, SolverStatus, Trace, Workload
from client.errors import AuthenticationError, NotFoundError, PermissionDeniedError, service_root
from client.sdk import Client

if TYPE_CHECKING:
    from agent.runtime.process_group import RankGroup
    from client.contract import Distributed, Hardware

log = logging.getLogger(__name__)

Origin = Literal["given", "history", "service", "embedded", "fallback"]
DEFAULT_WAIT_S = 120.0
SERVICE_BUDGET_MARGIN_S = 15.0
"""Default total budget of the service path: the solve wait plus this (history look-up, upload, request)."""


class PlanInfeasibleError(RuntimeError):
    """No memory policy fits the limits; the message says the smallest device memory that would (or at most
    how much, when the solver did not prove that minimum)."""


@dataclass
class PlanSource:
    """A plan and where it came from."""

    plan: Plan
    origin: Origin
    plan_id: str | None = None  # the service's id (history or service), for feedback
    trace: Trace | None = None
    server: str | None = None
    message: str = ""
    profiled_iteration_s: tuple[float, ...] = ()
    """Each rank's profiled iteration (s), rank order (one entry for a single process; empty: not profiled,
    a plan given or from history). Under a group the trace is the largest batch's, then the slowest of them
    (`group_profiling`)."""


def server_url(server: str | None) -> str | None:
    """The server to use: the argument, else `MEMPLAN_SERVER`, else None (embedded)."""
    return server or os.environ.get("MEMPLAN_SERVER") or None


def workload_key(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    sample_batch: Any,
    *,
    clips_gradients: bool = False,
    shape: tuple[int, int] | None = None,
) -> str:
    """`Workload.key` of the job, computed without profiling (batch shape, precision, optimizer kind, clipping).
    `shape`: the job's (rows, sequence length) where it is not `sample_batch`'s (several ranks: the largest)."""

    params = list(model.parameters())
    dtype = _majority_dtype(params)
    if dtype not in _PRECISION:
        raise ValueError(f"model: parameters of dtype {dtype} are not fp32, bf16 or fp16")
    batch, seq = shape if shape is not None else _batch_shape(sample_batch)
    w = Workload(
        batch_size=batch,
        sequence_length=seq,
        precision=_PRECISION[dtype],
        optimizer=optimizer_kind(optimizer),
        optimizer_state_bytes_per_param=0,
        gradient_bytes_per_param=params[0].element_size(),
        clips_gradients=clips_gradients,
    )
    return w.key


def _require_batch(sample_batch: Any) -> None:
    if sample_batch is None:
        raise ValueError(
            "sample_batch: needed to profile the job when no plan= is given (one batch of the "
            "training data, as the model takes it)"
        )


def _planning_device(model: nn.Module) -> torch.device:
    """Where the job is profiled and planned: its parameters' device, or the current CUDA device for a
    CPU model on a machine with one (the runtime places it there)."""
    params = list(model.parameters())
    if not params:
        raise ValueError("model: has no parameters")
    dev = params[0].device
    if dev.type == "cpu" and torch.cuda.is_available():
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def job_hardware(model: nn.Module, device_memory: int | None, distributed: Distributed | None) -> Hardware:
    """The hardware the job is planned for, as one rank of its group sees it (cached per process)."""
    return in_group(probe_hardware(_planning_device(model), device_memory), distributed)


def profile_job(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    sample_batch: Any,
    *,
    loss_fn: Any,
    blocks: Sequence[nn.Module] | None,
    device_memory: int | None,
    distributed: Distributed | None,
    lockstep: Callable[[], None] | None = None,
) -> Trace:
    """`agent.profile` of the job as `obtain_plan` plans it; under a group every rank runs this on its own
    model and batch (`group_profiling.profile_on_every_rank`), meeting the others at `lockstep` (the group's
    barrier) before each plain iteration."""
    _require_batch(sample_batch)
    dev = _planning_device(model)
    # The profiler needs the optimizer's parameters on the profiled device; a CPU model planned for CUDA
    # is profiled with a fresh AdamW there (the profiler moves the model and back).
    same_device = next(model.parameters()).device == dev
    return agent.profile(
        model,
        sample_batch,
        loss_fn=loss_fn,
        optimizer=optimizer if same_device else None,
        device=dev,
        blocks=blocks,
        device_memory_limit=device_memory,
        hardware=job_hardware(model, device_memory, distributed),
        distributed=distributed,
        lockstep=lockstep,
    )


def _constraints(
    hw: Hardware, device_memory: int | None, host_memory: int | None, time_limit_s: float
) -> Constraints:
    return Constraints(
        device_memory_bytes=device_memory or hw.device_memory_bytes,
        host_memory_bytes=host_memory,
        time_limit_s=time_limit_s,
    )


def _usable(plan: Plan | None) -> bool:
    return (
        plan is not None
        and plan.policy is not None
        and plan.solver.status in (SolverStatus.optimal, SolverStatus.feasible)
    )


def misfit(
    plan: Plan,
    model: nn.Module,
    options: RuntimeOptions | None,
    constraints: Constraints | None = None,
    *,
    world_size: int = 1,
    trace: Trace | None = None,
) -> str | None:
    """Why the service's `plan` cannot be applied to `model` (the `PlanMismatchError` or `ActivationPlanError`
    `wrap` would raise, buffers the job's limits cannot hold, a plan for another number of ranks or, given the
    `trace` it was asked for, for another number of blocks), else None. A plan from the service or its
    history is checked before it is used, and one that does not fit is a service failure (in-process solving
    instead): training never stops because of the service (session 9 QA: a finished plan for another model
    raised from `wrap`; session 19 probe: a plan with 64 GiB chunks for a 0.5 MB model died allocating them,
    and plans for 4 ranks, or with no blocks, were applied to a 2-rank job with no word)."""
    assert plan.policy is not None
    if plan.policy.world_size != world_size:
        return f"it was solved for {plan.policy.world_size} ranks; this job has {world_size}"
    if trace is not None and len(plan.policy.blocks) != len(trace.model.blocks):
        return f"it plans {len(plan.policy.blocks)} blocks; the trace it was asked for has {len(trace.model.blocks)}"
    dtype = (options.compute_dtype if options is not None else None) or next(model.parameters()).dtype
    try:
        layout = ChunkLayout.from_policy(plan.policy, model, dtype)
        block_targets(model, plan.policy)
    except (PlanMismatchError, ActivationPlanError) as exc:
        return f"{type(exc).__name__}: {exc}"
    if constraints is None:
        return None
    esize = element_size(dtype)
    # what the runtime allocates at once, before any training: the persistent chunks and the device buffers of
    # offloaded ones on the device; the offloaded chunks' copies on the host
    persistent = sum(c.shard_numel if c.sharded else layout.chunk_numel for c in layout.persistent)
    device = (persistent + (layout.n_buffers * layout.chunk_numel if layout.offloaded else 0)) * esize
    if device > constraints.device_memory_bytes:
        return (
            f"its {len(layout.persistent)} persistent chunks and {layout.n_buffers} buffers of "
            f"{plan.policy.chunk_size_bytes} bytes take {device} bytes of device memory, above the job's "
            f"{constraints.device_memory_bytes}"
        )
    host = len(layout.offloaded) * layout.chunk_numel * esize
    host_limit = constraints.host_memory_bytes or host_memory_bytes()
    if host > host_limit:
        return f"its {len(layout.offloaded)} offloaded chunks take {host} bytes of host memory, above {host_limit}"
    return None


HISTORY_PLANS = 1000
"""The most plans of this model and hardware the history look-up reads (newest first) for one with the job's
workload and limits."""


def find_in_history(
    client: Client, fingerprint: str, hardware_key: str, workload: str, constraints: Constraints
) -> tuple[str, Plan] | None:
    """The newest finished plan for this model, hardware and workload under the same limits, if any.
    Candidates are picked from the list's headlines; only a match's whole plan is fetched."""
    plans = client.list_plans(model=fingerprint, hardware=hardware_key, status=PlanStatus.done)
    for rec in itertools.islice(plans, HISTORY_PLANS):  # newest first: a long history is not read to its end
        same_limits = (
            rec.constraints.device_memory_bytes == constraints.device_memory_bytes
            and rec.constraints.host_memory_bytes == constraints.host_memory_bytes
        )
        solved = (
            rec.headline is not None
            and rec.headline.solver is not None
            and rec.headline.solver.status in (SolverStatus.optimal, SolverStatus.feasible)
        )
        if rec.model_fingerprint == fingerprint and rec.workload_key == workload and same_limits and solved:
            plan = client.get_plan(rec.id).plan
            if _usable(plan):
                assert plan is not None
                return rec.id, plan
    return None


def check_feasible(plan: Plan, constraints: Constraints) -> Plan:
    if _usable(plan):
        return plan
    fits = plan.solver.min_device_memory_text()  # "at most N" unless the solver proved N the minimum
    hint = f"; {fits}" if fits else ""
    raise PlanInfeasibleError(
        f"device_memory: no memory policy fits {constraints.device_memory_bytes} bytes of device memory "
        f"(solver status {plan.solver.status.value}){hint}. {plan.solver.message}".strip()
    )


def solve_embedded(trace: Trace, constraints: Constraints) -> Plan:
    """The service's solve, in-process: the same `solve_plan` its worker runs (policy, then allocation)."""
    # local import: the solver (ortools, numba) loads only when a job solves in-process
    from planner_service.solver.plan import solve_plan

    return solve_plan(trace, constraints)


def _wait_with_progress(client: Client, plan_id: str, wait_s: float) -> Any:
    """Long-poll the plan until it is final or `wait_s` passes; a spinner line on a terminal, else log lines."""
    deadline = time.monotonic() + wait_s
    spinner = "|/-\\"
    tty = sys.stderr.isatty()
    i = 0
    record = client.get_plan(plan_id)
    while not record.status.final:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        elapsed = wait_s - left
        if tty:
            sys.stderr.write(
                f"\rmemplan: waiting for plan {plan_id[:12]} ({record.status}) {spinner[i % 4]} {elapsed:4.0f}s"
            )
            sys.stderr.flush()
        else:
            log.info("memplan: waiting for plan %s (%s, %.0fs)", plan_id[:12], record.status, elapsed)
        i += 1
        asked = min(2.0, max(0.0, left))
        t0 = time.monotonic()
        record = client.get_plan(plan_id, wait_s=asked)
        # a server (or proxy) that answers at once instead of holding the poll: not in a tight loop (session 19
        # probe: 191 requests in 10 s), at most one poll per 0.5 s
        if not record.status.final and (pause := min(0.5, asked) - (time.monotonic() - t0)) > 0:
            time.sleep(pause)
    if tty:
        sys.stderr.write("\n")
    return record


def obtain_plan(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    sample_batch: Any,
    *,
    server: str | None = None,
    device_memory: int | None = None,
    host_memory: int | None = None,
    loss_fn: Any = None,
    time_limit_s: float = 10.0,
    wait_s: float = DEFAULT_WAIT_S,
    service_budget_s: float | None = None,
    reuse: bool = True,
    request_timeout_s: float = 10.0,
    options: RuntimeOptions | None = None,
    clips_gradients: bool = False,
    blocks: Sequence[nn.Module] | None = None,
    distributed: Distributed | None = None,
    group: RankGroup | None = None,
    job_batch: tuple[int, int] | None = None,
) -> PlanSource:
    """A plan for this job (see the module docstring for the order). Raises PlanInfeasibleError.

    `service_budget_s` (default `wait_s` + SERVICE_BUDGET_MARGIN_S): the total time every exchange with the
    service may take together (profiling and in-process solving are not counted). `distributed`: the job's
    process group as every rank measured it (`collectives.probe_for_planning`): the history look-up then
    asks for plans of this world size (the hardware key names it) and the profiled trace carries the group,
    so the plan is solved for every rank of the job. `group` (with `distributed`, on rank 0): the profiling is the group's (`group_profiling`): unless the
    history has the plan, every rank profiles its own model and batch at once (the others from
    `wrapping`'s wait for the plan), and the trace solved is the largest batch's (then the slowest rank's).
    `job_batch` (with `group`): the job's batch shape, the largest any rank gave (`check_same_job`), which the
    history look-up asks for instead of rank 0's own."""

    _require_batch(sample_batch)
    url = server_url(server)
    hw = job_hardware(model, device_memory, distributed)
    constraints = _constraints(hw, device_memory, host_memory, time_limit_s)
    ranks = distributed.world_size if distributed is not None else 1

    client: Client | None = None
    budget: ServiceBudget | None = None
    down: str | None = None  # why the service could not be used
    if url is not None:
        client = Client(url, timeout=request_timeout_s, max_retries=1)
        budget = ServiceBudget(
            service_budget_s if service_budget_s is not None else wait_s + SERVICE_BUDGET_MARGIN_S,
            client.close,
        )
    try:
        if client is not None and budget is not None and reuse:
            # the job's own keys are computed outside the service's except: a bug here is the agent's
            keys = (
                parameters.fingerprint(model),
                hw.key,
                workload_key(
                    model, optimizer, sample_batch, clips_gradients=clips_gradients, shape=job_batch
                ),
            )
            c = client
            try:
                found = budget.call(lambda: find_in_history(c, *keys, constraints), "history look-up")
            except Exception as exc:
                down = _service_failure(exc, url, "history look-up")
                client.close()
                client = None
                found = None
            wrong = (
                misfit(found[1], model, options, constraints, world_size=ranks) if found is not None else None
            )
            if wrong is not None:
                log.warning(
                    "memplan: plan %s in %s history does not fit this model (%s); this is a defect, please "
                    "report it; profiling and solving afresh",
                    found[0][:12] if found is not None else "",
                    url,
                    wrong,
                )
            elif found is not None:
                plan_id, plan = found
                return PlanSource(
                    plan,
                    "history",
                    plan_id=plan_id,
                    server=url,
                    message=f"reused plan {plan_id[:12]} from {url} history",
                )

        def run(lockstep: Callable[[], None] | None = None) -> Trace:
            return profile_job(
                model,
                optimizer,
                sample_batch,
                loss_fn=loss_fn,
                blocks=blocks,
                device_memory=device_memory,
                distributed=distributed,
                lockstep=lockstep,
            )

        if group is None:
            trace = run()
            profiled_s: tuple[float, ...] = (trace.measurements.iteration_s,)
        else:  # every rank profiles its own model at once; the job's trace is the largest batch's
            # `prepare`: the hardware rank 0 measured above
            job = profile_on_every_rank(group, run, meetings(REPEATS), prepare=lambda: hw)
            assert job is not None  # rank 0 (the only rank that obtains the plan) holds the job's trace
            trace, profiled_s = job.trace, job.iteration_s
        # what the runtime adds to the plain job (fp32 master, undo backups, clipping): see RuntimeOptions
        trace = job_trace(trace, options, clips_gradients=clips_gradients)
        if client is not None and budget is not None:
            c = client
            try:
                record = budget.call(
                    lambda: _request_and_wait(c, trace, constraints, min(wait_s, budget.left())),
                    "upload, request and wait",
                )
                wrong = (
                    misfit(record.plan, model, options, constraints, world_size=ranks, trace=trace)
                    if record.status is PlanStatus.done and record.plan is not None and _usable(record.plan)
                    else None
                )
                if wrong is not None:
                    reason = f"plan {record.id[:12]} does not fit this model ({wrong}); this is a defect, please report it"
                    log.warning("memplan: %s from %s; solving in-process instead", reason, url)
                elif record.status is PlanStatus.done and _usable(record.plan):
                    return PlanSource(
                        record.plan,
                        "service",
                        plan_id=record.id,
                        trace=trace,
                        profiled_iteration_s=profiled_s,
                        server=url,
                        message=f"plan {record.id[:12]} from {url}" + (" (reused)" if record.reused else ""),
                    )
                else:
                    # (infeasible too: the in-process solver confirms it, or finds the plan a stale, faulty or
                    # other-version service missed; only its own answer stops the job)
                    reason = (
                        f"plan {record.id[:12]} is done with no usable policy"
                        + (f" (solver status {record.plan.solver.status})" if record.plan is not None else "")
                        if record.status is PlanStatus.done
                        else f"plan {record.id[:12]} is {record.status} after {wait_s:.0f}s"
                    ) + (f": {record.error}" if record.error else "")
                    log.warning("memplan: no plan from %s (%s); solving in-process instead", url, reason)
            except Exception as exc:
                reason = _service_failure(exc, url, "plan request")
            plan = check_feasible(solve_embedded(trace, constraints), constraints)
            return PlanSource(
                plan,
                "fallback",
                trace=trace,
                profiled_iteration_s=profiled_s,
                server=url,
                message=f"solved in-process (service {url}: {reason})",
            )
        plan = check_feasible(solve_embedded(trace, constraints), constraints)
        if down is not None:
            return PlanSource(
                plan,
                "fallback",
                trace=trace,
                profiled_iteration_s=profiled_s,
                server=url,
                message=f"solved in-process (service {url}: {down})",
            )
        return PlanSource(
            plan,
            "embedded",
            trace=trace,
            profiled_iteration_s=profiled_s,
            message="solved in-process (embedded)",
        )
    finally:
        if client is not None:
            client.close()


def _request_and_wait(client: Client, trace: Trace, constraints: Constraints, wait_s: float) -> Any:
    created = client.upload_trace(trace)
    record = client.request_plan(created.id, constraints)
    return _wait_with_progress(client, record.id, wait_s)


def _service_failure(exc: Exception, url: str | None, what: str) -> str:
    """Log why the service could not give a plan (once) and return the reason; re-raise the agent's own bugs.

    Down or busy (connection, timeout, budget, 5xx, 429): a warning. Any other answer (a 4xx: the service
    rejected the agent's request; a response that does not validate): an ERROR with the reason, since it
    is a defect on one side or the other (unless it is the user's setting: `_setting_to_fix`), but the job still
    gets a plan in-process."""
    kind = classify(exc)
    if kind is None:
        raise exc
    reason = f"{type(exc).__name__}: {exc}"
    if kind == "down":
        log.warning(
            "memplan: service %s unavailable during %s (%s); solving in-process instead", url, what, reason
        )
    elif (advice := _setting_to_fix(exc, url)) is not None:
        log.error(
            "memplan: service %s refused the agent's %s (%s): %s; solving in-process instead",
            url,
            what,
            reason,
            advice,
        )
    else:
        log.error(
            "memplan: service %s rejected the agent's %s (%s); this is a defect, please report it; "
            "solving in-process instead",
            url,
            what,
            reason,
        )
    return reason


def _setting_to_fix(exc: Exception, url: str | None) -> str | None:
    """What the user should change when a 4xx comes from their settings, not from a defect: a missing or
    wrong token (401/403), or a URL that is not the service's root (a 404 no memplan route gave: memplan's
    own 404s name the plan or trace: `NotFoundError.no_such_route`)."""
    if isinstance(exc, (AuthenticationError, PermissionDeniedError)):
        return (
            "set MEMPLAN_TOKEN to a token of the service's project (`memplan tokens create --project NAME` "
            "on the service's host)"
        )
    if isinstance(exc, NotFoundError) and exc.no_such_route:
        return f"no memplan API at {url}; give the service's root URL (e.g. {service_root(url or '')})"
    return None
