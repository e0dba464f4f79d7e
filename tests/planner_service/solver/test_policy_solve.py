"""`solve`: CP-SAT vs the ProTrain baseline, monotonicity, infeasibility, and the shape of the plan it returns."""

from __future__ import annotations

import pytest

from client.contract import ActivationMode, BlockKind, Constraints, DeviceType, Placement, Plan, SolverStatus
from planner_service.solver import SOLVER_VERSION, solve
from planner_service.solver.cost_model import evaluate
from planner_service.solver.cpsat_solve import RELATIVE_GAP_LIMIT
from planner_service.solver.entry import solve_with_gap
from planner_service.solver.testing.synthetic import MODEL_SHAPES, BlockSpec, hand_trace, synthetic_trace

GiB = 2**30
MiB = 2**20


def exact(trace, cons: Constraints) -> Plan:
    """CP-SAT with a zero gap limit: the claims below are about the proven optimum."""
    return solve_with_gap(trace, cons, solver="cpsat", seed=0, gap_limit=0.0)


@pytest.fixture(scope="module")
def small_trace():
    return synthetic_trace(n_blocks=12, hidden=1024, heads=16, batch=8, seq=1024, vocab=32000)


@pytest.fixture(scope="module")
def llama7b_trace():
    hidden, layers, heads = MODEL_SHAPES["llama-7b"]
    return synthetic_trace(n_blocks=layers, hidden=hidden, heads=heads, batch=2, seq=2048)


@pytest.mark.parametrize("device_gib", [16, 22, 26])
def test_cpsat_is_strictly_faster_than_protrain_on_llama_7b(llama7b_trace, device_gib):
    # ProTrain's knobs force a persistent *prefix* of chunks and an S/C-interleaved block layout; CP-SAT may
    # pick any subset and any modes. On a 7B model with ~24 GiB the host optimizer is the bottleneck and
    # CP-SAT keeps more chunks on the device (all checkpointed) than the prefix layout allows. (Since
    # policy-1.2 counts persistent chunks at their used bytes, the prefix happens to reach the optimum at
    # exactly 24 GiB, where this test used to run; 16-32 GiB otherwise show CP-SAT 1.1-1.8% faster. Since the
    # host step of a bf16 chunk is charged on its fp32 master's bytes, twice its compute bytes, 18-20, 24 and
    # 28-30 GiB are within 0.5% and 16, 22, 26 and 32 GiB 1.2-2.1% faster.)
    cons = Constraints(device_memory_bytes=device_gib * GiB, time_limit_s=30)
    base = solve(llama7b_trace, cons, solver="protrain")
    best = solve(llama7b_trace, cons, solver="cpsat")
    assert base.solver.objective is not None and best.solver.objective is not None
    assert best.solver.gap is not None and best.solver.gap <= RELATIVE_GAP_LIMIT
    assert best.solver.objective < base.solver.objective * 0.995


@pytest.mark.parametrize("device_gib", [3, 4, 6, 8, 12, 24])
def test_cpsat_is_never_slower_than_protrain(small_trace, device_gib):
    cons = Constraints(device_memory_bytes=device_gib * GiB, time_limit_s=30)
    base = solve(small_trace, cons, solver="protrain")
    best = solve(small_trace, cons, solver="cpsat")
    if base.solver.status == SolverStatus.infeasible:
        assert best.solver.status == SolverStatus.infeasible
        assert best.solver.min_device_memory_bytes == base.solver.min_device_memory_bytes
        return
    assert best.solver.objective is not None and base.solver.objective is not None
    assert best.solver.objective <= base.solver.objective


def test_more_device_memory_never_makes_the_optimum_slower(small_trace):
    previous = None
    for device_gib in (3, 3.5, 4, 5, 6, 8, 10, 16, 40):
        plan = exact(small_trace, Constraints(device_memory_bytes=int(device_gib * GiB), time_limit_s=30))
        if plan.solver.status == SolverStatus.infeasible:
            assert previous is None, "feasible at a smaller limit, infeasible at a larger one"
            continue
        assert plan.solver.status == SolverStatus.optimal
        if previous is not None:
            assert plan.solver.objective <= previous
        previous = plan.solver.objective
    assert previous is not None


