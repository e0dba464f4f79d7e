"""Multi-rank planning (issue 20): collectives in the cost model, sharding as a decision, per-node host RAM.

CP-SAT finds exactly the brute-force optimum over placements, sharding, buffers and modes at world sizes 2
and 4 (overlapped and serial copies, measured overlap factors 0, 0.5 and 1); the vectorised timer agrees with
the reference cost model; hand-computed figures pin the formulas.
"""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from client.contract import Constraints
from planner_service.solver.chunk_grid import candidate_layouts
from planner_service.solver.cost_model import activation_peak, evaluate_decision, iteration_ns_batch
from planner_service.solver.cpsat_solve import solve_layout
from planner_service.solver.instance import CostParams, Decision, Mode, PolicyInstance, build_instance
from planner_service.solver.testing.synthetic import synthetic_distributed, with_distributed
from tests.planner_service.solver.test_policy_bruteforce import limits_between_extremes, random_trace

MiB = 2**20


def shardings(off: tuple[bool, ...]) -> list[tuple[bool, ...]]:
    """Every sharding of the chunks (an offloaded chunk may be sharded or replicated too)."""
    return list(itertools.product((False, True), repeat=len(off)))


def brute_force(inst: PolicyInstance) -> int | None:
    """Minimum iteration ns over placements, shardings, buffer counts and modes (None: nothing fits)."""
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
    pinned_cap = inst.pinned_limit_bytes if inst.pinned_limit_bytes is not None else 2**62
    best: int | None = None
    C = inst.n_chunks
    for off in itertools.product((False, True), repeat=C):
        for sh in shardings(off):
            n_buf = sum(o or s for o, s in zip(off, sh, strict=True))
            for nb in range(1, n_buf + 1) if n_buf else (0,):
                dev = sum(
                    inst.shard_state_bytes_of[c] if sh[c] else inst.state_bytes(c)
                    for c in range(C)
                    if not off[c]
                )
                host = sum(
                    inst.shard_host_bytes_of[c] if sh[c] else inst.host_bytes(c) for c in range(C) if off[c]
                )
                pinned = sum(
                    inst.shard_state_bytes_of[c] if sh[c] else inst.state_bytes(c) for c in range(C) if off[c]
                )
                ok = (
                    (dev + nb * inst.buffer_bytes + act_peak <= inst.usable_device_bytes)
                    & (inst.ranks_per_node * (host + swapped) <= inst.host_limit_bytes)
                    & (pinned + swapped <= pinned_cap)
                )
                if not ok.any():
                    continue
                t = int(iteration_ns_batch(inst, off, nb, M[ok], sh).min())
                best = t if best is None else min(best, t)
    return best


