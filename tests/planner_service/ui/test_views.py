"""Plan page view models: formatting, predicted vs measured, lazy trace parsing, the chart cache."""

from __future__ import annotations

import gzip
from datetime import UTC, datetime

import pytest

from client.contract import Constraints, Feedback, FeedbackRecord, MeasuredPhases, Plan, PlanRecord, Trace
from planner_service.solver import solve
from planner_service.solver.testing.synthetic import synthetic_trace
from planner_service.ui.queries import StoredTrace
from planner_service.ui.views import ChartCache, comparisons, format_error, format_seconds, plan_page

from .conftest import iteration_allocations

MiB = 2**20
NOW = datetime(2026, 1, 1, tzinfo=UTC)
GARBAGE = StoredTrace("0" * 64, b"not gzip")


@pytest.fixture(scope="module")
def trace() -> Trace:
    t = synthetic_trace(n_blocks=4, hidden=256, vocab=1000, batch=2, seq=128)
    return t.model_copy(update={"allocation_trace": iteration_allocations(t)})


@pytest.fixture(scope="module")
def plan(trace: Trace) -> Plan:
    return solve(trace, Constraints(device_memory_bytes=64 * MiB, time_limit_s=5.0))


def _record(plan: Plan, trace: Trace, feedback: list[FeedbackRecord] | None = None) -> PlanRecord:
    return PlanRecord(
        id="p1",
        trace_id="t1",
        status="done",
        solver="cpsat",
        constraints=plan.constraints,
        objective=plan.objective,
        model_name=trace.model.name,
        model_fingerprint=trace.model.fingerprint,
        hardware_key=trace.hardware.key,
        workload_key=trace.workload.key,
        plan=plan,
        created_at=NOW,
        finished_at=NOW,
        feedback=feedback or [],
    )


def _stored(trace: Trace) -> StoredTrace:
    return StoredTrace(trace.content_hash(), gzip.compress(trace.canonical_json()))


def _feedback(fid: str, plan: Plan, peak: int) -> FeedbackRecord:
    assert plan.predictions is not None
    return FeedbackRecord(
        id=fid,
        plan_id="p1",
        created_at=NOW,
        feedback=Feedback(
            iteration_s=2 * plan.predictions.iteration_s,
            peak_device_bytes=peak,
            peak_host_bytes=plan.predictions.peak_host_bytes,
            steps_measured=5,
        ),
        iteration_error=1.0,
        peak_device_error=peak / plan.predictions.peak_device_bytes - 1,
    )


def test_seconds_and_errors_are_formatted_for_people() -> None:
    assert [format_seconds(s) for s in (None, 0.0, 2.5, 0.0123, 4.2e-5)] == [
        "—",
        "0.000 s",
        "2.500 s",
        "12.30 ms",
        "42.0 µs",
    ]
    assert [format_error(e) for e in (None, 0.052, -0.4)] == ["—", "+5.2%", "-40.0%"]


def test_comparison_has_predicted_measured_and_coloured_relative_error(plan: Plan) -> None:
    assert plan.predictions is not None
    fb = _feedback("f1", plan, int(plan.predictions.peak_device_bytes * 1.05))
    rows = {c.quantity: c for c in comparisons(plan, fb)}
    assert rows["iteration time"].error == "+100.0%" and rows["iteration time"].css == "err-bad"
    assert rows["peak device memory"].error == "+5.0%" and rows["peak device memory"].css == "err-good"
    assert rows["peak host memory"].error == "+0.0%"
    assert all(c.measured == "—" for c in comparisons(plan, None))