def test_more_host_memory_never_makes_the_optimum_slower(small_trace):
    previous = None
    for host_gib in (1, 2, 4, 8, 64):
        plan = exact(
            small_trace,
            Constraints(device_memory_bytes=4 * GiB, host_memory_bytes=host_gib * GiB, time_limit_s=30),
        )
        if plan.solver.status == SolverStatus.infeasible:
            assert previous is None
            continue
        assert plan.solver.status == SolverStatus.optimal
        if previous is not None:
            assert plan.solver.objective <= previous
        previous = plan.solver.objective


@pytest.mark.parametrize("device_gib", [3, 5])
def test_default_solve_lies_within_its_reported_gap_of_the_exact_optimum(small_trace, device_gib):
    cons = Constraints(device_memory_bytes=device_gib * GiB, time_limit_s=30)
    fast, best = solve(small_trace, cons), exact(small_trace, cons)
    assert best.solver.status == SolverStatus.optimal and best.solver.gap == 0.0
    assert fast.solver.gap is not None and fast.solver.gap <= RELATIVE_GAP_LIMIT
    assert fast.solver.best_bound <= best.solver.objective + 1e-12
    assert (
        best.solver.objective
        <= fast.solver.objective
        <= best.solver.objective * (1 + fast.solver.gap) + 1e-12
    )


def test_everything_fits_means_no_offload_and_no_checkpointing(small_trace):
    plan = solve(small_trace, Constraints(device_memory_bytes=80 * GiB))
    assert plan.policy is not None
    assert all(c.placement == Placement.persistent for c in plan.policy.chunks)
    assert plan.policy.n_buffers == 0
    assert set(plan.policy.mode_strip()) == {"K"}
    assert plan.predictions is not None and plan.predictions.host_optimizer_s == 0.0


def test_a_cpu_device_without_memory_pressure_offloads_nothing_where_a_gpu_would():
    # Host and device optimizer equally fast (both are the CPU on a CPU device). With copy/compute overlap
    # (GPU) offloading hides the optimizer behind backward and the uploads behind compute, so it pays; on a
    # CPU device every copy and host step is serial, so keeping everything on the device is fastest.
    specs = [
        BlockSpec(
            8 * MiB,
            forward_s=0.004,
            backward_s=0.008,
            recompute_s=0.004,
            activation_bytes=4 * MiB,
            input_bytes=1 * MiB,
            kind=BlockKind.prologue if i == 0 else BlockKind.epilogue if i == 5 else BlockKind.block,
        )
        for i in range(6)
    ]
    rates = dict(
        h2d_bytes_per_s=10e9,
        d2h_bytes_per_s=10e9,
        device_optimizer_bytes_per_s=2e9,
        host_optimizer_bytes_per_s=2e9,
    )
    cons = Constraints(device_memory_bytes=80 * GiB)
    gpu = exact(hand_trace(specs, **rates), cons)
    cpu = exact(hand_trace(specs, **rates, device_type=DeviceType.cpu), cons)
    assert gpu.policy is not None and cpu.policy is not None
    assert any(c.placement == Placement.offloaded for c in gpu.policy.chunks)
    assert all(c.placement == Placement.persistent for c in cpu.policy.chunks)
    assert set(cpu.policy.mode_strip()) == {"K"}
    assert cpu.predictions is not None and cpu.predictions.breakdown["copy_overlap"] == 0.0
    assert "serial" in (cpu.solver.message or "")


@pytest.mark.parametrize("solver", ["cpsat", "protrain"])
def test_too_little_memory_returns_infeasible_with_the_smallest_device_memory_that_fits(small_trace, solver):
    plan = solve(small_trace, Constraints(device_memory_bytes=256 * MiB), solver=solver)
    assert plan.solver.status == SolverStatus.infeasible
    assert plan.policy is None and plan.predictions is None
    need = plan.solver.min_device_memory_bytes
    assert need is not None and need > 256 * MiB
    assert plan.solver.min_device_memory_proven is True  # a small instance: every layout's minimum proven
    assert f"smallest device memory that fits: {need} bytes" in plan.solver.message
    assert plan.solver.min_device_memory_text() == f"the smallest device memory that fits is {need} bytes"
    assert solve(small_trace, Constraints(device_memory_bytes=need), solver="cpsat").policy is not None
    below = solve(small_trace, Constraints(device_memory_bytes=need - 1), solver="cpsat")
    assert below.solver.status == SolverStatus.infeasible


