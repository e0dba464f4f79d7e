"""The planner at scale: the O(n log n) sweep is best fit in time order, the segment-tree best fit places
exactly like the quadratic scan, every large plan is valid over two
iterations, a too-short time limit still returns a placement, identical partitions are planned alike, and
the compiled validator and caching-allocator replay agree with reference computations.

Large traces are a real profiled llama iteration replicated (`scaled_traces.replicate_trace`) and random
ones. Speed is measured by `benchmarks/allocation.py --scale`, not asserted here."""

from __future__ import annotations

import bisect

import numpy as np
import pytest

from client.contract import (
    AllocationTrace,
    BandwidthCurves,
    BandwidthSample,
    DeviceType,
    Hardware,
    SolverStatus,
)
from planner_service.solver.allocation import (
    AllocationValidationError,
    Buffer,
    plan_allocation,
    simulate_caching_allocator,
    validate_allocation,
    validate_placement,
)
from planner_service.solver.allocation.caching_allocator import CachingAllocatorSimulator, replay_codes
from planner_service.solver.allocation.greedy import ORDERS, best_fit
from planner_service.solver.allocation.greedy_tree import tree_best_fit
from planner_service.solver.allocation.intervals import partitions, peak_live, trace_arrays
from planner_service.solver.allocation.planner import SEARCH_MAX_BUFFERS
from planner_service.solver.allocation.scaled_traces import random_trace, replicate_trace
from planner_service.solver.allocation.sweep_fit import sweep_best_fit
from planner_service.solver.allocation.trace_check import trace_lower_bound
from planner_service.solver.allocation.treap import (
    NIL,
    new_treap,
    treap_ceiling,
    treap_floor_below,
    treap_insert,
    treap_remove,
)


