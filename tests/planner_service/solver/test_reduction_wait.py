"""Policy-1.8: each gradient reduction pays the wait for the later rank after its chunk's backward
(`sharding.reduction_wait_ns`).

On a CPU device the in-step curves are timed after one `IN_STEP_BURST_S` of compute, their wait for the later
rank included; the wait grows with the compute before the call and levels off (session 13), and the trace
measures both ends (`control_s` after one burst, `phase_control_s` after a phase's worth). A chunk whose
blocks' backward is X pays (phase - control) * min(1, max(0, (X - burst) / burst)) on its reduction, sharded
(reduce-scatter) or replicated (all-reduce). Traces without `phase_control_s` (a GPU, older traces) pay nothing.
"""

from __future__ import annotations

import pytest

from client.contract import IN_STEP_BURST_S, Constraints, Trace
from planner_service.solver.chunk_grid import pack
from planner_service.solver.cost_model import evaluate_decision
from planner_service.solver.instance import CostParams, Decision, Mode, PolicyInstance, build_instance
from planner_service.solver.sharding import reduction_wait_ns
from planner_service.solver.testing.synthetic import (
    BlockSpec,
    hand_trace,
    synthetic_distributed,
    with_distributed,
)

MB = 10**6
MiB = 2**20
ms = 10**6  # ns


def _trace(backward_s: list[float], control_s: float, phase_control_s: float) -> Trace:
    specs = [BlockSpec(100 * MB, 0.010, b, 0.010, activation_bytes=MB, input_bytes=MB) for b in backward_s]
    trace = with_distributed(hand_trace(specs), synthetic_distributed(2, 2, flat=True))
    d = trace.hardware.distributed
    assert d is not None and d.collectives is not None
    curves = d.collectives.model_copy(update={"control_s": control_s, "phase_control_s": phase_control_s})
    hw = trace.hardware.model_copy(update={"distributed": d.model_copy(update={"collectives": curves})})
    return Trace.model_validate_json(trace.model_copy(update={"hardware": hw}).model_dump_json())


def _inst(trace: Trace, *, serial: bool = True) -> PolicyInstance:
    layout = pack(trace, 128 * MiB)  # one block per chunk
    assert layout.n_chunks == len(trace.model.blocks)
    return build_instance(
        trace,
        layout,
        Constraints(device_memory_bytes=8 * 2**30),
        CostParams(alpha=0.0, copy_overlap=not serial),
    )


def test_the_wait_ramps_from_one_burst_of_backward_to_two_and_then_stays() -> None:
    burst = IN_STEP_BURST_S
    backward = [0.5 * burst, burst, 1.5 * burst, 2 * burst, 8 * burst]
    trace = _trace(backward, control_s=1e-3, phase_control_s=3e-3)
    layout = pack(trace, 128 * MiB)
    assert reduction_wait_ns(trace, layout) == (0, 0, 1 * ms, 2 * ms, 2 * ms)


@pytest.mark.parametrize(("control_s", "phase_control_s"), [(1e-3, 0.0), (3e-3, 1e-3), (0.0, 3e-3)])
def test_no_phase_figure_or_none_above_the_plain_one_adds_nothing(
    control_s: float, phase_control_s: float
) -> None:
    trace = _trace([0.020, 0.020], control_s, phase_control_s)
    assert reduction_wait_ns(trace, pack(trace, 128 * MiB)) == (0, 0)


def test_both_reductions_pay_it_and_a_serial_iteration_grows_by_the_waits() -> None:
    plain, waiting = _inst(_trace([0.020, 0.020], 1e-3, 1e-3)), _inst(_trace([0.020, 0.020], 1e-3, 3e-3))
    assert [b - a for a, b in zip(plain.all_reduce_ns, waiting.all_reduce_ns, strict=True)] == [
        2 * ms,
        2 * ms,
    ]
    assert [b - a for a, b in zip(plain.reduce_scatter_ns, waiting.reduce_scatter_ns, strict=True)] == [
        2 * ms,
        2 * ms,
    ]
    keep = (Mode.keep,) * plain.n_blocks
    for offloaded, sharded in (((True, True), (True, True)), ((False, False), (False, False))):
        d = Decision(offloaded, sum(offloaded), keep, sharded)
        before, after = evaluate_decision(plain, d), evaluate_decision(waiting, d)
        # a CPU device: the reductions run in series with compute, so each wait adds to the iteration; the
        # phase-end checks pay the measured phase figure too (2 ms more each)
        checks = after.control_ns - before.control_ns
        assert after.iteration_ns - before.iteration_ns == 2 * 2 * ms + checks
