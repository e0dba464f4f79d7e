"""Solver entry point: Trace + Constraints -> Plan with the fastest memory policy that fits, and its evidence.

`solve` tries every candidate chunk layout (the chunk-size grid, see `chunk_grid.py`), runs ProTrain's
4-knob search on each, and for `cpsat` (the default) solves the full decision with CP-SAT, hinted with
ProTrain's answer and cut off at the best time found so far. The plan reports the best answer, the
proven lower bound over all layouts, and the gap. When nothing fits it returns status infeasible with
the smallest device memory that would fit (never an exception). `Plan.allocation` is left None: the
allocation planner fills it (the service composes the two).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from client.contract import (
    ActivationMode,
    BlockPolicy,
    Chunk,
    Constraints,
    Placement,
    Plan,
    Policy,
    SolverReport,
    SolverStatus,
    Trace,
)
from planner_service.solver import cpsat_solve, protrain
from planner_service.solver.chunk_grid import ChunkGrid, candidate_layouts
from planner_service.solver.cost_model import Cost, evaluate_decision, predictions_of
from planner_service.solver.errors import PlanRequestRefused
from planner_service.solver.instance import (
    CostParams,
    Decision,
    Mode,
    PolicyInstance,
    alpha_for,
    build_instance,
    resolve_params,
)

# Bump whenever a change can alter a plan (cost model, model, search, defaults): the service dedups by it.
# 1.1: no copy/compute overlap on a CPU device (CostParams.copy_overlap)
# 1.2: on a CPU device, the runtime costs the profiler measures (swap, chunk runtime) replace/add to copy times
# 1.3: when the un-managed iteration fits the limit, the plan manages nothing (`_everything_fits`), and says so
# 1.4: persistent chunks may be sharded on the device (ZeRO-3); per-call host-step overhead; in-step collective
#      curves and the all-reduce curve (CPU); backward transients net of landed gradients; held tied gradients by
#      `ParameterInfo.use_blocks`
# 1.5: multi-rank jobs pay the runtime's control checks (`CollectiveCurves.control_s`); on a CPU device the
#      runtime probe's offload overhead includes optimizer.step()'s settling of a speculative step
# 1.6: the control checks at a phase's end cost the trace's `CollectiveCurves.phase_control_s` (on a CPU device:
#      after a phase's worth of compute, the ranks' skew over it included)
# 1.7: with offloaded and device-sharded chunks, one more device-shard agreement per iteration, at backward's
#      start (the runtime's check that every rank is in the same pass: a forward on some ranks only is an error)
# 1.8: off a serial (CPU) device, each offloaded chunk's host step also pays the runtime's host copies around it by
#      bytes (undo backup, exposed .grad, mixed-precision compute copy) at the trace's `host_copy_bytes_per_s`;
#      on a CPU device each gradient reduction pays the wait for the later rank after its chunk's backward
#      (`sharding.reduction_wait_ns`, from the trace's `control_s` and `phase_control_s`)
# 1.9: a tied chunk used again in a later window (`ParameterInfo.use_blocks`; GPT-2's lm_head) pays its re-upload
#      there and the upload again for backward of the chunk it displaces (`late_uses.py`); predictions say the
#      uploads per iteration (`uploads_per_iteration`)
# 1.10: an offloaded chunk with an fp32 master (a bf16 model) steps the master's bytes, 4 per element, not its
#      compute bytes (`bandwidth.host_stepped_bytes`; session 17, the first GPU run); where copies overlap compute,
#      a swapped block's activations count through the next block's forward too (its copy-out still reads them;
#      the runtime lets them go at that block's end: `SwapStore.settle_through`)
# 1.11: where copies overlap compute, optimizer.step()'s check of every offloaded chunk's exposed `.grad` against
#      the gradient its speculative host step used (`instance.validate_ns`, at the host copy rate) follows backward
#      and the device steps, the last check the worker's last step (session 18: 11-15 ms of step() on an H200,
#      found with `benchmarks/gpu_timeline.py`); the runtime checks the chunks in the order their steps finish
# 1.12: a multi-rank job's persistent chunks' gradient all-reduces follow backward, one after another, as the runtime
#      issues them (`GradientFlow.reduce_persistent`, on the training thread after the host worker's reductions);
#      the backward windows hold only the offloaded chunks' reductions (before, each persistent chunk's all-reduce
#      was hidden behind the next window's compute where copies overlap compute: a GPU's multi-rank plans with
#      persistent chunks were predicted faster than they run; on a CPU the same total, serially; session 24)
# 1.13: the runtime now averages each persistent chunk's gradient as backward completes it (`GradientFlow.
#      average_early`, on the host worker's offload stream on CUDA, as DDP's buckets overlap backward): the
#      backward windows hold every chunk's reduction again, as before 1.12 (session 25)
# 1.14: the agreement at backward's end on the entries with a gradient covers the offloaded chunks too, so it
#      runs in every multi-rank plan (before: only with a persistent chunk); an all-offloaded plan pays one
#      control check more (`cost_model.control_checks_ns`; session 26)
SOLVER_VERSION = "policy-1.14"
SOLVERS: tuple[str, ...] = ("cpsat", "protrain")

_ACTIVATION = {
    Mode.keep: ActivationMode.keep,
    Mode.checkpoint: ActivationMode.checkpoint,
    Mode.swap: ActivationMode.swap,
}


@dataclass(frozen=True)
class _Best:
    inst: PolicyInstance
    decision: Decision
    cost: Cost


def policy_of(trace: Trace, layout: ChunkGrid, decision: Decision) -> Policy:
    """The wire policy for a decision on a layout (chunk parameters in the trace's execution order)."""
    params = trace.model.parameters
    world = trace.hardware.world_size
    # a multi-rank decision without an explicit sharding shards its offloaded chunks (Decision.sharded_chunks)
    sharded = (decision.sharded or decision.offloaded) if world > 1 else (False,) * len(decision.offloaded)
    chunks = [
        Chunk(
            index=c,
            placement=Placement.offloaded if decision.offloaded[c] else Placement.persistent,
            parameters=[params[i].name for i in range(start, stop)],
            blocks=list(layout.chunk_blocks[c]),
            used_bytes=layout.used_bytes[c],
            sharded=sharded[c],
        )
        for c, (start, stop) in enumerate(layout.param_ranges)
    ]
    blocks = [
        BlockPolicy(block=b.index, module=b.name, mode=_ACTIVATION[decision.modes[b.index]])
        for b in trace.model.blocks
    ]
    return Policy(
        chunk_size_bytes=layout.chunk_size_bytes,
        chunks=chunks,
        n_buffers=decision.n_buffers,
        blocks=blocks,
        world_size=world,
    )


def _tightest_decision(inst: PolicyInstance) -> Decision:
    """The hint when ProTrain found nothing: every chunk offloaded through the fewest buffers the runtime accepts
    (one, unless a module spans chunks), every block checkpointed.

    Not necessarily feasible (CP-SAT treats a hint as a starting direction); it is the corner of the decision
    space with the least device memory short of swapping.
    """
    offloaded = (True,) * inst.n_chunks
    return Decision(
        offloaded=offloaded,
        n_buffers=inst.min_buffers(offloaded),
        modes=tuple(Mode.checkpoint if inst.optimisable[b] else Mode.keep for b in range(inst.n_blocks)),
    )


def _min_device_memory(
    trace: Trace,
    layouts: list[ChunkGrid],
    constraints: Constraints,
    params: CostParams,
    seed: int,
    budget_s: float,
) -> tuple[int | None, bool]:
    """Smallest device limit (bytes) under which some policy fits: min peak over layouts, times (1 + alpha);
    and whether it is proven the smallest (every layout's minimum proven, or the layout proven to fit nothing).
    Unproven, it is an upper bound: that limit fits, a smaller one may too."""
    best: int | None = None
    proven = True
    for i, lay in enumerate(layouts):
        inst = build_instance(trace, lay, constraints, params)
        peak, optimal = cpsat_solve.min_peak_bytes(
            inst, time_limit_s=max(0.05, budget_s / (len(layouts) - i)), seed=seed
        )
        proven = proven and optimal
        if peak is not None and (best is None or peak < best):
            best = peak
    if best is None:
        return None, False
    limit = math.ceil(best * (1.0 + params.alpha))
    while int(limit // (1.0 + params.alpha)) < best:  # match build_instance's floor exactly
        limit += 1
    return limit, proven


def _unmanaged_decision(inst: PolicyInstance) -> Decision:
    """Every chunk persistent (no buffers), every block keeps its activations: the iteration as measured."""
    return Decision(offloaded=(False,) * inst.n_chunks, n_buffers=0, modes=(Mode.keep,) * inst.n_blocks)


def _everything_fits(
    trace: Trace, layouts: list[ChunkGrid], constraints: Constraints, params: CostParams
) -> _Best | None:
    """On a device whose copies are serial with compute (a CPU device), when the measured un-managed peak is
    within the limit and the cost model (with its margin) agrees on some layout: the un-managed decision on the
    fastest such layout; else None (the search's answer stands).

    There, offloading, recompute or swap only trade time for memory; the cost model can still rank them faster
    where its host-side figures are optimistic (the host optimizer runs on the same cores as the "device"
    step), so when everything fits the answer is fixed. On a GPU, offloading without memory pressure can pay
    (the host step hides behind backward, ZeRO-Offload's point), so the search decides there. The search still runs, for its proven bound:
    the plan is `optimal` only when the un-managed answer is the cost model's optimum too, and its message
    says when the cost model would have preferred a managed policy."""
    if params.copy_overlap or trace.measurements.peak_device_bytes > constraints.device_memory_bytes:
        return (
            None  # on a GPU, offloading can pay without memory pressure (host steps hidden behind backward)
        )
    best: _Best | None = None
    for lay in layouts:
        inst = build_instance(trace, lay, constraints, params)
        decision = _unmanaged_decision(inst)
        cost = evaluate_decision(inst, decision)
        if cost.fits and (best is None or cost.iteration_ns < best.cost.iteration_ns):
            best = _Best(inst, decision, cost)
    return best


def solve(trace: Trace, constraints: Constraints, *, solver: str = "cpsat", seed: int = 0) -> Plan:
    """Fastest memory policy for `trace` under `constraints` (see the module docstring).

    CP-SAT stops once the answer is proven within `cpsat_solve.RELATIVE_GAP_LIMIT` (0.5%) of the optimum;
    the plan reports the proven bound and gap either way.
    """
    return solve_with_gap(
        trace, constraints, solver=solver, seed=seed, gap_limit=cpsat_solve.RELATIVE_GAP_LIMIT
    )


def solve_with_gap(
    trace: Trace, constraints: Constraints, *, solver: str, seed: int, gap_limit: float
) -> Plan:
    """`solve` with an explicit relative gap limit (0.0: prove exact optimality, as the tests demand)."""
    if solver not in SOLVERS:
        raise PlanRequestRefused(f"solver: unknown {solver!r}; choose one of {', '.join(SOLVERS)}")
    t0 = time.perf_counter()
    deadline = t0 + constraints.time_limit_s
    params = resolve_params(trace, CostParams(alpha=alpha_for(trace)))
    layouts = candidate_layouts(trace)
    fits = _everything_fits(trace, layouts, constraints, params)
    best: _Best | None = None
    bounds: list[float] = []
    statuses: list[str] = []
    by_size: list[tuple[int, str]] = []  # (chunk size, CP-SAT status) for the solver's message
    baselines: list[tuple[PolicyInstance, protrain.ProTrainResult]] = []
    for lay in layouts:
        inst = build_instance(trace, lay, constraints, params)
        base = protrain.search(inst)
        baselines.append((inst, base))
        if (
            base.decision is not None
            and base.cost is not None
            and (best is None or base.cost.iteration_ns < best.cost.iteration_ns)
        ):
            best = _Best(inst, base.decision, base.cost)
    if solver == "cpsat":
        # most promising layout first (ProTrain's time), so later layouts only need to prove "no faster"
        baselines.sort(key=lambda ib: ib[1].cost.iteration_ns if ib[1].cost is not None else 2**62)
    for i, (inst, base) in enumerate(baselines if solver == "cpsat" else []):
        budget = (deadline - time.perf_counter()) / (len(layouts) - i)
        # only an answer faster than the incumbent by more than the gap limit is worth finding
        # (the first layout holds the incumbent itself: it is solved without a cutoff, hinted with it)
        cutoff = (
            math.ceil(best.cost.iteration_ns * (1.0 - gap_limit)) if (best is not None and i > 0) else None
        )
        hint = base.decision if base.decision is not None else _tightest_decision(inst)
        res = cpsat_solve.solve_layout(
            inst, hint=hint, time_limit_s=budget, seed=seed, cutoff_ns=cutoff, gap_limit=gap_limit
        )
        statuses.append(res.status)
        by_size.append((inst.layout.chunk_size_bytes, res.status))
        bounds.append(res.lower_bound_ns)
        if (
            res.decision is not None
            and res.cost is not None
            and res.cost.fits
            and (best is None or res.cost.iteration_ns < best.cost.iteration_ns)
        ):
            best = _Best(inst, res.decision, res.cost)

    sizes = ", ".join(f"{lay.chunk_size_bytes >> 20}MiB" for lay in layouts)
    if best is None:
        all_proven = solver == "cpsat" and all(s == "infeasible" for s in statuses)
        remaining = max(0.5, deadline - time.perf_counter())
        min_bytes, min_proven = _min_device_memory(trace, layouts, constraints, params, seed, remaining)
        status = SolverStatus.infeasible if (all_proven or solver == "protrain") else SolverStatus.unknown
        smallest = (
            f"smallest device memory that fits: {min_bytes} bytes"
            if min_proven
            else f"smallest device memory that fits: at most {min_bytes} bytes (not proven smallest in the "
            "time given)"
            if min_bytes is not None
            else "no fitting device memory found in the time given"
        )
        host = constraints.host_memory_bytes or trace.hardware.host_memory_bytes
        given = "given" if constraints.host_memory_bytes else "the machine's"
        message = (
            f"nothing fits {constraints.device_memory_bytes} device bytes (alpha {params.alpha:.3f}) within the host "
            f"limit ({given} {host} bytes, which offloaded chunks must fit in); {smallest} (chunk sizes tried: "
            f"{sizes})"
            if status == SolverStatus.infeasible
            else f"no policy found within {constraints.time_limit_s}s ({_per_size(by_size)})"
        )
        return Plan(
            trace_hash=trace.content_hash(),
            constraints=constraints,
            policy=None,
            predictions=None,
            solver=SolverReport(
                solver=solver,
                solver_version=SOLVER_VERSION,
                status=status,
                solve_s=time.perf_counter() - t0,
                min_device_memory_bytes=min_bytes,
                min_device_memory_proven=min_proven if min_bytes is not None else None,
                message=message,
            ),
        )

    note = ""
    if fits is not None:  # the search still ran: its bound says how far the un-managed answer is from optimal
        searched_ns = best.cost.iteration_ns
        best = fits
        note = (
            f"everything fits: the un-managed peak {trace.measurements.peak_device_bytes} bytes is within the "
            f"{constraints.device_memory_bytes}-byte limit, so every chunk stays persistent on the device and "
            "every block keeps its activations (nothing offloaded, recomputed or swapped)"
        )
        if searched_ns < best.cost.iteration_ns:
            note += (
                f"; the cost model ranks a managed policy faster ({searched_ns / 1e9:.4g}s vs "
                f"{best.cost.iteration_ns / 1e9:.4g}s), not applied"
            )
        note += ". "
    objective_ns = best.cost.iteration_ns
    if solver == "cpsat":
        bound_ns = min(bounds) if bounds else 0.0
        bound_ns = min(bound_ns, float(objective_ns))
        gap = (objective_ns - bound_ns) / objective_ns if objective_ns > 0 else 0.0
        status = SolverStatus.optimal if gap <= 0.0 else SolverStatus.feasible
        best_bound: float | None = bound_ns / 1e9
        gap_out: float | None = max(0.0, gap)
    else:
        status, best_bound, gap_out = SolverStatus.feasible, None, None
    policy = policy_of(trace, best.inst.layout, best.decision)
    return Plan(
        trace_hash=trace.content_hash(),
        constraints=constraints,
        policy=policy,
        predictions=predictions_of(best.inst, best.decision, best.cost),
        solver=SolverReport(
            solver=solver,
            solver_version=SOLVER_VERSION,
            status=status,
            objective=objective_ns / 1e9,
            best_bound=best_bound,
            gap=gap_out,
            solve_s=time.perf_counter() - t0,
            message=f"{note}chunk size {best.inst.layout.chunk_size_bytes >> 20}MiB of {sizes} "
            f"({_per_size(by_size) if by_size else 'ProTrain search'}); alpha {params.alpha:.3f}; "
            f"copies {'overlap compute' if params.copy_overlap else 'serial with compute (cpu device)'}",
        ),
    )


def _per_size(by_size: list[tuple[int, str]]) -> str:
    """CP-SAT's answer for each chunk size tried, e.g. "CP-SAT 1MiB optimal, 32MiB infeasible"."""
    return "CP-SAT " + ", ".join(f"{size >> 20}MiB {status}" for size, status in sorted(by_size))
