"""CP-SAT finds exactly the brute-force optimum of the same decision space under the same cost model."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from client.contract import BlockKind, Constraints, DeviceType
from planner_service.solver.chunk_grid import candidate_layouts
from planner_service.solver.cost_model import activation_peak, evaluate_decision, iteration_ns_batch
from planner_service.solver.cpsat_solve import solve_layout
from planner_service.solver.entry import solve_with_gap
from planner_service.solver.instance import CostParams, Decision, Mode, PolicyInstance, build_instance
from planner_service.solver.testing.synthetic import BlockSpec, hand_trace

MiB = 2**20


def random_trace(rng: np.random.Generator, n_blocks: int):
    specs = []
    for i in range(n_blocks):
        kind = BlockKind.prologue if i == 0 else BlockKind.epilogue if i == n_blocks - 1 else BlockKind.block
        fwd = float(rng.uniform(0.5e-3, 4e-3))
        specs.append(
            BlockSpec(
                parameter_bytes=int(rng.integers(2, 48)) * MiB,
                forward_s=fwd,
                backward_s=2 * fwd * float(rng.uniform(0.8, 1.2)),
                recompute_s=fwd,
                activation_bytes=int(rng.integers(8, 256)) * MiB,
                input_bytes=int(rng.integers(1, 8)) * MiB,
                forward_peak_bytes=int(rng.integers(0, 32)) * MiB,
                backward_peak_bytes=int(rng.integers(0, 64)) * MiB,
                kind=kind,
            )
        )
    return hand_trace(
        specs,
        h2d_bytes_per_s=float(rng.uniform(4e9, 25e9)),
        d2h_bytes_per_s=float(rng.uniform(4e9, 25e9)),
        host_optimizer_bytes_per_s=float(rng.uniform(2e9, 40e9)),
        device_optimizer_bytes_per_s=200e9,
    )


def brute_force(inst: PolicyInstance) -> int | None:
    """Minimum iteration ns over every placement subset, buffer count and per-block mode (None: nothing fits)."""
    free = [b for b in range(inst.n_blocks) if inst.optimisable[b]]
    rows = []
    for combo in itertools.product((Mode.keep, Mode.checkpoint, Mode.swap), repeat=len(free)):
        modes = [Mode.keep] * inst.n_blocks
        for b, m in zip(free, combo, strict=True):
            modes[b] = m
        rows.append(tuple(modes))
    M = np.array(rows, dtype=np.int8)
    act_peak = np.array([activation_peak(inst, r) for r in rows], dtype=np.int64)
    swapped = np.where(M == Mode.swap, np.array(inst.act_bytes), 0).sum(axis=1)
    pinned_cap = inst.pinned_limit_bytes if inst.pinned_limit_bytes is not None else inst.host_limit_bytes
    best: int | None = None
    for off in itertools.product((False, True), repeat=inst.n_chunks):
        n_off = sum(off)
        for nb in range(inst.min_buffers(off), n_off + 1) if n_off else (0,):  # the runtime's floor
            persist = sum(inst.state_bytes(c) for c in range(inst.n_chunks) if not off[c])
            static = persist + nb * inst.buffer_bytes
            # host: states + the runtime's host extras within the host limit; the pinned part (the runtime's
            # pinned chunk buffers) within the pinned limit
            pinned = sum(inst.pinned_bytes(c) for c in range(inst.n_chunks) if off[c])
            host = sum(inst.host_bytes(c) for c in range(inst.n_chunks) if off[c])
            ok = (
                (static + act_peak <= inst.usable_device_bytes)
                & (host + swapped <= inst.host_limit_bytes)
                & (pinned + swapped <= pinned_cap)
            )
            if not ok.any():
                continue
            t = int(iteration_ns_batch(inst, off, nb, M[ok]).min())
            best = t if best is None else min(best, t)
    return best


def limits_between_extremes(rng: np.random.Generator, trace) -> Constraints:
    """A device limit strictly between 'nothing offloaded or checkpointed' and 'tightest policy' so choices matter."""
    params = trace.model.parameters
    state = 4 * sum(p.bytes for p in params)
    acts = sum(m.activation_bytes for m in trace.measurements.blocks)
    device = int(rng.uniform(0.35, 0.95) * (state + acts))
    host = int(rng.uniform(0.5, 3.0) * state)
    return Constraints(device_memory_bytes=max(device, 64 * MiB), host_memory_bytes=host, time_limit_s=60)


def assert_cpsat_matches_brute_force(
    trace, cons: Constraints, params: CostParams, *, serial: bool = False
) -> int:
    """CP-SAT's optimum equals the brute force's on every small enough layout; returns how many were feasible."""
    solved = 0
    for lay in candidate_layouts(trace):
        if 2**lay.n_chunks * 3 ** (len(trace.model.blocks) - 2) > 300_000:
            continue  # keep the enumeration small: the largest layouts of 8-block models are skipped
        inst = build_instance(trace, lay, cons, params)
        if serial:
            assert not inst.copy_overlap
        expected = brute_force(inst)
        got = solve_layout(inst, hint=None, time_limit_s=60, seed=0, gap_limit=0.0)
        if expected is None:
            assert got.status == "infeasible"
            continue
        assert got.status == "optimal"
        assert got.cost is not None and got.cost.fits
        assert got.cost.iteration_ns == expected
        solved += 1
    return solved


# Seeds whose random limits leave at least one layout feasible (seeds 3, 4, 7 leave none once the host side
# counts the exposed gradients and undo backups, 8 and 10 once it counts every offloaded chunk's gradient
# staging buffer (issue 19), so they would compare no optimum; every seed here must compare at least one).
@pytest.mark.parametrize("seed", [0, 1, 2, 5, 6, 9, 12, 14])
def test_cpsat_optimum_equals_brute_force_on_every_layout(seed: int):
    rng = np.random.default_rng(1000 + seed)
    trace = random_trace(rng, n_blocks=int(rng.integers(3, 9)))
    cons = limits_between_extremes(rng, trace)
    params = CostParams(alpha=0.05, full_duplex=bool(seed % 2))
    assert assert_cpsat_matches_brute_force(trace, cons, params) >= 1


@pytest.mark.parametrize("seed", range(4))
def test_cpsat_optimum_equals_brute_force_with_serial_copies(seed: int):
    # CPU devices: every window costs compute + copies, the host optimizer adds to the iteration
    rng = np.random.default_rng(3000 + seed)
    trace = random_trace(rng, n_blocks=int(rng.integers(3, 9)))
    cons = limits_between_extremes(rng, trace)
    params = CostParams(alpha=0.05, full_duplex=bool(seed % 2), copy_overlap=False)
    assert assert_cpsat_matches_brute_force(trace, cons, params, serial=True) >= 1


def with_runtime_costs(rng: np.random.Generator, trace):
    """The trace with runtime costs as the profiler's runtime probe measures them (random, per block; the
    per-chunk cost's forward and step parts random shares of it)."""
    blocks = [
        b.model_copy(
            update={
                "swap_out_s": float(rng.uniform(0, 5e-3))
                if 0 < i < len(trace.measurements.blocks) - 1
                else 0.0,
                "swap_in_s": float(rng.uniform(0, 5e-3))
                if 0 < i < len(trace.measurements.blocks) - 1
                else 0.0,
                "offload_overhead_s": (overhead := float(rng.uniform(0, 2e-3))),
                "upload_overhead_s": float(rng.uniform(0, 1e-3)),
                "offload_forward_s": overhead * (forward := float(rng.uniform(0, 1))),
                "offload_step_s": overhead * (1 - forward) * float(rng.uniform(0, 1)),
            }
        )
        for i, b in enumerate(trace.measurements.blocks)
    ]
    hw = trace.hardware.model_copy(update={"device_type": DeviceType.cpu})
    return trace.model_copy(
        update={"hardware": hw, "measurements": trace.measurements.model_copy(update={"blocks": blocks})}
    )