def test_unknown_solver_name_is_a_value_error(small_trace):
    with pytest.raises(ValueError, match="solver: unknown 'gurobi'"):
        solve(small_trace, Constraints(device_memory_bytes=8 * GiB), solver="gurobi")


def _check_plan_shape(trace, plan: Plan) -> None:
    policy = plan.policy
    assert policy is not None
    names = [n for c in policy.chunks for n in c.parameters]
    assert names == [p.name for p in trace.model.parameters]  # execution order, each exactly once
    block_of = {p.name: p.block for p in trace.model.parameters}
    owners: dict[int, int] = {}
    for c in policy.chunks:
        assert c.blocks == sorted({block_of[n] for n in c.parameters})
        assert c.used_bytes == sum(p.bytes for p in trace.model.parameters if p.name in set(c.parameters))
        for b in c.blocks:
            assert owners.setdefault(b, c.index) == c.index  # a block never spans two chunks
    for bp, info in zip(policy.blocks, trace.model.blocks, strict=True):
        assert bp.module == info.name
        if info.kind != BlockKind.block:
            assert bp.mode == ActivationMode.keep
    assert plan.allocation is None
    assert plan.trace_hash == trace.content_hash()
    assert plan.solver.solver_version == SOLVER_VERSION


@pytest.mark.parametrize("solver", ["cpsat", "protrain"])
def test_plan_follows_the_trace_and_its_predictions_are_the_cost_model(small_trace, solver):
    cons = Constraints(device_memory_bytes=5 * GiB)
    plan = solve(small_trace, cons, solver=solver)
    _check_plan_shape(small_trace, plan)
    assert plan.predictions == evaluate(small_trace, plan.policy, cons)
    assert (
        plan.predictions.peak_device_bytes * (1 + plan.predictions.breakdown["alpha"])
        <= cons.device_memory_bytes
    )
    assert plan.predictions.iteration_s == pytest.approx(plan.solver.objective, abs=1e-9)
    p = plan.predictions
    assert p.iteration_s >= p.forward_s + p.backward_s


def test_same_trace_and_seed_give_the_same_plan(small_trace):
    cons = Constraints(device_memory_bytes=5 * GiB)
    a, b = solve(small_trace, cons, seed=3), solve(small_trace, cons, seed=3)
    assert a.policy == b.policy and a.predictions == b.predictions
    assert (a.solver.status, a.solver.objective, a.solver.best_bound) == (
        b.solver.status,
        b.solver.objective,
        b.solver.best_bound,
    )


def test_a_short_time_limit_still_returns_a_plan_with_its_gap(llama7b_trace):
    plan = solve(llama7b_trace, Constraints(device_memory_bytes=24 * GiB, time_limit_s=0.05))
    assert plan.solver.status in (SolverStatus.optimal, SolverStatus.feasible)
    assert plan.policy is not None  # the ProTrain answer is the fallback incumbent
    assert plan.solver.gap is not None and plan.solver.best_bound is not None
    assert plan.solver.best_bound <= plan.solver.objective


def test_blocks_without_parameters_belong_to_no_chunk_and_still_get_a_mode():
    from planner_service.solver.testing.synthetic import BlockSpec, hand_trace

    spec = dict(
        forward_s=0.001, backward_s=0.002, recompute_s=0.001, activation_bytes=64 * MiB, input_bytes=MiB
    )
    trace = hand_trace(
        [
            BlockSpec(8 * MiB, kind=BlockKind.prologue, **spec),
            BlockSpec(16 * MiB, **spec),
            BlockSpec(0, **spec),
            BlockSpec(16 * MiB, **spec),
            BlockSpec(8 * MiB, kind=BlockKind.epilogue, **spec),
        ]
    )
    cons = Constraints(device_memory_bytes=400 * MiB)
    plan = exact(trace, cons)
    assert plan.policy is not None
    assert all(2 not in c.blocks for c in plan.policy.chunks)
    assert len(plan.policy.blocks) == 5
    _check_plan_shape(trace, plan)
    assert plan.predictions == evaluate(trace, plan.policy, cons)