def _multi_rank(rng: np.random.Generator, world: int, per_node: int, overlap: float, n_blocks: int):
    base = random_trace(rng, n_blocks=n_blocks)
    # collectives between 0.3x and 3x the copy rate: sometimes hidden, sometimes the bottleneck
    rate = float(rng.uniform(0.3, 3.0)) * base.hardware.bandwidth.h2d_pinned[0].bytes_per_s
    trace = with_distributed(
        base,
        synthetic_distributed(
            world, per_node, collective_bytes_per_s=rate, overlap_factor=overlap, flat=True
        ),
    )
    cons = limits_between_extremes(rng, trace)
    # the host limit is the node's: R ranks each holding 1/N of what one process would
    assert cons.host_memory_bytes is not None
    return trace, cons.model_copy(update={"host_memory_bytes": cons.host_memory_bytes * per_node // world})


CASES = [  # (seed, world size, ranks per node, overlap factor, copies overlap compute, full duplex)
    (0, 2, 2, 1.0, True, True),
    (1, 2, 2, 0.0, True, False),
    (3, 4, 2, 0.5, True, True),
    (6, 4, 4, 1.0, True, False),
    (1, 2, 1, 0.5, True, True),
    (0, 2, 2, 1.0, False, True),
    (6, 4, 2, 0.0, False, False),
]


@pytest.mark.parametrize(("seed", "world", "per_node", "overlap", "copy_overlap", "duplex"), CASES)
def test_cpsat_optimum_equals_brute_force_at_world_sizes_2_and_4(  # noqa: PLR0913
    seed: int, world: int, per_node: int, overlap: float, copy_overlap: bool, duplex: bool
) -> None:
    rng = np.random.default_rng(7000 + seed)
    trace, cons = _multi_rank(rng, world, per_node, overlap, n_blocks=int(rng.integers(3, 6)))
    params = CostParams(alpha=0.05, full_duplex=duplex, copy_overlap=copy_overlap)
    compared = 0
    for lay in candidate_layouts(trace):
        if 4**lay.n_chunks * 3 ** (len(trace.model.blocks) - 2) > 20_000:
            continue
        inst = build_instance(trace, lay, cons, params)
        assert inst.world_size == world and inst.ranks_per_node == per_node
        expected = brute_force(inst)
        got = solve_layout(inst, hint=None, time_limit_s=60, seed=0, gap_limit=0.0)
        if expected is None:
            assert got.status == "infeasible"
            continue
        assert got.status == "optimal" and got.cost is not None and got.cost.fits
        assert got.cost.iteration_ns == expected
        compared += 1
    assert compared >= 1, "this case compares no optimum: pick limits that leave a layout feasible"


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("copy_overlap", [True, False])
def test_vectorised_timer_agrees_with_the_cost_model(world: int, copy_overlap: bool) -> None:
    rng = np.random.default_rng(world)
    trace, cons = _multi_rank(rng, world, 2, 0.4, n_blocks=7)
    pick = random.Random(world)
    for lay in candidate_layouts(trace):
        inst = build_instance(trace, lay, cons, CostParams(copy_overlap=copy_overlap))
        for _ in range(40):
            off = tuple(pick.random() < 0.4 for _ in range(inst.n_chunks))
            sh = tuple(o or pick.random() < 0.5 for o in off)
            nb = pick.randint(1, max(1, sum(sh))) if any(sh) else 0
            modes = tuple(
                Mode(pick.randint(0, 2)) if inst.optimisable[b] else Mode.keep for b in range(inst.n_blocks)
            )
            want = evaluate_decision(inst, Decision(off, nb, modes, sh)).iteration_ns
            assert int(iteration_ns_batch(inst, off, nb, np.array([modes]), sh)[0]) == want


# ------------------------------------------------------------------------------- hand-computed figures
# Two blocks of 100 MB fp32 parameters (Adam: 16 bytes of state per 4-byte element), one chunk each; copies
# 10 GB/s each way, collectives `rate` (flat), forward 10 ms, backward 20 ms; the host optimizer 1 GB/s and
# the device one 100 GB/s of parameter bytes. World size 2, both ranks on one node.
MB = 10**6
ms = 10**6  # ns


def _hand(rate: float = 50e9, overlap: float = 1.0, world: int = 2, per_node: int = 2, **kw):  # type: ignore[no-untyped-def]
    from planner_service.solver.testing.synthetic import BlockSpec, hand_trace

    specs = [
        BlockSpec(100 * MB, 0.010, 0.020, 0.010, activation_bytes=50 * MB, input_bytes=MB) for _ in range(2)
    ]
    trace = hand_trace(specs, **kw)
    if world > 1:
        trace = with_distributed(
            trace,
            synthetic_distributed(
                world, per_node, collective_bytes_per_s=rate, overlap_factor=overlap, flat=True
            ),
        )
    return trace


def _inst(trace, **cons):  # type: ignore[no-untyped-def]
    from planner_service.solver.chunk_grid import pack

    layout = pack(trace, 128 * MiB)
    assert layout.n_chunks == 2
    return build_instance(
        trace, layout, Constraints(device_memory_bytes=8 * 2**30, **cons), CostParams(alpha=0.0)
    )


KEEP = (Mode.keep, Mode.keep)


def test_instance_constants_are_the_hand_computed_shards_and_collectives() -> None:
    inst = _inst(_hand())
    assert inst.gather_ns == (2 * ms, 2 * ms)  # 100 MB all-gathered at 50 GB/s
    assert inst.reduce_scatter_ns == (2 * ms, 2 * ms)  # 100 MB of fp32 gradient
    assert inst.all_reduce_ns == (4 * ms, 4 * ms)  # reduce-scatter + all-gather
    assert inst.shard_upload_ns == (5 * ms, 5 * ms)  # 50 MB shard at 10 GB/s
    assert inst.shard_grad_offload_ns == (5 * ms, 5 * ms)
    assert inst.shard_host_optim_ns == (50 * ms, 50 * ms)  # 50 MB of shard at 1 GB/s
    assert inst.shard_device_optim_ns == (ms // 2, ms // 2)
    assert inst.state_bytes(0) == 400 * MB and inst.shard_state_bytes_of == (200 * MB, 200 * MB)
    # + the exposed 4-byte .grad and the 4-byte gradient staging buffer per element (counted for every
    # offloaded chunk since the pinned arena, issue 19 defect 8)
    assert inst.shard_host_bytes_of == (300 * MB, 300 * MB)
    assert inst.collective_overlap_permille == 1000


def test_sharded_persistent_chunks_gathered_once_count_their_collectives() -> None:
    inst = _inst(_hand())
    cost = evaluate_decision(inst, Decision((False, False), 2, KEEP, (True, True)))
    # forward: gather chunk 0 (2 ms, exposed), window 0 hides the gather of chunk 1 behind 10 ms, window 1
    assert cost.forward_ns == 2 * ms + 10 * ms + 10 * ms
    # backward: both chunks still in the two buffers; chunk 1's reduce-scatter hides in window 0, chunk 0's
    # (2 ms) has no window after it
    assert cost.backward_ns == 20 * ms + 20 * ms + 2 * ms
    assert cost.device_optim_ns == ms  # two half-chunk shards
    assert cost.iteration_ns == 22 * ms + 42 * ms + ms
    assert (cost.forward_collective_ns, cost.backward_collective_ns) == (4 * ms, 4 * ms)
    # one rank's device: two 200 MB shards + two full 128 MiB buffers (compute copy + gradient)
    assert cost.static_device_bytes == 400 * MB + 2 * (2 * 128 * MiB)


def test_slow_collectives_are_exposed_where_compute_cannot_hide_them() -> None:
    inst = _inst(_hand(rate=5e9))  # 20 ms a collective, longer than a 10 ms forward window
    cost = evaluate_decision(inst, Decision((False, False), 2, KEEP, (True, True)))
    assert cost.forward_ns == 20 * ms + 20 * ms + 10 * ms
    assert cost.backward_ns == 20 * ms + 20 * ms + 20 * ms
    # replicated chunks: no gathers, each gradient all-reduced (40 ms) after its backward
    rep = evaluate_decision(inst, Decision((False, False), 0, KEEP, (False, False)))
    assert rep.forward_ns == 20 * ms
    assert rep.backward_ns == max(20 * ms, 40 * ms) + 20 * ms + 40 * ms
    assert rep.device_optim_ns == 2 * ms and rep.static_device_bytes == 800 * MB


def test_offloaded_shards_with_one_buffer_and_the_host_queue() -> None:
    inst = _inst(_hand())
    cost = evaluate_decision(inst, Decision((True, True), 1, KEEP, (True, True)))
    # forward: fetch chunk 0 (5 ms shard upload, then 2 ms gather); one buffer: chunk 1's fetch waits for
    # window 0's compute (10 + 7)
    assert cost.forward_ns == 7 * ms + 17 * ms + 10 * ms
    # backward: chunk 1 is still in the buffer; window 1 (chunk 1) computes, then window 0 refetches chunk 0
    # after it (one buffer: 20 + 7); chunk 0's reduce-scatter is exposed (2 ms)
    assert cost.backward_ns == 20 * ms + 27 * ms + 2 * ms
    # host: chunk 1's shard arrives at 27 + 2 + 5 ms and both 50 ms shard steps queue behind it
    assert cost.host_end_ns == 34 * ms + 100 * ms
    assert cost.iteration_ns == 34 * ms + 134 * ms
    # two 300 MB shards (states, exposed .grad, gradient staging; see the instance test) on each of 2 ranks
    assert cost.host_bytes == 600 * MB and cost.host_node_bytes == 1200 * MB


@pytest.mark.parametrize(("overlap", "window_ms"), [(1.0, 10.0), (0.5, 12.5), (0.0, 15.0)])
def test_measured_overlap_of_collectives_and_copies_sets_the_window(overlap: float, window_ms: float) -> None:
    # block 0 swapped: its 50 MB go out (5 ms D2H) while chunk 1 is gathered (10 ms at 10 GB/s)
    inst = _inst(_hand(rate=10e9, overlap=overlap))
    assert inst.collective_overlap_permille == round(1000 * overlap)
    cost = evaluate_decision(inst, Decision((False, False), 2, (Mode.swap, Mode.keep), (True, True)))
    # head gather 10 ms + window 0: max(10, chain 10, 5 + (1-f) 10, 10 + (1-f) 5) + window 1 10 ms
    assert cost.forward_ns == round((10 + window_ms + 10) * ms)


def test_host_memory_is_the_nodes_shared_by_its_ranks() -> None:
    limit = 999 * MB  # one rank's 500 MB of offloaded shards fits; two ranks on a node (1000 MB) do not
    two_per_node = _inst(_hand(per_node=2), host_memory_bytes=limit)
    one_per_node = _inst(_hand(per_node=1), host_memory_bytes=limit)
    d = Decision((True, True), 1, KEEP, (True, True))
    assert not evaluate_decision(two_per_node, d).fits_host
    assert evaluate_decision(one_per_node, d).fits_host
    # and the solver sees it: two ranks per node keep a chunk on the device instead
    got = solve_layout(two_per_node, hint=None, time_limit_s=30, seed=0, gap_limit=0.0)
    assert got.decision is not None and got.cost is not None and got.cost.host_node_bytes <= limit
    assert not all(got.decision.offloaded)


def test_a_single_rank_trace_rejects_a_sharding() -> None:
    inst = _inst(_hand(world=1))
    with pytest.raises(ValueError, match="sharded: a single-rank job shards nothing"):
        evaluate_decision(inst, Decision((False, False), 1, KEEP, (True, True)))


def test_an_offloaded_replicated_chunk_moves_and_steps_the_whole_chunk() -> None:
    inst = _inst(_hand())
    cost = evaluate_decision(inst, Decision((True, True), 1, KEEP, (False, False)))
    # forward: the whole 100 MB uploaded (10 ms), no gather; one buffer: chunk 1 waits for window 0
    assert cost.forward_ns == 10 * ms + (10 + 10) * ms + 10 * ms
    # backward: window 0 all-reduces chunk 1's gradient (4 ms) then copies it out whole (10 ms), hidden in
    # 20 ms; window 1 refetches chunk 0 after its compute (one buffer: 20 + 10); chunk 0's all-reduce exposed
    assert cost.backward_ns == 20 * ms + 30 * ms + 4 * ms
    assert cost.host_optim_ns == 200 * ms  # two whole 100 MB steps at 1 GB/s
    assert (
        cost.host_bytes == 2 * 600 * MB and cost.host_node_bytes == 2400 * MB
    )  # whole chunks, incl. staging


# ------------------------------------------------------------------------------------ whole plans
def _plans(device_mib: int, solver: str = "cpsat"):  # type: ignore[no-untyped-def]
    from planner_service.solver.entry import solve_with_gap
    from planner_service.solver.testing.synthetic import synthetic_trace

    base = synthetic_trace(n_blocks=6, hidden=512, heads=8, batch=4, seq=512, vocab=8000)
    cons = Constraints(device_memory_bytes=device_mib * MiB, host_memory_bytes=4 * 2**30)
    out = {}
    for world in (1, 2, 4):
        trace = base if world == 1 else with_distributed(base, synthetic_distributed(world))
        out[world] = (trace, cons, solve_with_gap(trace, cons, solver=solver, seed=0, gap_limit=0.0))
    return out


def _offloaded_fraction(policy) -> float:  # type: ignore[no-untyped-def]
    total = sum(c.used_bytes for c in policy.chunks)
    return sum(c.used_bytes for c in policy.chunks if c.placement.value == "offloaded") / total


@pytest.mark.parametrize("solver", ["cpsat", "protrain"])
def test_sharding_keeps_more_on_each_ranks_device_and_the_plan_is_faster(solver: str) -> None:
    from planner_service.solver.cost_model import evaluate

    plans = _plans(300, solver)
    offloaded = {}
    for world, (trace, cons, plan) in plans.items():
        assert plan.policy is not None and plan.predictions is not None, plan.solver.message
        assert plan.policy.world_size == world
        assert bool(plan.policy.sharded_chunks) == (world > 1)
        # the wire policy evaluates back to the plan's predictions (sharding and world size included)
        assert evaluate(trace, plan.policy, cons, None).iteration_s == pytest.approx(
            plan.predictions.iteration_s
        )
        offloaded[world] = _offloaded_fraction(plan.policy)
    t = {w: p.predictions.iteration_s for w, (_, _, p) in plans.items()}  # type: ignore[union-attr]
    # one rank of 300 MiB cannot hold the model's states: it offloads; 1/2 and 1/4 of them fit
    assert offloaded[1] > offloaded[2] >= offloaded[4] and offloaded[4] == 0.0
    assert t[1] > t[2] > t[4]
    b = plans[2][2].predictions.breakdown  # type: ignore[union-attr]
    assert b["world_size"] == 2.0 and b["forward_collective_s"] > 0 and b["backward_collective_s"] > 0


def test_with_room_for_everything_communication_is_not_free() -> None:
    plans = _plans(700)
    one, two = plans[1][2], plans[2][2]
    assert one.policy is not None and not any(c.placement.value == "offloaded" for c in one.policy.chunks)
    assert "world_size" not in one.predictions.breakdown  # type: ignore[union-attr]
    # the same per-rank work plus gathers/reductions: no faster per iteration than one rank alone
    assert two.predictions.iteration_s >= one.predictions.iteration_s  # type: ignore[union-attr]
