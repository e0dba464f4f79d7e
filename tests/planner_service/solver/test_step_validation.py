"""optimizer.step()'s check of each offloaded chunk's exposed `.grad` (policy-1.11, cost model "Validation").

At step() the training thread compares every offloaded chunk's `.grad` with the gradient its speculative host
step used (`GradientFlow.reconcile`), chunk by chunk as the host worker finishes them (C-1..0). On an H200 this
was 11-15 ms of step() per iteration for six 49 MiB chunks, none of it predicted (`benchmarks/gpu_timeline.py`:
`aten::equal`, 2.2 ms per chunk): the cost model now charges it at the host copy rate, after backward and the
device steps, the last check after the worker's last step. On a serial device (CPU) the runtime probe's
measured offload overhead holds it: no term.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from client.contract import Trace
from planner_service.solver.bandwidth import host_copy_ns, host_validate_bytes
from planner_service.solver.chunk_grid import candidate_layouts
from planner_service.solver.cost_model import evaluate_decision
from planner_service.solver.cpsat_solve import solve_layout
from planner_service.solver.instance import CostParams, Decision, Mode, build_instance, element_bytes
from tests.planner_service.solver.test_multi_rank_policy import (
    _clipping,
    _multi_rank,
    assert_timer_agrees,
    cpsat_equals_brute_force,
)
from tests.planner_service.solver.test_policy_bruteforce import (
    brute_force,
    limits_between_extremes,
    random_trace,
)


def with_host_copy_rate(trace: Trace, rate: float) -> Trace:
    m = trace.measurements
    opt = m.optimizer.model_copy(update={"host_copy_bytes_per_s": rate})
    return trace.model_copy(update={"measurements": m.model_copy(update={"optimizer": opt})})


def test_validation_bytes_are_one_compare_plus_the_conversion_from_a_separate_master() -> None:
    assert host_validate_bytes(1000, 4, separate_master=False) == 4000  # fp32: both read, one copy's worth
    assert host_validate_bytes(1000, 2, separate_master=False) == 2000  # bf16 states throughout
    assert host_validate_bytes(1000, 2, separate_master=True) == 5000  # fp32 host gradient cast to bf16 first


def test_the_check_is_charged_where_copies_overlap_compute_and_not_on_a_serial_device() -> None:
    rng = np.random.default_rng(11)
    trace = with_host_copy_rate(random_trace(rng, n_blocks=5), 20e9)
    cons = limits_between_extremes(rng, trace)
    lay = candidate_layouts(trace)[0]
    gpu = build_instance(trace, lay, cons, CostParams(copy_overlap=True))
    cpu = build_instance(trace, lay, cons, CostParams(copy_overlap=False))
    elt = element_bytes(trace.workload.precision)
    assert cpu.validate_ns == (0,) * lay.n_chunks
    for c, used in enumerate(lay.used_bytes):
        want = host_copy_ns(
            trace.measurements.optimizer, host_validate_bytes(used // elt, elt, separate_master=False)
        )
        assert gpu.validate_ns[c] == want > 0
    # every chunk offloaded: the checks follow backward and the device steps, the last one the worker's last step
    C = lay.n_chunks
    d = Decision((True,) * C, 1, (Mode.keep,) * gpu.n_blocks)
    cost = evaluate_decision(gpu, d)
    base = build_instance(with_host_copy_rate(trace, 0.0), lay, cons, CostParams(copy_overlap=True))
    plain = evaluate_decision(base, d)
    total, first = sum(gpu.validate_ns), gpu.validate_ns[0]
    settled = max(cost.backward_ns + cost.device_optim_ns + total, cost.host_end_ns + first)
    assert cost.host_validate_ns == total
    assert cost.settled_ns == settled
    assert cost.iteration_ns == cost.forward_ns + settled + cost.host_redo_ns
    assert cost.forward_ns == plain.forward_ns and cost.settled_ns > plain.settled_ns


# the seeds of test_policy_bruteforce's tests that compare optima (1000 + n; with clipping 7000 + n)
@pytest.mark.parametrize(
    ("seed", "clip"), [(1000, False), (7000, True), (1002, False), (7001, True), (1009, False)]
)
def test_cpsat_optimum_equals_brute_force_with_the_check(seed: int, clip: bool) -> None:
    rng = np.random.default_rng(seed)
    trace = random_trace(rng, n_blocks=int(rng.integers(3, 8 if clip else 9)))
    cons = limits_between_extremes(rng, trace)
    # a host copy rate from slow (the checks dominate step()) to fast
    trace = with_host_copy_rate(trace, float(rng.uniform(1e9, 30e9)))
    if clip:
        trace = _clipping(trace)
        assert cons.host_memory_bytes is not None
        cons = cons.model_copy(update={"host_memory_bytes": 2 * cons.host_memory_bytes})
    params = CostParams(alpha=0.05, full_duplex=bool(seed % 2), copy_overlap=True)
    compared = 0
    for lay in candidate_layouts(trace):
        if 2**lay.n_chunks * 3 ** (len(trace.model.blocks) - 2) > 100_000:
            continue
        inst = build_instance(trace, lay, cons, params)
        assert any(inst.validate_ns)
        expected = brute_force(inst)
        got = solve_layout(inst, hint=None, time_limit_s=60, seed=0, gap_limit=0.0)
        if expected is None:
            assert got.status == "infeasible"
            continue
        assert got.status == "optimal" and got.cost is not None and got.decision is not None
        assert got.cost.iteration_ns == expected == evaluate_decision(inst, got.decision).iteration_ns
        compared += 1
    assert compared >= 1


@pytest.mark.parametrize(
    ("seed", "world", "per_node", "clip"), [(0, 2, 2, False), (1, 2, 1, True), (3, 4, 2, False)]
)
def test_multi_rank_cpsat_optimum_and_timer_agree_with_the_check(
    seed: int, world: int, per_node: int, clip: bool
) -> None:
    rng = np.random.default_rng(7000 + seed)
    trace, cons = _multi_rank(rng, world, per_node, 0.5, n_blocks=int(rng.integers(3, 6)))
    trace = with_host_copy_rate(trace, float(rng.uniform(1e9, 30e9)))
    if clip:
        trace = _clipping(trace)
    params = CostParams(alpha=0.05, copy_overlap=True)
    pick = random.Random(seed)
    compared = 0
    for lay in candidate_layouts(trace):
        inst = build_instance(trace, lay, cons, params)
        assert any(inst.shard_validate_ns) and any(inst.validate_ns)
        assert_timer_agrees(inst, pick, 20)  # sharded chunks check their shard
        if 4**lay.n_chunks * 3 ** (len(trace.model.blocks) - 2) <= 20_000:
            compared += cpsat_equals_brute_force(inst)
    assert compared >= 1