def test_phases_measured_by_the_agent_are_compared_phase_by_phase(plan: Plan) -> None:
    """Feedback with phases adds a row per phase (`Predictions.phases`) and one for the chunk uploads; feedback
    from an agent before phases adds none."""
    assert plan.predictions is not None
    want = plan.predictions.phases()
    fb = _feedback("f1", plan, plan.predictions.peak_device_bytes)
    assert len(comparisons(plan, fb)) == 3
    uploads = plan.predictions.uploads_per_iteration
    measured = MeasuredPhases(
        forward_s=want["forward_s"] * 1.5,
        backward_s=want["backward_s"],
        step_s=want["step_s"],
        uploads_per_iteration=uploads,
    )
    rows = {
        c.quantity: c
        for c in comparisons(
            plan, fb.model_copy(update={"feedback": fb.feedback.model_copy(update={"phases": measured})})
        )
    }
    assert rows["— forward"].error == "+50.0%" and rows["— forward"].css == "err-bad"
    assert rows["— backward and the rest"].error == "+0.0%"
    assert rows["— optimizer.step()"].predicted == format_seconds(want["step_s"])
    if uploads is not None:
        assert rows["chunk uploads per iteration"].measured == f"{uploads:g}"


def test_plan_with_a_timeline_and_no_allocation_never_parses_its_trace(plan: Plan, trace: Trace) -> None:
    assert plan.predictions is not None
    if not plan.predictions.device_memory_timeline:
        pytest.skip("this solver version fills no device_memory_timeline")
    page = plan_page(_record(plan, trace), GARBAGE, cache=ChartCache())
    assert len(page.charts) == 1 and page.chart_note == ""


def test_unreadable_trace_leaves_a_note_instead_of_the_fallback_chart(plan: Plan, trace: Trace) -> None:
    assert plan.predictions is not None
    bare = plan.model_copy(
        update={"predictions": plan.predictions.model_copy(update={"device_memory_timeline": []})}
    )
    page = plan_page(_record(bare, trace), GARBAGE, cache=ChartCache())
    assert page.charts == [] and "trace is unavailable" in page.chart_note
    assert page.modes and page.chunks and page.solver  # the rest of the page is still there


def test_finished_plan_charts_are_cached_until_new_feedback_arrives(plan: Plan, trace: Trace) -> None:
    from planner_service.solver.allocation import plan_allocation

    assert trace.allocation_trace is not None
    placed = plan.model_copy(update={"allocation": plan_allocation(trace.allocation_trace, time_limit_s=2.0)})
    cache = ChartCache(size=4)
    first = plan_page(_record(placed, trace), _stored(trace), cache=cache)
    assert [svg for _, svg in first.charts][-1].count('data-source="allocation"') == 1
    again = plan_page(_record(placed, trace), GARBAGE, cache=cache)  # the trace is not read again
    assert again.charts == first.charts
    with_feedback = plan_page(
        _record(placed, trace, [_feedback("f9", placed, 50 * MiB)]), _stored(trace), cache=cache
    )
    assert "measured peak 50.00 MiB" in str(with_feedback.charts[0][1])


def test_many_chunks_are_drawn_as_runs_of_equal_placement(plan: Plan) -> None:
    from client.contract import Placement
    from planner_service.ui.views import chunk_cells

    assert plan.policy is not None
    one = plan.policy.chunks[0]
    pattern = [Placement.persistent] * 3 + [Placement.offloaded] * 4 + [Placement.persistent] * 2
    chunks = [
        one.model_copy(update={"index": i, "placement": p, "blocks": [i]}) for i, p in enumerate(pattern)
    ]
    policy = plan.policy.model_copy(update={"chunks": chunks, "n_buffers": 1})
    many = plan.model_copy(update={"policy": policy})
    assert len(chunk_cells(many)) == len(pattern)  # few: one cell each
    runs = chunk_cells(many, max_cells=4)
    assert [(r.index, r.last, r.placement) for r in runs] == [
        (0, 2, "persistent"),
        (3, 6, "offloaded"),
        (7, 8, "persistent"),
    ]
    assert runs[1].tooltip.startswith("chunks 3–6: offloaded") and "blocks 3–6" in runs[1].tooltip
    assert runs[1].used_bytes == 4 * one.used_bytes
