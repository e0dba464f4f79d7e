"""Answer a what-if question: does it fit on this hardware, which limit binds, how fast, what batch is the largest.

`answer` solves a (modelled or retargeted) trace with the planner's own solver (`planner_service.solver.solve`)
under the device memory of the catalogue entry and the host memory given (or the entry's typical host):
- it fits: the plan's predicted iteration time, tokens/s, peak device and host bytes;
- it does not: which limit binds (none is named when the solver found no answer within its time limit and
  proved nothing: `solver_status` "unknown"). Solved again with unlimited host memory: if that fits, host memory binds
  and the smallest host memory that fits is found by bisection (to 1%); if not, device memory binds and the
  solver's smallest device memory that fits is reported (under the given host, or, when even that is not
  enough, under unlimited host memory, and then both bind).
`largest_batch` doubles the batch while it fits, then bisects between the last fit and the first miss; every
batch tried is kept with its tokens/s.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Literal

from client.contract import CatalogEntry, Constraints, Plan, SolverStatus, Trace

UNLIMITED_HOST_BYTES = 2**50  # 1 PiB: "no host limit" for the solver
Binding = Literal["device", "host", "device+host"]


@dataclass
class Answer:
    """One question's answer (the JSON keys of `memplan whatif --json` are its fields)."""

    hardware: str
    batch: int
    seq: int
    dtype: str
    device_memory_bytes: int
    host_memory_bytes: int
    fits: bool
    binding: Binding | None
    min_device_memory_bytes: int | None
    min_host_memory_bytes: int | None
    peak_device_bytes: int | None
    peak_host_bytes: int | None
    iteration_s: float | None
    tokens_per_s: float | None
    unmanaged_peak_device_bytes: int
    solver_status: str
    plan_summary: dict[str, object] = field(default_factory=dict)
    source: str = "modelled"
    calibrated: bool = False
    calibration_traces: int = 0  # measured traces the factors were fitted to (0: uncalibrated)
    calibration_residual: float | None = None  # relative RMS error of their block times (None: uncalibrated)
    calibration_models: list[str] = field(default_factory=list)  # the models of those traces
    plan: Plan | None = field(default=None, repr=False)

    def to_json(self) -> dict[str, object]:
        out = {k: v for k, v in self.__dict__.items() if k != "plan"}
        return out


def _summary(plan: Plan) -> dict[str, object]:
    if plan.policy is None:
        return {"message": plan.solver.message}
    p = plan.policy
    offloaded = [c.index for c in p.chunks if c.placement.value == "offloaded"]
    return {
        "chunk_size_bytes": p.chunk_size_bytes,
        "chunks": len(p.chunks),
        "offloaded_chunks": len(offloaded),
        "n_buffers": p.n_buffers,
        "block_modes": p.mode_strip(),
        "solver_gap": plan.solver.gap,
    }


def _calibration_of(trace: Trace) -> tuple[bool, int, float | None, list[str]]:
    """(calibrated, from how many measured traces, their residual, their models) of a modelled trace's factors."""
    m = trace.modelled
    if m is None or not m.calibrated:
        return False, 0, None, []
    return (
        True,
        int(m.factors.get("calibration_traces", 0)),
        m.factors.get("calibration_residual"),
        list(m.calibration_models),
    )


def _fits(plan: Plan) -> bool:
    return (
        plan.solver.status in (SolverStatus.optimal, SolverStatus.feasible) and plan.predictions is not None
    )


