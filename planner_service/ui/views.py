"""View models of the plan page: mode strip, chunk row, predicted vs measured, solver report, formatting.

Plain data built from the wire contract (`PlanRecord`, `Plan`), so the templates only lay things out.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

from markupsafe import Markup
from pydantic import ValidationError

from client.contract import (
    ActivationMode,
    FeedbackRecord,
    Placement,
    Plan,
    PlanRecord,
    PlanStatus,
    Predictions,
    Trace,
)
from client.units import format_bytes
from planner_service.ui.chart import render_svg
from planner_service.ui.memory_series import memory_charts, needs_trace
from planner_service.ui.queries import StoredTrace

GOOD_ERROR, FAIR_ERROR = 0.10, 0.25  # |relative error| bands for colouring predicted vs measured

_LETTER = {ActivationMode.keep: "K", ActivationMode.checkpoint: "C", ActivationMode.swap: "S"}


def format_seconds(s: float | None) -> str:
    """0.0123 -> '12.3 ms'; None -> '—'."""
    if s is None:
        return "—"
    a = abs(s)
    if a >= 1.0 or a == 0.0:
        return f"{s:.3f} s"
    if a >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.1f} µs"


def format_error(e: float | None) -> str:
    """measured / predicted - 1 as a signed percentage: 0.052 -> '+5.2%'."""
    return "—" if e is None else f"{e * 100:+.1f}%"


def error_class(e: float | None) -> str:
    if e is None:
        return "err-none"
    a = abs(e)
    return "err-good" if a <= GOOD_ERROR else "err-fair" if a <= FAIR_ERROR else "err-bad"


def format_optional_bytes(n: int | float | None) -> str:
    return "—" if n is None else format_bytes(n)


# ------------------------------------------------------------------------------------- mode strip
@dataclass(frozen=True)
class ModeCell:
    block: int
    module: str
    mode: str
    letter: str

    @property
    def tooltip(self) -> str:
        return f"block {self.block}: {self.module} ({self.mode})"


def mode_cells(plan: Plan) -> list[ModeCell]:
    if plan.policy is None:
        return []
    return [ModeCell(b.block, b.module, b.mode.value, _LETTER[b.mode]) for b in plan.policy.blocks]


# ------------------------------------------------------------------------------------------ chunks
MAX_CHUNK_CELLS = 512  # more chunks than this are drawn as runs of equal placement


@dataclass(frozen=True)
class ChunkCell:
    """One chunk, or a run of consecutive chunks with the same placement (`first` to `last`)."""

    index: int
    last: int
    placement: str
    used_bytes: int
    capacity_bytes: int
    blocks: list[int]
    n_parameters: int

    @property
    def fill(self) -> float:
        return self.used_bytes / self.capacity_bytes if self.capacity_bytes else 0.0

    @property
    def tooltip(self) -> str:
        span = (
            "no blocks"
            if not self.blocks
            else (
                f"block {self.blocks[0]}"
                if self.blocks[0] == self.blocks[-1]
                else f"blocks {self.blocks[0]}–{self.blocks[-1]}"
            )
        )
        which = f"chunk {self.index}" if self.last == self.index else f"chunks {self.index}–{self.last}"
        return (
            f"{which}: {self.placement}, {format_bytes(self.used_bytes)} of "
            f"{format_bytes(self.capacity_bytes)} used, {self.n_parameters} parameters, {span}"
        )


def chunk_cells(plan: Plan, max_cells: int = MAX_CHUNK_CELLS) -> list[ChunkCell]:
    if plan.policy is None:
        return []
    size = plan.policy.chunk_size_bytes
    cells = [
        ChunkCell(
            c.index, c.index, c.placement.value, c.used_bytes, size, sorted(c.blocks), len(c.parameters)
        )
        for c in plan.policy.chunks
    ]
    if len(cells) <= max_cells:
        return cells
    runs: list[ChunkCell] = []
    for c in cells:
        prev = runs[-1] if runs else None
        if prev is not None and prev.placement == c.placement:
            runs[-1] = ChunkCell(
                prev.index,
                c.index,
                c.placement,
                prev.used_bytes + c.used_bytes,
                prev.capacity_bytes + c.capacity_bytes,
                sorted({*prev.blocks, *c.blocks}),
                prev.n_parameters + c.n_parameters,
            )
        else:
            runs.append(c)
    return runs


# --------------------------------------------------------------------------- predicted vs measured
@dataclass(frozen=True)
class Comparison:
    quantity: str
    predicted: str
    measured: str
    error: str
    css: str


def comparisons(plan: Plan, latest: FeedbackRecord | None) -> list[Comparison]:
    """Iteration time, peak device and peak host memory: predicted, measured (latest feedback), relative error."""
    p = plan.predictions
    if p is None:
        return []
    if latest is None:
        return [
            Comparison("iteration time", format_seconds(p.iteration_s), "—", "—", "err-none"),
            Comparison("peak device memory", format_bytes(p.peak_device_bytes), "—", "—", "err-none"),
            Comparison("peak host memory", format_bytes(p.peak_host_bytes), "—", "—", "err-none"),
        ]
    f = latest.feedback
    host_err = f.peak_host_bytes / p.peak_host_bytes - 1.0 if p.peak_host_bytes > 0 else None
    return [
        Comparison(
            "iteration time",
            format_seconds(p.iteration_s),
            format_seconds(f.iteration_s),
            format_error(latest.iteration_error),
            error_class(latest.iteration_error),
        ),
        Comparison(
            "peak device memory",
            format_bytes(p.peak_device_bytes),
            format_bytes(f.peak_device_bytes),
            format_error(latest.peak_device_error),
            error_class(latest.peak_device_error),
        ),
        Comparison(
            "peak host memory",
            format_bytes(p.peak_host_bytes),
            format_bytes(f.peak_host_bytes),
            format_error(host_err),
            error_class(host_err),
        ),
        *phase_comparisons(p, latest),
    ]


PHASE_LABELS = {
    "forward_s": "forward",
    "backward_s": "backward and the rest",
    "step_s": "optimizer.step()",
}


def phase_comparisons(p: Predictions, latest: FeedbackRecord) -> list[Comparison]:
    """The measured iteration by phase against `Predictions.phases`, and the chunk uploads per iteration (only
    where the feedback measured phases: agents before them did not)."""
    measured = latest.feedback.phases
    if measured is None:
        return []
    pairs = [
        (k, f"— {PHASE_LABELS[k]}", v, getattr(measured, k), format_seconds) for k, v in p.phases().items()
    ]
    if measured.uploads_per_iteration is not None and p.uploads_per_iteration is not None:
        pairs.append(
            (
                "uploads_per_iteration",
                "chunk uploads per iteration",
                p.uploads_per_iteration,
                measured.uploads_per_iteration,
                "{:g}".format,
            )
        )
    errors = measured.errors(p)
    rows = []
    for key, label, predicted, got, fmt in pairs:
        e = errors.get(key)
        rows.append(Comparison(label, fmt(predicted), fmt(got), format_error(e), error_class(e)))
    return rows


# ----------------------------------------------------------------------------------- solver report
def solver_rows(plan: Plan) -> list[tuple[str, str]]:
    r = plan.solver
    rows = [
        ("status", r.status.value),
        ("objective (predicted iteration)", format_seconds(r.objective)),
        ("best bound", format_seconds(r.best_bound)),
        ("gap", "—" if r.gap is None else f"{r.gap * 100:.2f}%"),
        ("solve time", format_seconds(r.solve_s)),
        ("solver", r.solver),
        ("solver version", r.solver_version),
    ]
    if r.min_device_memory_bytes is not None:
        rows.append(("smallest device memory that fits", format_bytes(r.min_device_memory_bytes)))
    rows.append(("message", r.message or "—"))
    return rows


def allocation_rows(plan: Plan) -> list[tuple[str, str]]:
    a = plan.allocation
    if a is None:
        return []
    placed = (
        "this plan's iteration (run under the plan by the agent)"
        if a.iteration == "managed"
        else "the profiled (un-managed) iteration: not yet a run under this plan"
    )
    return [
        ("iteration placed", placed),
        ("arena", format_bytes(a.arena_bytes)),
        ("lower bound (peak live bytes)", format_bytes(a.lower_bound_bytes)),
        ("gap", f"{a.gap * 100:.2f}%"),
        ("buffers placed", str(len(a.offsets))),
        ("alignment", format_bytes(a.alignment_bytes)),
        ("status", a.status.value),
        ("solver", a.solver),
        ("solve time", format_seconds(a.solve_s)),
    ]


# ------------------------------------------------------------------------------------------ the page
@dataclass(frozen=True)
class PlanPage:
    record: PlanRecord
    plan: Plan | None
    charts: list[tuple[str, Markup]]  # (title, svg)
    chart_note: str
    modes: list[ModeCell]
    chunks: list[ChunkCell]
    comparisons: list[Comparison]
    solver: list[tuple[str, str]]
    allocation: list[tuple[str, str]]
    latest_feedback: FeedbackRecord | None

    @property
    def mode_counts(self) -> dict[str, int]:
        out = {"keep": 0, "checkpoint": 0, "swap": 0}
        for c in self.modes:
            out[c.mode] += 1
        return out

    @property
    def chunk_counts(self) -> dict[str, int]:
        out = {Placement.persistent.value: 0, Placement.offloaded.value: 0}
        for c in self.chunks:
            out[c.placement] += c.last - c.index + 1
        return out


class ChartCache:
    """Rendered charts of finished plans, by (plan id, finish time, latest feedback id): LRU, thread-safe.

    A finished plan and its trace never change, so its charts only change with new feedback; caching them
    spares a page view the parse of a large trace (an allocation trace can hold millions of events).
    """

    def __init__(self, size: int = 64) -> None:
        self.size = size
        self._items: OrderedDict[tuple[str, ...], list[tuple[str, Markup]]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: tuple[str, ...]) -> list[tuple[str, Markup]] | None:
        with self._lock:
            found = self._items.get(key)
            if found is not None:
                self._items.move_to_end(key)
            return found

    def put(self, key: tuple[str, ...], charts: list[tuple[str, Markup]]) -> None:
        with self._lock:
            self._items[key] = charts
            self._items.move_to_end(key)
            while len(self._items) > self.size:
                self._items.popitem(last=False)


CHARTS = ChartCache()


def _charts(
    plan: Plan, stored: StoredTrace | None, measured_peak: int | None
) -> tuple[list[tuple[str, Markup]], str]:
    """The rendered charts and, when there are none, why (a plan that does not match its trace, no trace)."""
    trace: Trace | None = None
    problem = ""
    if needs_trace(plan) and stored is not None:
        try:
            trace = stored.parse()
        except (
            ValidationError,
            OSError,
            ValueError,
        ) as exc:  # e.g. stored by an older schema: page still renders
            problem = f"{type(exc).__name__}: {str(exc)[:300]}"
    try:
        found = memory_charts(plan, trace, measured_peak)
    except ValueError as exc:  # a plan that does not match its trace: say so, keep the rest of the page
        return [], f"No chart: {exc}"
    ids = ("memory-chart", "allocation-chart")
    charts = [(c.title, render_svg(c, element_id=ids[i])) for i, c in enumerate(found)]
    if charts:
        return charts, ""
    if plan.predictions is None:
        return [], f"No chart: the plan predicts no device memory (status {plan.solver.status.value})."
    return [], f"No chart: the plan has no timeline and its trace is unavailable ({problem or 'not stored'})."


def plan_page(record: PlanRecord, stored: StoredTrace | None, cache: ChartCache = CHARTS) -> PlanPage:
    plan = record.plan
    latest = record.feedback[-1] if record.feedback else None
    charts: list[tuple[str, Markup]] = []
    if plan is None:
        note = {
            PlanStatus.queued: "Queued: a worker has not picked this plan up yet.",
            PlanStatus.running: "Running: a worker is solving this plan.",
        }.get(record.status, "This plan has no result.")
    else:
        placed = plan.allocation.iteration if plan.allocation is not None else ""  # managed arrives later
        key = (record.id, str(record.finished_at), latest.id if latest else "", placed)
        cached = cache.get(key) if record.status.final else None
        if cached is not None:
            charts, note = cached, ""
        else:
            charts, note = _charts(plan, stored, latest.feedback.peak_device_bytes if latest else None)
            if charts and record.status.final:
                cache.put(key, charts)
    return PlanPage(
        record=record,
        plan=plan,
        charts=charts,
        chart_note=note,
        modes=mode_cells(plan) if plan else [],
        chunks=chunk_cells(plan) if plan else [],
        comparisons=comparisons(plan, latest) if plan else [],
        solver=solver_rows(plan) if plan else [],
        allocation=allocation_rows(plan) if plan else [],
        latest_feedback=latest,
    )