@pytest.fixture(scope="module")
def profiled() -> AllocationTrace:
    """The allocation trace of one real training iteration of a 2-layer llama (random weights, CPU)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import agent
    from agent.testing import model_zoo

    sample = BandwidthSample(size_bytes=1 << 20, bytes_per_s=1e10)
    # Given, so the profiler skips its bandwidth probe; the allocation trace does not depend on it.
    hardware = Hardware(
        device_type=DeviceType.cpu,
        device_name="test cpu",
        device_count=1,
        device_memory_bytes=8 << 30,
        host_memory_bytes=8 << 30,
        cpu_cores=2,
        bandwidth=BandwidthCurves(h2d_pinned=[sample], d2h_pinned=[sample]),
    )
    torch.manual_seed(0)
    model, config = model_zoo.build("llama", 2, 64, seq=32)
    trace = agent.profile(model, model_zoo.sample_batch(config, 2, 32), repeats=1, hardware=hardware)
    assert trace.allocation_trace is not None
    return trace.allocation_trace


def random_problem(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    lo = rng.permutation(4 * n)[:n]  # distinct start times: no ties for the orders to break differently
    up = lo + rng.integers(1, 40, n)
    sizes = rng.permutation(np.arange(1, 10 * n))[:n]
    return lo.astype(np.int64), up.astype(np.int64), sizes.astype(np.int64)


def test_treap_keeps_keys_in_order_like_a_sorted_list() -> None:
    rng = np.random.default_rng(3)
    k1, k2, pri, left, right, parent, root = new_treap(500)
    reference: list[tuple[int, int, int]] = []
    present: set[int] = set()
    for _ in range(3000):
        slot = int(rng.integers(0, 500))
        if slot in present:
            treap_remove(k1, k2, pri, left, right, parent, root, slot)
            reference.remove((int(k1[slot]), int(k2[slot]), slot))
            present.discard(slot)
        else:
            a, b = int(rng.integers(0, 50)), slot  # k2 = slot keeps keys unique
            treap_insert(k1, k2, pri, left, right, parent, root, slot, a, b)
            bisect.insort(reference, (a, b, slot))
            present.add(slot)
        qa, qb = int(rng.integers(0, 52)), int(rng.integers(-1, 501))
        pos = bisect.bisect_left(reference, (qa, qb, -1))
        expect_ceiling = reference[pos][2] if pos < len(reference) else NIL
        expect_below = reference[pos - 1][2] if pos > 0 else NIL
        assert treap_ceiling(k1, k2, left, right, root, qa, qb) == expect_ceiling
        assert treap_floor_below(k1, k2, left, right, root, qa, qb) == expect_below


def test_sweep_is_best_fit_in_start_order() -> None:
    rng = np.random.default_rng(0)
    for _ in range(5):
        lo, up, sizes = random_problem(rng, 400)
        reference = best_fit(lo.tolist(), up.tolist(), sizes.tolist(), "start")
        assert sweep_best_fit(lo, up, sizes).tolist() == reference


def test_tree_best_fit_places_exactly_like_the_quadratic_scan() -> None:
    rng = np.random.default_rng(7)
    for _ in range(4):
        n = 500  # with ties in start, size and length, so every tie-break is exercised
        lo = rng.integers(0, 300, n)
        up = lo + rng.integers(1, 60, n)
        sizes = rng.integers(1, 50, n)
        for order in ORDERS:
            reference = best_fit(lo.tolist(), up.tolist(), sizes.tolist(), order)
            placed = tree_best_fit(lo, up, sizes, order)
            assert placed is not None and placed.tolist() == reference, order


def test_tree_best_fit_gives_up_at_a_past_deadline() -> None:
    lo = np.arange(1000, dtype=np.int64)
    assert tree_best_fit(lo, lo + 5, np.ones(1000, dtype=np.int64), "size", deadline=0.0) is None


def test_sweep_placements_forwards_and_backwards_are_valid() -> None:
    rng = np.random.default_rng(1)
    lo = rng.integers(0, 5000, 3000)
    up = lo + rng.integers(1, 500, 3000)
    sizes = rng.integers(1, 1000, 3000)
    buffers = [
        Buffer(str(i), int(a), int(b), int(s)) for i, (a, b, s) in enumerate(zip(lo, up, sizes, strict=True))
    ]
    lb = peak_live(lo, up, sizes)
    for reverse in (False, True):
        offsets = sweep_best_fit(lo, up, sizes, reverse=reverse)
        validate_placement(buffers, offsets.tolist())
        assert int((offsets + sizes).max()) >= lb


def test_compiled_validator_agrees_with_pairwise_check() -> None:
    rng = np.random.default_rng(2)
    caught = 0
    for _ in range(40):
        n = 30
        lo = rng.integers(0, 40, n)
        up = lo + rng.integers(1, 10, n)
        sizes = rng.integers(1, 8, n)
        offsets = rng.integers(0, 60, n)
        clash = any(
            lo[i] < up[j]
            and lo[j] < up[i]
            and offsets[i] < offsets[j] + sizes[j]
            and offsets[j] < offsets[i] + sizes[i]
            for i in range(n)
            for j in range(i + 1, n)
        )
        buffers = [Buffer(f"b{i}", int(lo[i]), int(up[i]), int(sizes[i])) for i in range(n)]
        if clash:
            caught += 1
            with pytest.raises(AllocationValidationError, match="overlap"):
                validate_placement(buffers, offsets.tolist())
        else:
            validate_placement(buffers, offsets.tolist())
    assert caught > 5  # the random cases exercised both answers


def test_partitions_split_where_nothing_is_live() -> None:
    lo = np.array([0, 1, 5, 5, 9], dtype=np.int64)
    up = np.array([2, 5, 7, 6, 10], dtype=np.int64)  # [0,2) [1,5) | [5,7) [5,6) | [9,10)
    parts = partitions(lo, up)
    assert parts.count == 3
    assert [parts.of(p).tolist() for p in range(3)] == [[0, 1], [2, 3], [4]]


@pytest.mark.slow  # profiles a real model once for the module (~10-20 s on a shared 2-core machine)
def test_replicated_profiled_trace_keeps_every_buffer(profiled: AllocationTrace) -> None:
    n = len(profiled)
    arr = trace_arrays(profiled)
    long_bytes = int(arr.sizes[arr.long_lived].sum())
    iteration_peak = trace_lower_bound(profiled) - long_bytes
    seq = replicate_trace(profiled, 5)
    assert len(seq) == 5 * n and seq.horizon == 5 * profiled.horizon
    # Copies one after another: the model's states five times, the iteration's peak once.
    assert trace_lower_bound(seq) == 5 * long_bytes + iteration_peak
    deep = replicate_trace(profiled, 5, layout="deep")
    assert len(deep) == 5 * n
    # A deeper model: its activations pile up, so the peak grows beyond one iteration's.
    assert trace_lower_bound(deep) > 5 * long_bytes + iteration_peak


@pytest.mark.slow  # profiles a real model once for the module (~10-20 s on a shared 2-core machine)
def test_deep_scaled_profiled_trace_is_planned_valid_for_repeated_iterations(
    profiled: AllocationTrace,
) -> None:
    copies = SEARCH_MAX_BUFFERS // len(profiled) + 20  # above the search size: the large path
    deep = replicate_trace(profiled, copies, layout="deep")
    plan = plan_allocation(deep, time_limit_s=3.0)
    validate_allocation(deep, plan)
    assert plan.status in (SolverStatus.optimal, SolverStatus.feasible)
    assert plan.gap < 0.02


@pytest.mark.slow  # profiles a real model once for the module (~10-20 s on a shared 2-core machine)
def test_identical_sequential_copies_are_planned_alike(profiled: AllocationTrace) -> None:
    copies = SEARCH_MAX_BUFFERS // len(profiled) + 20
    seq = replicate_trace(profiled, copies)
    # The property holds for a finished plan (done in ~1 s); a tight limit could cut the refinement short
    # while the machine is busy (or numba compiles on first use) and leave copies placed differently.
    plan = plan_allocation(seq, time_limit_s=60.0)
    validate_allocation(seq, plan)
    arr = trace_arrays(seq)
    offsets = {o.id: o.offset_bytes for o in plan.offsets}
    per_copy = len(profiled)
    ll = arr.long_lived
    # Every copy's iteration buffers sit at the same offsets relative to the long-lived stack's top.
    base = int((-(-arr.sizes[ll] // 512) * 512).sum())
    first = [
        offsets[int(i)] - base for i, long in zip(arr.ids[:per_copy], ll[:per_copy], strict=True) if not long
    ]
    for k in (1, copies - 1):
        ids = arr.ids[k * per_copy : (k + 1) * per_copy]
        longs = ll[k * per_copy : (k + 1) * per_copy]
        assert [offsets[int(i)] - base for i, long in zip(ids, longs, strict=True) if not long] == first


def test_too_short_time_limit_still_returns_a_valid_placement() -> None:
    trace = random_trace(30_000, seed=4, mean_live=300)
    plan = plan_allocation(trace, time_limit_s=1e-3)
    assert plan.status == SolverStatus.feasible and plan.arena_bytes >= plan.lower_bound_bytes
    validate_allocation(trace, plan)


def test_large_random_plan_is_valid_and_a_moved_buffer_is_caught() -> None:
    trace = random_trace(100_000, seed=5)
    plan = plan_allocation(trace, time_limit_s=1.0)
    validate_allocation(trace, plan)
    cols = trace.columns
    # Move a short-lived buffer onto another one live at the same time: the validator names both.
    i = next(k for k in range(len(cols.id)) if cols.free_index[k] is not None)
    j = next(
        k
        for k in range(i + 1, len(cols.id))
        if cols.free_index[k] is not None
        and cols.alloc_index[k] < cols.free_index[i]
        and cols.alloc_index[i] < cols.free_index[k]
    )
    broken = plan.model_copy(deep=True)
    broken.offsets[j].offset_bytes = broken.offsets[i].offset_bytes
    with pytest.raises(AllocationValidationError, match="overlap at time"):
        validate_allocation(trace, broken)


def test_compiled_replay_equals_scripted_malloc_and_free() -> None:
    trace = random_trace(3000, seed=6, mean_live=50)
    replayed = simulate_caching_allocator(trace, iterations=2)
    sim = CachingAllocatorSimulator()
    handles: dict[int, int] = {}
    sizes = trace.columns.size_bytes
    for code in replay_codes(trace, 2).tolist():
        if code >= 0:
            handles[code] = sim.malloc(sizes[code])
        else:
            sim.free(handles.pop(-1 - code))
    assert sim.report(iterations=2) == replayed