@pytest.mark.parametrize("seed", range(3))
def test_cpsat_optimum_equals_brute_force_with_measured_runtime_costs(seed: int):
    # CPU device with the runtime probe's measured swap, offload and upload costs: CP-SAT reads the same
    # instance constants as the reference model, so its optimum is still the brute-force one
    rng = np.random.default_rng(6000 + seed)
    trace = with_runtime_costs(rng, random_trace(rng, n_blocks=int(rng.integers(3, 8))))
    cons = limits_between_extremes(rng, trace)
    params = CostParams(alpha=0.05, full_duplex=bool(seed % 2))
    assert assert_cpsat_matches_brute_force(trace, cons, params, serial=True) >= 1


def _brute_force_over_layouts(seed: int):
    rng = np.random.default_rng(2000 + seed)
    trace = random_trace(rng, n_blocks=int(rng.integers(3, 7)))
    cons = limits_between_extremes(rng, trace)
    plan = solve_with_gap(trace, cons, solver="cpsat", seed=0, gap_limit=0.0)
    alpha = plan.predictions.breakdown["alpha"] if plan.predictions else None
    expected = [
        brute_force(build_instance(trace, lay, cons, CostParams(alpha=alpha) if alpha is not None else None))
        for lay in candidate_layouts(trace)
    ]
    return plan, [e for e in expected if e is not None]


