"""What the plan page charts: the solver's timeline first, else live bytes of the allocation trace, else per-block bars."""

from __future__ import annotations

import pytest

from client.contract import AllocationTrace, Constraints, Plan, Trace
from planner_service.solver import solve
from planner_service.solver.allocation import plan_allocation
from planner_service.solver.allocation.trace_check import trace_lower_bound
from planner_service.solver.testing.synthetic import synthetic_trace
from planner_service.ui.memory_series import (
    MAX_CURVE_POINTS,
    allocation_chart,
    live_bytes,
    memory_chart,
    memory_charts,
    reduce_to_maxima,
)

from .conftest import iteration_allocations

MiB = 2**20


@pytest.fixture(scope="module")
def trace() -> Trace:
    t = synthetic_trace(n_blocks=8, hidden=256, vocab=1000, batch=2, seq=128)
    return t.model_copy(update={"allocation_trace": iteration_allocations(t)})


def _solved(trace: Trace, limit: int) -> Plan:
    return solve(trace, Constraints(device_memory_bytes=limit, time_limit_s=5.0))


def _without_timeline(plan: Plan) -> Plan:
    assert plan.predictions is not None
    return plan.model_copy(
        update={"predictions": plan.predictions.model_copy(update={"device_memory_timeline": []})}
    )


def test_solver_timeline_is_drawn_first_with_one_point_per_step_and_phase_bands(trace: Trace) -> None:
    plan = _solved(trace, 64 * MiB)
    assert plan.predictions is not None
    if not plan.predictions.device_memory_timeline:
        pytest.skip("this solver version fills no device_memory_timeline")
    chart = memory_chart(plan, trace, measured_peak_bytes=40 * MiB)
    assert chart is not None and chart.source == "timeline"
    assert [p.y_bytes for p in chart.points] == [
        t.device_bytes for t in plan.predictions.device_memory_timeline
    ]
    phases = [b.label for b in chart.bands]
    assert phases[0] == "forward" and "backward" in phases
    assert {m.css: m.value_bytes for m in chart.markers} == {
        "limit": 64 * MiB,
        "predicted": plan.predictions.peak_device_bytes,
        "measured": 40 * MiB,
    }


@pytest.mark.parametrize("limit_mib", [40, 48, 64, 4096])
def test_tallest_block_bar_is_the_predicted_peak(trace: Trace, limit_mib: int) -> None:
    plan = _solved(trace.model_copy(update={"allocation_trace": None}), limit_mib * MiB)
    if plan.predictions is None:
        pytest.skip(f"nothing fits {limit_mib} MiB")
    chart = memory_chart(_without_timeline(plan), trace.model_copy(update={"allocation_trace": None}))
    assert chart is not None and chart.source == "blocks"
    assert len(chart.bars) == len(trace.model.blocks)
    assert max(b.total_bytes for b in chart.bars) == plan.predictions.peak_device_bytes
    assert chart.bars[3].label.startswith(f"block 3: {trace.model.blocks[3].name} (")


def test_live_bytes_peak_equals_the_allocation_lower_bound(trace: Trace) -> None:
    assert trace.allocation_trace is not None
    curve = live_bytes(trace.allocation_trace)
    assert len(curve) == trace.allocation_trace.horizon
    assert int(curve.max()) == trace_lower_bound(trace.allocation_trace)
    params = sum(b.parameter_bytes for b in trace.model.blocks)
    assert int(curve.min()) >= params  # long-lived parameters are live at every time


def test_long_curves_are_reduced_to_bucket_maxima_that_keep_the_peak() -> None:
    from client.contract import AllocationEvent

    events = [
        AllocationEvent(
            id=i,
            size_bytes=1000 + (i % 97) * 10,
            alloc_index=i,
            free_index=i + 3,
            category="temp",
            phase="forward",
        )
        for i in range(20_000)
    ]
    events.append(
        AllocationEvent(
            id=20_000,
            size_bytes=5 * MiB,
            alloc_index=12_345,
            free_index=12_346,
            category="activation",
            phase="backward",
        )
    )
    at = AllocationTrace(source="dispatch_tracker", horizon=20_010, events=events)
    starts, maxima = reduce_to_maxima(live_bytes(at))
    assert len(starts) <= MAX_CURVE_POINTS
    assert int(maxima.max()) == trace_lower_bound(at)
    chart = allocation_chart(at, [])
    assert len(chart.points) <= MAX_CURVE_POINTS and chart.steps
    assert [b.label for b in chart.bands] == ["forward", "backward"]


def test_allocation_chart_follows_the_main_one_with_the_arena_marked(trace: Trace) -> None:
    plan = _solved(trace, 64 * MiB)
    assert trace.allocation_trace is not None
    plan = plan.model_copy(update={"allocation": plan_allocation(trace.allocation_trace, time_limit_s=2.0)})
    charts = memory_charts(plan, trace)
    assert charts[-1].source == "allocation"
    assert {m.css for m in charts[-1].markers} >= {"limit", "arena"}
    if len(charts) == 1:  # no timeline: the allocation chart is the main one, with every reference line
        assert {m.css for m in charts[0].markers} >= {"limit", "predicted", "arena"}
    else:
        assert len(charts) == 2 and charts[0].source == "timeline"


def test_infeasible_plan_charts_the_memory_it_would_need_against_the_limit(trace: Trace) -> None:
    plan = _solved(trace, 1 * MiB)
    assert plan.policy is None and plan.solver.min_device_memory_bytes is not None
    chart = memory_chart(plan, trace)
    assert chart is not None and chart.source == "requirement"
    assert chart.bars[0].total_bytes == plan.solver.min_device_memory_bytes
    assert [m.value_bytes for m in chart.markers] == [1 * MiB]


def test_a_policy_that_does_not_match_its_trace_is_an_error_naming_the_field(trace: Trace) -> None:
    plan = _without_timeline(_solved(trace, 4096 * MiB))
    other = synthetic_trace(n_blocks=3, hidden=256, vocab=1000, batch=2, seq=128)
    with pytest.raises(ValueError, match=r"policy\.blocks: 10 entries, the trace has 5 blocks"):
        memory_chart(plan, other)


def test_block_bars_follow_the_cost_model_for_every_activation_mode(trace: Trace) -> None:
    from client.contract import ActivationMode
    from planner_service.solver.cost_model import evaluate

    bare = trace.model_copy(update={"allocation_trace": None})
    plan = _solved(bare, 4096 * MiB)
    assert plan.policy is not None
    cycle = [ActivationMode.swap, ActivationMode.keep, ActivationMode.checkpoint, ActivationMode.swap]
    policy = plan.policy.model_copy(
        update={
            "blocks": [
                b.model_copy(update={"mode": cycle[i % len(cycle)]}) for i, b in enumerate(plan.policy.blocks)
            ]
        }
    )
    predictions = evaluate(bare, policy, plan.constraints)
    mixed = plan.model_copy(
        update={
            "policy": policy,
            "predictions": predictions.model_copy(update={"device_memory_timeline": []}),
        }
    )
    chart = memory_chart(mixed, bare)
    assert chart is not None and chart.source == "blocks"
    assert max(b.total_bytes for b in chart.bars) == predictions.peak_device_bytes
