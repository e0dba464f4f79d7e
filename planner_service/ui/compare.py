"""View model of the compare page: two or more plans side by side, section by section, row by row.

Each row is one quantity (a limit, a prediction, the latest measurement and its error, a figure of the solver's
report, one chunk's placement, one block's activation mode, the hardware and workload) with one formatted
value per plan and whether the values differ; "differences only" keeps the rows that differ. Values are compared
as shown (formatted), so two predictions equal to the displayed precision count as equal.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from client.contract import FeedbackRecord, Plan, PlanRecord, Predictions
from client.units import format_bytes
from planner_service.ui.views import error_class, format_error, format_optional_bytes, format_seconds

MISSING = "—"


@dataclass(frozen=True)
class CompareRow:
    label: str
    values: list[str]
    css: list[str]  # a class per value (the error bands for measured errors, else "")

    @property
    def differs(self) -> bool:
        return len(set(self.values)) > 1


@dataclass(frozen=True)
class CompareSection:
    title: str
    rows: list[CompareRow]

    def shown(self, differences_only: bool) -> list[CompareRow]:
        return [r for r in self.rows if r.differs] if differences_only else self.rows


@dataclass(frozen=True)
class ComparePage:
    records: list[PlanRecord]
    sections: list[CompareSection]
    differences_only: bool

    @property
    def n_different(self) -> int:
        return sum(r.differs for s in self.sections for r in s.rows)


def _row(records: list[PlanRecord], label: str, value: Callable[[PlanRecord], str]) -> CompareRow:
    values = [value(r) for r in records]
    return CompareRow(label, values, [""] * len(values))


def _error_row(
    records: list[PlanRecord], label: str, error: Callable[[PlanRecord], float | None]
) -> CompareRow:
    errors = [error(r) for r in records]
    return CompareRow(label, [format_error(e) for e in errors], [error_class(e) for e in errors])


def _latest(r: PlanRecord) -> FeedbackRecord | None:
    return r.feedback[-1] if r.feedback else None


def _plan_value(r: PlanRecord, get: Callable[[Plan], str]) -> str:
    return MISSING if r.plan is None else get(r.plan)


def _job(records: list[PlanRecord]) -> CompareSection:
    return CompareSection(
        "Plan, hardware and workload",
        [
            _row(records, "model", lambda r: f"{r.model_name} ({r.model_fingerprint[:12]})"),
            _row(records, "hardware", lambda r: r.hardware_key),
            _row(records, "workload", lambda r: r.workload_key),
            _row(records, "trace", lambda r: r.trace_id),
            _row(records, "status", lambda r: r.status.value),
            _row(records, "objective", lambda r: r.objective.value),
            _row(records, "created (UTC)", lambda r: r.created_at.strftime("%Y-%m-%d %H:%M:%S")),
        ],
    )


def _limits(records: list[PlanRecord]) -> CompareSection:
    return CompareSection(
        "Limits",
        [
            _row(records, "device memory", lambda r: format_bytes(r.constraints.device_memory_bytes)),
            _row(
                records,
                "host memory",
                lambda r: (
                    format_optional_bytes(r.constraints.host_memory_bytes) + " (unset: the trace's)"
                    if r.constraints.host_memory_bytes is None
                    else format_bytes(r.constraints.host_memory_bytes)
                ),
            ),
            _row(
                records, "pinned memory", lambda r: format_optional_bytes(r.constraints.pinned_memory_bytes)
            ),
            _row(records, "solver time limit", lambda r: format_seconds(r.constraints.time_limit_s)),
        ],
    )


def _predicted(get: Callable[[Predictions], str]) -> Callable[[PlanRecord], str]:
    def value(r: PlanRecord) -> str:
        return MISSING if r.plan is None or r.plan.predictions is None else get(r.plan.predictions)

    return value


def _predictions(records: list[PlanRecord]) -> CompareSection:
    return CompareSection(
        "Predictions",
        [
            _row(records, "iteration", _predicted(lambda p: format_seconds(p.iteration_s))),
            _row(records, "forward", _predicted(lambda p: format_seconds(p.forward_s))),
            _row(records, "backward", _predicted(lambda p: format_seconds(p.backward_s))),
            _row(records, "device optimizer", _predicted(lambda p: format_seconds(p.device_optimizer_s))),
            _row(records, "host optimizer", _predicted(lambda p: format_seconds(p.host_optimizer_s))),
            _row(records, "peak device memory", _predicted(lambda p: format_bytes(p.peak_device_bytes))),
            _row(records, "peak host memory", _predicted(lambda p: format_bytes(p.peak_host_bytes))),
        ],
    )


def _measured(records: list[PlanRecord]) -> CompareSection:
    def fb(get: Callable[[FeedbackRecord], str]) -> Callable[[PlanRecord], str]:
        return lambda r: MISSING if (f := _latest(r)) is None else get(f)

    return CompareSection(
        "Measured (latest feedback)",
        [
            _row(records, "reports", lambda r: str(len(r.feedback))),
            _row(records, "iteration", fb(lambda f: format_seconds(f.feedback.iteration_s))),
            _error_row(records, "iteration error", lambda r: r.iteration_error),
            _row(records, "peak device memory", fb(lambda f: format_bytes(f.feedback.peak_device_bytes))),
            _error_row(records, "peak device error", lambda r: r.peak_device_error),
            _row(records, "peak host memory", fb(lambda f: format_bytes(f.feedback.peak_host_bytes))),
            _row(records, "notes", fb(lambda f: f.feedback.notes or MISSING)),
        ],
    )


def _solver(records: list[PlanRecord]) -> CompareSection:
    def rep(get: Callable[[Plan], str]) -> Callable[[PlanRecord], str]:
        return lambda r: _plan_value(r, get)

    return CompareSection(
        "Solver evidence",
        [
            _row(records, "solver", lambda r: r.solver),
            _row(records, "version", rep(lambda p: p.solver.solver_version)),
            _row(records, "status", rep(lambda p: p.solver.status.value)),
            _row(
                records, "objective (predicted iteration)", rep(lambda p: format_seconds(p.solver.objective))
            ),
            _row(records, "best bound", rep(lambda p: format_seconds(p.solver.best_bound))),
            _row(
                records,
                "gap",
                rep(lambda p: MISSING if p.solver.gap is None else f"{p.solver.gap * 100:.2f}%"),
            ),
            _row(records, "solve time", rep(lambda p: format_seconds(p.solver.solve_s))),
            _row(
                records,
                "smallest device memory that fits",
                rep(lambda p: format_optional_bytes(p.solver.min_device_memory_bytes)),
            ),
            _row(records, "message", rep(lambda p: p.solver.message or MISSING)),
            _row(
                records,
                "allocation arena",
                rep(lambda p: MISSING if p.allocation is None else format_bytes(p.allocation.arena_bytes)),
            ),
        ],
    )


def _chunks(records: list[PlanRecord]) -> CompareSection:
    """The chunk size and buffers, then one row per chunk index (its placement and blocks)."""
    plans = [r.plan for r in records]
    rows = [
        _row(
            records,
            "chunk size",
            lambda r: _plan_value(
                r, lambda p: MISSING if p.policy is None else format_bytes(p.policy.chunk_size_bytes)
            ),
        ),
        _row(
            records,
            "device buffers",
            lambda r: _plan_value(r, lambda p: MISSING if p.policy is None else str(p.policy.n_buffers)),
        ),
    ]
    n = max((len(p.policy.chunks) for p in plans if p is not None and p.policy is not None), default=0)
    for i in range(n):
        values = []
        for p in plans:
            if p is None or p.policy is None or i >= len(p.policy.chunks):
                values.append(MISSING)
            else:
                c = p.policy.chunks[i]
                span = f"blocks {min(c.blocks)}–{max(c.blocks)}" if c.blocks else "no blocks"
                values.append(f"{c.placement.value} ({span})")
        rows.append(CompareRow(f"chunk {i}", values, [""] * len(values)))
    return CompareSection("Chunks", rows)


def _blocks(records: list[PlanRecord]) -> CompareSection:
    """One row per block: its activation mode in each plan."""
    plans = [r.plan for r in records]
    n = max((len(p.policy.blocks) for p in plans if p is not None and p.policy is not None), default=0)
    rows = []
    for i in range(n):
        values = []
        module = ""
        for p in plans:
            if p is None or p.policy is None or i >= len(p.policy.blocks):
                values.append(MISSING)
            else:
                b = p.policy.blocks[i]
                module = module or b.module
                values.append(b.mode.value)
        rows.append(CompareRow(f"block {i} ({module})", values, [""] * len(values)))
    return CompareSection("Block modes", rows)


def compare_page(records: list[PlanRecord], differences_only: bool) -> ComparePage:
    sections = [
        _job(records),
        _limits(records),
        _predictions(records),
        _measured(records),
        _solver(records),
        _chunks(records),
        _blocks(records),
    ]
    return ComparePage(records=records, sections=sections, differences_only=differences_only)
