"""Pick and compute what a plan page's device-memory chart shows, from the best data the plan has.

In order of preference:
1. `timeline`: the solver's predicted `Plan.predictions.device_memory_timeline` (bytes per step).
2. `allocation`: the live bytes over the iteration the plan's allocation places (long-lived buffers
   counted at every time): the plan's own managed iteration (`allocation.iteration == "managed"`, its
   events carried by the plan: one iteration run under this plan, sent by the agent), else the trace's
   profiled `allocation_trace`; the arena the allocation planner reserved is drawn as a reference line,
   labelled with whose iteration it places.
3. `blocks`: per block, the predicted device memory while that block runs, from the plan's
   predictions breakdown (`static_device_bytes`: persistent chunks and buffers) plus the trace's
   per-block activation figures under the plan's activation mode. This is the same walk as the cost
   model's peak estimate (planner_service/solver/cost_model.py, `activation_peak`), so the tallest bar
   equals `predictions.peak_device_bytes`.
4. `requirement`: an infeasible plan that knows the smallest device memory that would fit gets one
   bar of that size against the device limit.
Every chart gets reference lines at the device limit, the predicted peak and, when feedback exists,
the measured peak. When the plan has an allocation plan and the first chart is not already the
allocation one, the live-bytes chart comes second (`memory_charts`).
"""

from __future__ import annotations

import numpy as np

from client.contract import ActivationMode, AllocationTrace, DeviceType, Plan, Trace
from client.contract.trace import PHASES
from planner_service.ui.chart import Band, Bar, Marker, MemoryChart, Point, Segment

MAX_CURVE_POINTS = 800  # a live-bytes curve longer than this is reduced to bucket maxima (peaks survive)

_MODE_LABEL = {
    ActivationMode.keep: "keep",
    ActivationMode.checkpoint: "checkpoint",
    ActivationMode.swap: "swap",
}


def reference_markers(plan: Plan, measured_peak_bytes: int | None) -> list[Marker]:
    markers = [Marker("device limit", plan.constraints.device_memory_bytes, "limit")]
    if plan.predictions is not None:
        markers.append(Marker("predicted peak", plan.predictions.peak_device_bytes, "predicted"))
    if measured_peak_bytes is not None:
        markers.append(Marker("measured peak", measured_peak_bytes, "measured"))
    return markers


def allocation_events(plan: Plan, trace: Trace | None) -> AllocationTrace | None:
    """The events the plan's allocation places: its own (managed iteration, or any plan carrying them), else
    the trace's profiled allocation trace; None when the plan has no allocation or the events are unknown."""
    if plan.allocation is None:
        return None
    if plan.allocation.events is not None:
        return plan.allocation.events
    return trace.allocation_trace if trace is not None else None


def needs_trace(plan: Plan) -> bool:
    """Whether `memory_charts` reads the trace for this plan (so a page can skip parsing a large one)."""
    if plan.allocation is not None and plan.allocation.events is None:
        return True
    return (
        plan.predictions is not None
        and plan.policy is not None
        and not plan.predictions.device_memory_timeline
    )


def memory_chart(
    plan: Plan, trace: Trace | None, measured_peak_bytes: int | None = None
) -> MemoryChart | None:
    """The main chart of a plan page, or None when the plan predicts nothing to draw."""
    markers = reference_markers(plan, measured_peak_bytes)
    if plan.predictions is not None and plan.predictions.device_memory_timeline:
        return timeline_chart(plan, markers)
    events = allocation_events(plan, trace)
    if events is not None:
        return allocation_chart(events, [*markers, _arena(plan)])
    if plan.predictions is not None and plan.policy is not None and trace is not None:
        return block_chart(plan, trace, markers)
    if plan.solver.min_device_memory_bytes is not None:
        return requirement_chart(plan)
    return None