# seeds whose limits leave some layout feasible (2000 + 0 and 2000 + 3 leave none: see the test after this)
@pytest.mark.parametrize("seed", [1, 2, 4, 5])
def test_solve_returns_the_brute_force_optimum_over_all_chunk_sizes(seed: int):
    plan, found = _brute_force_over_layouts(seed)
    assert found, "this seed compares no optimum: pick one whose limits leave a layout feasible"
    assert plan.solver.status.value == "optimal"
    assert plan.solver.gap == 0.0
    assert round(plan.solver.objective * 1e9) == min(found)


@pytest.mark.parametrize("seed", [0, 3])
def test_solve_says_infeasible_when_brute_force_finds_no_layout_that_fits(seed: int):
    plan, found = _brute_force_over_layouts(seed)
    assert not found, "this seed has a feasible layout: pick one whose limits leave none"
    assert plan.solver.status.value == "infeasible"


def clipping(trace):
    """The trace of a job that clips, with the runtime's undo backups (master + Adam's two moments)."""
    w = trace.workload.model_copy(update={"clips_gradients": True, "undo_backup_bytes_per_param": 12})
    return trace.model_copy(update={"workload": w})


@pytest.mark.parametrize(("seed", "overlap"), [(0, True), (1, True), (3, False)])
def test_cpsat_optimum_equals_brute_force_when_the_job_clips(seed: int, overlap: bool):
    # clipping redoes the speculative host steps after backward, and the undo backups take host memory:
    # CP-SAT's iteration and host-memory terms still equal the reference model's
    rng = np.random.default_rng(7000 + seed)
    trace = clipping(random_trace(rng, n_blocks=int(rng.integers(3, 8))))
    cons = limits_between_extremes(rng, trace)
    assert cons.host_memory_bytes is not None  # the host extras (exposed .grad, backups) double the host side
    cons = cons.model_copy(update={"host_memory_bytes": 2 * cons.host_memory_bytes})
    params = CostParams(alpha=0.05, full_duplex=bool(seed % 2), copy_overlap=overlap)
    assert assert_cpsat_matches_brute_force(trace, cons, params, serial=not overlap) >= 1


def test_clipping_charges_the_redo_and_the_undo_backup_in_the_prediction():
    rng = np.random.default_rng(7100)
    trace = random_trace(rng, n_blocks=5)
    clipped = clipping(trace)
    lay = candidate_layouts(trace)[0]
    cons = Constraints(device_memory_bytes=1 << 40, host_memory_bytes=1 << 40)
    plain, clip = build_instance(trace, lay, cons), build_instance(clipped, lay, cons)
    d = Decision(offloaded=(True,) * lay.n_chunks, n_buffers=1, modes=(Mode.keep,) * plain.n_blocks)
    a, b = evaluate_decision(plain, d), evaluate_decision(clip, d)
    assert b.host_redo_ns == a.host_optim_ns > 0 and a.host_redo_ns == 0
    assert b.iteration_ns == a.iteration_ns + a.host_optim_ns
    assert trace.workload.precision.value == "fp32"
    elements = sum(u // 4 for u in lay.used_bytes)
    assert b.host_bytes - a.host_bytes == 12 * elements