def answer(
    trace: Trace,
    entry: CatalogEntry,
    *,
    host_memory_bytes: int | None = None,
    time_limit_s: float = 2.0,
    solve: Callable[..., Plan] | None = None,
) -> Answer:
    """Solve `trace` under `entry`'s device memory and the host limit; see the module docstring."""
    if solve is None:
        # local import: the solver (ortools) loads at the first answer, so `memplan whatif`'s module (which
        # imports this one) keeps `memplan --help` fast
        from planner_service.solver import solve as solve_default

        solve = solve_default
    device = entry.device_memory_bytes
    host = host_memory_bytes if host_memory_bytes is not None else trace.hardware.host_memory_bytes

    def plan_for(device_bytes: int, host_bytes: int) -> Plan:
        return solve(
            trace,
            Constraints(
                device_memory_bytes=device_bytes, host_memory_bytes=host_bytes, time_limit_s=time_limit_s
            ),
        )

    plan = plan_for(device, host)
    w = trace.workload
    calibrated, n_traces, residual, models = _calibration_of(trace)
    make = partial(
        Answer,
        hardware=entry.key,
        batch=w.batch_size,
        seq=w.sequence_length,
        dtype=w.precision.value,
        device_memory_bytes=device,
        host_memory_bytes=host,
        unmanaged_peak_device_bytes=trace.measurements.peak_device_bytes,
        source=trace.source,
        calibrated=calibrated,
        calibration_traces=n_traces,
        calibration_residual=residual,
        calibration_models=models,
    )
    if _fits(plan):
        pred = plan.predictions
        assert pred is not None
        return make(
            fits=True,
            binding=None,
            min_device_memory_bytes=None,
            min_host_memory_bytes=None,
            peak_device_bytes=pred.peak_device_bytes,
            peak_host_bytes=pred.peak_host_bytes,
            iteration_s=pred.iteration_s,
            # the job's tokens: every rank of a multi-rank job runs this batch (issue 20)
            tokens_per_s=trace.hardware.world_size * w.batch_size * w.sequence_length / pred.iteration_s
            if pred.iteration_s
            else None,
            solver_status=plan.solver.status.value,
            plan_summary=_summary(plan),
            plan=plan,
        )

    unlimited = plan_for(device, UNLIMITED_HOST_BYTES)
    binding: Binding | None
    min_device: int | None
    min_host: int | None = None
    if plan.solver.status == SolverStatus.unknown and not _fits(unlimited):
        binding, min_device = None, None  # no answer within the time limit: say so, do not guess a limit
    elif _fits(unlimited):
        binding = "host"
        min_device = None
        assert unlimited.predictions is not None
        min_host = _smallest_host(plan_for, device, host, unlimited.predictions.peak_host_bytes)
    else:
        min_device = plan.solver.min_device_memory_bytes
        binding = "device"
        if min_device is None:  # not even an arbitrarily large device fits this host: both bind
            binding = "device+host"
            min_device = unlimited.solver.min_device_memory_bytes
    return make(
        fits=False,
        binding=binding,
        min_device_memory_bytes=min_device,
        min_host_memory_bytes=min_host,
        peak_device_bytes=None,
        peak_host_bytes=None,
        iteration_s=None,
        tokens_per_s=None,
        solver_status=plan.solver.status.value,
        plan_summary=_summary(plan),
        plan=plan,
    )


def _smallest_host(plan_for: Callable[[int, int], Plan], device: int, lo: int, hi: int) -> int:
    """Smallest host limit in (lo, hi] under which a plan fits `device` (bisection to 1% of the answer).

    `hi` is the host use of the plan found without a host limit; if a plan does not fit under it (limits
    carry margins), it is doubled until one does."""
    hi = max(hi, lo + 1)
    while not _fits(plan_for(device, hi)) and hi < UNLIMITED_HOST_BYTES:
        lo, hi = hi, min(UNLIMITED_HOST_BYTES, hi * 2)
    while hi - lo > max(1, hi // 100):
        mid = (lo + hi) // 2
        if _fits(plan_for(device, mid)):
            hi = mid
        else:
            lo = mid
    return hi


@dataclass
class BatchSearch:
    """`--batch max`: every batch tried (in order) and the largest that fits (None: not even batch 1)."""

    tried: list[Answer]
    largest: Answer | None


def largest_batch(answer_at: Callable[[int], Answer], *, start: int = 1, limit: int = 65536) -> BatchSearch:
    """The largest batch b (1 <= b <= limit) with `answer_at(b).fits`, assuming fitting is monotone in b."""
    tried: list[Answer] = []

    def at(b: int) -> Answer:
        a = answer_at(b)
        tried.append(a)
        return a

    first = at(start)
    if not first.fits:
        return BatchSearch(tried, None)
    good, bad = first, None
    b = start
    while bad is None and b < limit:
        b = min(limit, b * 2)
        a = at(b)
        if a.fits:
            good = a
        else:
            bad = a
    if bad is not None:
        lo, hi = good.batch, bad.batch
        while hi - lo > 1:
            mid = (lo + hi) // 2
            a = at(mid)
            if a.fits:
                lo, good = mid, a
            else:
                hi = mid
    return BatchSearch(tried, good)


def tokens_per_s_str(a: Answer) -> str:
    return "-" if a.tokens_per_s is None or not math.isfinite(a.tokens_per_s) else f"{a.tokens_per_s:,.0f}"