def memory_charts(
    plan: Plan, trace: Trace | None, measured_peak_bytes: int | None = None
) -> list[MemoryChart]:
    """The main chart, then the allocation trace's live bytes when the plan placed them and it is not the main."""
    main = memory_chart(plan, trace, measured_peak_bytes)
    charts = [] if main is None else [main]
    if (
        main is not None
        and main.source != "allocation"
        and (events := allocation_events(plan, trace)) is not None
    ):
        charts.append(allocation_chart(events, [reference_markers(plan, None)[0], _arena(plan)]))
    return charts


def _arena(plan: Plan) -> Marker:
    assert plan.allocation is not None
    return Marker(arena_label(plan), plan.allocation.arena_bytes, "arena")


def arena_label(plan: Plan) -> str:
    """Whose arena the plan's allocation is: this plan's (its managed iteration), or the profiled iteration's
    (placed at solve time, before the agent ran the plan: not the arena of a run under it)."""
    assert plan.allocation is not None
    if plan.allocation.iteration == "managed":
        return "arena of this plan's iteration"
    return "arena of the profiled iteration"


def requirement_chart(plan: Plan) -> MemoryChart:
    """Infeasible: the smallest device memory that would fit, as one bar under/over the device limit."""
    need = plan.solver.min_device_memory_bytes
    assert need is not None
    bar = Bar(
        0.0,
        (Segment(need, "seg-needed", "smallest device memory that fits"),),
        "the smallest device memory under which some policy fits",
    )
    return MemoryChart(
        source="requirement",
        title="Infeasible: device memory needed against the limit",
        x_label="no policy fits the device limit",
        bars=(bar,),
        x_ticks=False,
        markers=(reference_markers(plan, None)[0],),
        legend=(("seg-needed", "smallest device memory that fits"),),
    )


# ----------------------------------------------------------------------------------------- timeline
def timeline_chart(plan: Plan, markers: list[Marker]) -> MemoryChart:
    assert plan.predictions is not None
    timeline = plan.predictions.device_memory_timeline
    points = tuple(Point(float(i), p.device_bytes, p.label) for i, p in enumerate(timeline))
    bands: list[Band] = []
    start = 0
    for i in range(1, len(timeline) + 1):
        if i == len(timeline) or timeline[i].phase != timeline[start].phase:
            phase = timeline[start].phase
            bands.append(Band(start - 0.5, i - 0.5, phase, f"phase-{phase}"))
            start = i
    return MemoryChart(
        source="timeline",
        title="Predicted device memory over one iteration (solver timeline)",
        x_label="step of the iteration (forward, backward, optimizer)",
        points=points,
        bands=tuple(bands),
        markers=tuple(markers),
        legend=(("series", "predicted device memory in use"),),
    )


# --------------------------------------------------------------------------------------- allocation
def live_bytes(trace: AllocationTrace) -> np.ndarray:
    """Bytes live during each logical time step [t, t+1) of one iteration; long-lived buffers count always."""
    a = trace.arrays
    sizes = a.array("size_bytes").astype(np.int64)
    starts = a.array("alloc_index").astype(np.int64)
    stops = a.array("free_index").astype(np.int64)
    long_lived = stops < 0
    delta = np.zeros(trace.horizon + 1, dtype=np.int64)
    np.add.at(delta, starts[~long_lived], sizes[~long_lived])
    np.add.at(delta, stops[~long_lived], -sizes[~long_lived])
    return np.cumsum(delta[: trace.horizon]) + int(sizes[long_lived].sum())


def reduce_to_maxima(values: np.ndarray, max_points: int = MAX_CURVE_POINTS) -> tuple[np.ndarray, np.ndarray]:
    """(starts, maxima) of at most `max_points` equal buckets; the global maximum is always kept."""
    n = len(values)
    if n <= max_points:
        return np.arange(n), values
    starts = np.linspace(0, n, max_points, endpoint=False).astype(np.int64)
    starts = np.unique(starts)
    return starts, np.maximum.reduceat(values, starts)


def allocation_chart(trace: AllocationTrace, markers: list[Marker]) -> MemoryChart:
    """Live bytes of the profiled iteration as a step curve, with phase bands from the events' phases."""
    starts, maxima = reduce_to_maxima(live_bytes(trace))
    points = tuple(Point(float(t), int(v), f"t={int(t)}") for t, v in zip(starts, maxima, strict=True))
    a = trace.arrays
    alloc, phase = a.array("alloc_index"), a.array("phase")
    first = {PHASES[p].value: int(alloc[phase == p].min()) for p in np.unique(phase).tolist()}
    ordered = sorted(first.items(), key=lambda kv: kv[1])
    bands = tuple(
        Band(
            float(at),
            float(ordered[i + 1][1] if i + 1 < len(ordered) else trace.horizon),
            phase,
            f"phase-{phase}",
        )
        for i, (phase, at) in enumerate(ordered)
    )
    return MemoryChart(
        source="allocation",
        title="Live bytes over one profiled iteration (allocation trace)",
        x_label="logical time (allocation event index)",
        points=points,
        steps=True,
        bands=bands,
        markers=tuple(markers),
        legend=(("series", "live bytes (measured allocation trace)"),),
    )


# ------------------------------------------------------------------------------------------- blocks
def static_device_bytes(plan: Plan, activation_peak_bytes: int) -> int:
    """Model states and buffers on the device: the breakdown's figure, else peak minus activation peak."""
    assert plan.predictions is not None
    given = plan.predictions.breakdown.get("static_device_bytes")
    if given is not None:
        return int(given)
    return max(0, plan.predictions.peak_device_bytes - activation_peak_bytes)


def block_chart(plan: Plan, trace: Trace, markers: list[Marker]) -> MemoryChart:
    """Per block: static bytes + activations retained by earlier blocks + this block's own working set."""
    assert plan.policy is not None
    meas = trace.measurements.blocks
    modes = [b.mode for b in plan.policy.blocks]
    if len(modes) != len(meas):
        raise ValueError(f"policy.blocks: {len(modes)} entries, the trace has {len(meas)} blocks")
    # copies overlap compute on CUDA: `planner_service.solver.instance.copy_overlap_for` (not imported here: the
    # solver package loads OR-Tools)
    overlap = trace.hardware.device_type == DeviceType.cuda
    prefix = 0
    rows: list[tuple[int, int]] = []  # (retained before b, own working set of b)
    for b, mode in enumerate(modes):
        m = meas[b]
        if mode == ActivationMode.checkpoint:
            fwd_own = m.input_bytes + m.forward_transient_peak_bytes
            bwd_own = m.input_bytes + m.activation_bytes + m.backward_transient_peak_bytes
            retained = m.input_bytes
        else:
            fwd_own = m.activation_bytes + m.forward_transient_peak_bytes
            bwd_own = m.activation_bytes + m.backward_transient_peak_bytes
            retained = m.activation_bytes if mode == ActivationMode.keep else 0
        if b > 0 and modes[b - 1] == ActivationMode.swap:  # the previous block's activations come back first
            bwd_own += meas[b - 1].activation_bytes
            if overlap:  # and, where copies overlap compute, are still copied out during this block's forward
                fwd_own += meas[b - 1].activation_bytes
        own = max(fwd_own, bwd_own)
        rows.append((prefix, own))
        prefix += retained
    static = static_device_bytes(plan, max((p + o for p, o in rows), default=0))
    bars = tuple(
        Bar(
            float(b),
            (
                Segment(static, "seg-static", "model states and buffers"),
                Segment(before, "seg-retained", "activations kept by earlier blocks"),
                Segment(own, "seg-own", "this block's activations and transients"),
            ),
            f"block {b}: {trace.model.blocks[b].name} ({_MODE_LABEL[modes[b]]})",
        )
        for b, (before, own) in enumerate(rows)
    )
    return MemoryChart(
        source="blocks",
        title="Predicted device memory while each block runs (per-block estimate)",
        x_label="block (execution order)",
        bars=bars,
        markers=tuple(markers),
        legend=(
            ("seg-static", "model states + buffers"),
            ("seg-retained", "kept activations"),
            ("seg-own", "block working set"),
        ),
    )
