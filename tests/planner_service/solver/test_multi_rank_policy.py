"""Multi-rank planning (issue 20): collectives in the cost model, sharding as a decision, per-node host RAM.

The model is ZeRO-Offload style (docs/architecture/solver.md, "Multi-rank jobs"): only offloaded chunks may be
sharded; a sharded chunk is uploaded whole, its gradient reduce-scattered and its shard copied out and stepped
on the host; at step() its private compute copy is all-gathered (several nodes), or, where every rank is on one
node and the ranks share one compute copy per chunk, one barrier runs instead. CP-SAT finds exactly the
brute-force optimum over placements, sharding of the offloaded chunks, buffers and modes at world sizes 2 and 4
(one node and several, overlapped and serial copies, measured overlap factors 0, 0.5 and 1, with and without
clipping's redone host steps and a pinned limit); the vectorised timer agrees with the reference cost model;
hand-computed figures pin the formulas.
"""

from __future__ import annotations

import dataclasses
import itertools
import random

import numpy as np
import pytest

from client.contract import Constraints, Trace, Workload
from planner_service.solver.chunk_grid import candidate_layouts, pack
from planner_service.solver.cost_model import Cost, activation_peak, evaluate_decision, iteration_ns_batch
from planner_service.solver.cpsat_solve import solve_layout
from planner_service.solver.instance import CostParams, Decision, Mode, PolicyInstance, build_instance
from planner_service.solver.protrain import search
from planner_service.solver.testing.synthetic import synthetic_distributed, with_distributed
from tests.planner_service.solver.test_policy_bruteforce import limits_between_extremes, random_trace

MiB = 2**20


def shardings(off: tuple[bool, ...], *, device: bool = True) -> list[tuple[bool, ...]]:
    """Every sharding of the chunks (each sharded or replicated; a persistent one sharded on the device, ZeRO-3,
    unless `device` is False)."""
    out = []
    for pick in itertools.product((False, True), repeat=len(off) if device else sum(off)):
        if device:
            out.append(tuple(pick))
            continue
        it = iter(pick)
        out.append(tuple(next(it) if o else False for o in off))
    return out


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
            n_buf = sum(off)
            for nb in range(inst.min_buffers(off), n_buf + 1) if n_buf else (0,):
                dsh = [sh[c] and not off[c] for c in range(C)]
                dev = sum(
                    inst.device_shard_bytes_of[c] if dsh[c] else inst.state_bytes(c)
                    for c in range(C)
                    if not off[c]
                ) + 2 * max([inst.device_gather_bytes_of[c] for c in range(C) if dsh[c]], default=0)
                host = sum(
                    inst.shard_host_bytes_of[c] if sh[c] else inst.host_bytes(c) for c in range(C) if off[c]
                )
                pinned = sum(
                    inst.shard_pinned_bytes_of[c] if sh[c] else inst.pinned_bytes(c)
                    for c in range(C)
                    if off[c]
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


def cpsat_equals_brute_force(inst: PolicyInstance) -> bool:
    """CP-SAT's optimum is the brute force's, and the cost model's of CP-SAT's decision; False when nothing fits
    (CP-SAT then says infeasible), True when an optimum was compared."""
    expected = brute_force(inst)
    got = solve_layout(inst, hint=None, time_limit_s=60, seed=0, gap_limit=0.0)
    if expected is None:
        assert got.status == "infeasible"
        return False
    assert got.status == "optimal" and got.cost is not None and got.cost.fits and got.decision is not None
    assert got.cost.iteration_ns == expected
    assert evaluate_decision(inst, got.decision).iteration_ns == expected
    return True


def _clipping(trace: Trace) -> Trace:
    """The job clips its gradients and keeps undo backups: speculative host steps are redone at step()."""
    w = trace.workload.model_dump() | {"clips_gradients": True, "undo_backup_bytes_per_param": 12}
    return trace.model_copy(update={"workload": Workload.model_validate(w)})


def _multi_rank(rng: np.random.Generator, world: int, per_node: int, overlap: float, n_blocks: int):  # type: ignore[no-untyped-def]
    base = random_trace(rng, n_blocks=n_blocks)
    # collectives between 0.3x and 3x the copy rate: sometimes hidden, sometimes the bottleneck
    rate = float(rng.uniform(0.3, 3.0)) * base.hardware.bandwidth.h2d_pinned[0].bytes_per_s
    # the flat curve's one sample at 4 MiB: a one-node job's barrier (that sample's time) is about a chunk's gather
    trace = with_distributed(
        base,
        synthetic_distributed(
            world,
            per_node,
            collective_bytes_per_s=rate,
            overlap_factor=overlap,
            flat=True,
            flat_sample_bytes=4 * MiB,
        ),
    )
    cons = limits_between_extremes(rng, trace)
    # the host limit is the node's: R ranks each holding about 1/N of what one process would
    assert cons.host_memory_bytes is not None
    return trace, cons.model_copy(update={"host_memory_bytes": cons.host_memory_bytes * per_node // world})


CASES = [  # (seed, world size, ranks per node, overlap factor, copies overlap compute, full duplex, clipping)
    (0, 2, 2, 1.0, True, True, False),
    (1, 2, 2, 0.0, True, False, True),
    (3, 4, 2, 0.5, True, True, False),
    (6, 4, 4, 1.0, True, False, True),
    (1, 2, 1, 0.5, True, True, False),
    (0, 2, 2, 1.0, False, True, True),
    (6, 4, 2, 0.0, False, False, False),
    (7, 4, 1, 0.5, True, True, True),
    (7, 4, 4, 0.0, False, True, False),
]


@pytest.mark.parametrize(("seed", "world", "per_node", "overlap", "copy_overlap", "duplex", "clip"), CASES)
def test_cpsat_optimum_equals_brute_force_at_world_sizes_2_and_4(  # noqa: PLR0913
    seed: int, world: int, per_node: int, overlap: float, copy_overlap: bool, duplex: bool, clip: bool
) -> None:
    rng = np.random.default_rng(7000 + seed)
    trace, cons = _multi_rank(rng, world, per_node, overlap, n_blocks=int(rng.integers(3, 6)))
    if clip:
        trace = _clipping(trace)
        # a pinned limit that binds sometimes: between one sharded and one replicated chunk's pinned bytes
        cons = cons.model_copy(update={"pinned_memory_bytes": int(cons.host_memory_bytes * 0.3)})  # type: ignore[operator]
    params = CostParams(alpha=0.05, full_duplex=duplex, copy_overlap=copy_overlap)
    compared = 0
    for lay in candidate_layouts(trace):
        if 4**lay.n_chunks * 3 ** (len(trace.model.blocks) - 2) > 20_000:
            continue
        inst = build_instance(trace, lay, cons, params)
        assert inst.world_size == world and inst.ranks_per_node == per_node
        # one node: node-shared compute copies, one barrier per step; several nodes: all-gathers
        assert inst.compute_copy_shared == (per_node == world)
        assert (inst.step_barrier_ns > 0) == inst.compute_copy_shared == (not any(inst.gather_ns))
        assert inst.redo_host_steps == clip
        expected = brute_force(inst)
        got = solve_layout(inst, hint=None, time_limit_s=60, seed=0, gap_limit=0.0)
        if expected is None:
            assert got.status == "infeasible"
            continue
        assert got.status == "optimal" and got.cost is not None and got.cost.fits
        assert got.cost.iteration_ns == expected
        assert got.decision is not None
        # the solver's own cost is the cost model's of its decision (persistent chunks may be sharded on the device)
        assert evaluate_decision(inst, got.decision).iteration_ns == got.cost.iteration_ns
        compared += 1
    assert compared >= 1, "this case compares no optimum: pick limits that leave a layout feasible"


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("copy_overlap", [True, False])
@pytest.mark.parametrize("clip", [False, True])
def test_vectorised_timer_agrees_with_the_cost_model(world: int, copy_overlap: bool, clip: bool) -> None:
    rng = np.random.default_rng(world)
    trace, cons = _multi_rank(rng, world, 2, 0.4, n_blocks=7)
    if clip:
        trace = _clipping(trace)
    pick = random.Random(world)
    for lay in candidate_layouts(trace):
        inst = build_instance(trace, lay, cons, CostParams(copy_overlap=copy_overlap))
        assert_timer_agrees(inst, pick, 40)


def assert_timer_agrees(inst: PolicyInstance, pick: random.Random, n: int) -> None:
    """The vectorised timer equals the cost model on `n` random decisions (placements, sharding, buffers, modes)."""
    for _ in range(n):
        off = tuple(pick.random() < 0.6 for _ in range(inst.n_chunks))
        sh = tuple(o and pick.random() < 0.6 for o in off)
        nb = pick.randint(1, sum(off)) if any(off) else 0
        modes = tuple(
            Mode(pick.randint(0, 2)) if inst.optimisable[b] else Mode.keep for b in range(inst.n_blocks)
        )
        want = evaluate_decision(inst, Decision(off, nb, modes, sh)).iteration_ns
        assert int(iteration_ns_batch(inst, off, nb, np.array([modes]), sh)[0]) == want


# ------------------------------------------------------------------------------- hand-computed figures
# Blocks of 100 MB fp32 parameters (Adam: 16 bytes of state per 4-byte element), one chunk each; copies
# 10 GB/s each way, collectives `rate` (flat), forward 10 ms, backward 20 ms; the host optimizer 1 GB/s and
# the device one 100 GB/s of parameter bytes. World size 2, both ranks on one node.
MB = 10**6
ms = 10**6  # ns


def _hand(  # noqa: PLR0913
    rate: float = 50e9,
    overlap: float = 1.0,
    world: int = 2,
    per_node: int = 2,
    n_blocks: int = 2,
    sample_bytes: int = 1,
    **kw,
):  # type: ignore[no-untyped-def]
    from planner_service.solver.testing.synthetic import BlockSpec, hand_trace

    specs = [
        BlockSpec(100 * MB, 0.010, 0.020, 0.010, activation_bytes=50 * MB, input_bytes=MB)
        for _ in range(n_blocks)
    ]
    trace = hand_trace(specs, **kw)
    if world > 1:
        trace = with_distributed(
            trace,
            synthetic_distributed(
                world,
                per_node,
                collective_bytes_per_s=rate,
                overlap_factor=overlap,
                flat=True,
                flat_sample_bytes=sample_bytes,
            ),
        )
    return trace


def _inst(trace, **cons):  # type: ignore[no-untyped-def]
    layout = pack(trace, 128 * MiB)
    assert layout.n_chunks == len(trace.model.blocks)
    return build_instance(
        trace, layout, Constraints(device_memory_bytes=8 * 2**30, **cons), CostParams(alpha=0.0)
    )


KEEP = (Mode.keep, Mode.keep)


def test_instance_constants_are_the_hand_computed_shards_and_collectives() -> None:
    inst = _inst(_hand(per_node=1))  # two nodes: each rank keeps a private compute copy
    assert not inst.compute_copy_shared and inst.step_barrier_ns == 0
    assert inst.gather_ns == (2 * ms, 2 * ms)  # the 100 MB compute copy all-gathered at 50 GB/s
    # the exposed .grad: the 100 MB (fp32 here) of every rank's averaged gradient shard, all-gathered before
    # the shard's host step (the runtime's `HostSteps.fill_user_grad`)
    assert inst.grad_fill_ns == (2 * ms, 2 * ms)
    assert inst.reduce_scatter_ns == (2 * ms, 2 * ms)  # 100 MB of fp32 gradient
    assert inst.all_reduce_ns == (4 * ms, 4 * ms)  # reduce-scatter + all-gather
    assert inst.upload_ns == (10 * ms, 10 * ms)  # a sharded chunk is uploaded whole, as a replicated one
    assert inst.shard_grad_offload_ns == (5 * ms, 5 * ms)  # the rank's 50 MB of gradient
    assert inst.shard_host_optim_ns == (50 * ms, 50 * ms)  # 50 MB of shard at 1 GB/s
    # a whole offloaded chunk: 24 bytes per element (4 compute copy, 4 gradient, 8 Adam state, 4 exposed
    # .grad, 4 gradient staging); sharded, the compute copy and .grad stay whole on every rank (25M elements
    # * 8 bytes) and the other 16 bytes per element are the rank's 12.5M-element shard
    assert inst.host_bytes(0) == 600 * MB
    assert inst.shard_host_bytes_of == (400 * MB, 400 * MB)
    # pinned: the whole compute copy (100 MB), the shard's staging buffer and, with no separate fp32 master,
    # its host gradient (50 MB each); a replicated chunk pins 3 x 100 MB
    assert inst.pinned_bytes(0) == 300 * MB and inst.shard_pinned_bytes_of == (200 * MB, 200 * MB)
    assert inst.collective_overlap_permille == 1000


def test_a_shard_is_a_multiple_of_4_elements_of_the_padded_chunk() -> None:
    from client.contract import shard_elements  # local import: as the tests beside it, one name per test

    assert shard_elements(10, 4) == 4  # ceil(10 / 4) = 3, aligned to 4: the last shard is padding only
    assert shard_elements(16, 4) == 4 and shard_elements(17, 4) == 8 and shard_elements(8, 2) == 4
    # 12 + 4 = 16-byte (fp32) fragments of 100 MB + 4 bytes of parameters over 3 ranks
    s = shard_elements(25_000_000, 3)
    assert s == 8_333_336
    # three nodes: the .grad and a private compute copy whole (3 s elements of 4 bytes each), the rest a shard
    assert _inst(_hand(world=3, per_node=1)).shard_host_bytes_of[0] == 3 * s * 8 + s * 16
    # one node: the .grad whole, the rank's share of the node's one compute copy (one shard), the rest a shard
    assert _inst(_hand(world=3, per_node=3)).shard_host_bytes_of[0] == 3 * s * 4 + s * 4 + s * 16


def test_mixed_precision_shard_bytes_follow_what_the_runtime_keeps_per_rank() -> None:
    from client.contract import shard_elements  # local import: as the tests beside it, one name per test
    from planner_service.solver.testing.synthetic import synthetic_trace

    base = synthetic_trace(n_blocks=4, hidden=256, heads=4, batch=2, seq=128, vocab=1000)
    w = base.workload
    assert (w.precision.value, w.gradient_bytes_per_param, w.master_bytes_per_param) == ("bf16", 2, 4)
    trace = with_distributed(_clipping(base), synthetic_distributed(4, 2))
    inst = build_instance(
        trace, candidate_layouts(trace)[0], Constraints(device_memory_bytes=2**30), CostParams(alpha=0.0)
    )
    for c, used in enumerate(inst.layout.used_bytes):
        s = shard_elements(used // 2, 4)
        # whole on every rank: bf16 compute copy + bf16 exposed .grad; per rank's shard: fp32 host gradient,
        # fp32 master, optimizer state, bf16 gradient staging, undo backup
        rest = 4 + 4 + w.optimizer_state_bytes_per_param + 2 + 12
        assert inst.shard_host_bytes_of[c] == 4 * s * (2 + 2) + s * rest
        # pinned: the whole compute copy and the shard's staging buffer (the fp32 host gradient is not pinned)
        assert inst.shard_pinned_bytes_of[c] == 4 * s * 2 + s * 2


def test_a_persistent_chunk_sharded_on_the_device_holds_its_shards_and_two_gathered_copies() -> None:
    """ZeRO-3 on the device (`agent/runtime/device_shards.py`): a persistent chunk sharded across 2 ranks keeps its
    shard of the compute copy and the optimizer state (fp32, no separate master: 4 + 8 bytes per element of
    12.5M) and the whole gradient (25M x 4 bytes); the whole copies while gathered (the one in use and the next,
    prefetched: twice the largest, 2 x 100 MB) are static bytes; it steps its shard on the device, its gradient
    is all-reduced as a replicated one's, and its two all-gathers per iteration (forward and backward, 100 MB at
    50 GB/s: 2 ms each) hide behind compute where collectives overlap (factor 1) and add up without overlap."""
    from planner_service.solver.cost_model import evaluate
    from planner_service.solver.entry import policy_of

    inst = _inst(_hand())
    assert inst.device_shard_bytes_of == (250 * MB, 250 * MB)
    assert inst.device_gather_bytes_of == (100 * MB, 100 * MB) and inst.device_gather_ns == (2 * ms, 2 * ms)
    both = evaluate_decision(inst, Decision((False, False), 0, KEEP, (True, True)))
    replicated = evaluate_decision(inst, Decision((False, False), 0, KEEP, (False, False)))
    assert (
        both.static_device_bytes == 2 * 250 * MB + 2 * 100 * MB < replicated.static_device_bytes == 800 * MB
    )
    # one chunk sharded alone saves nothing: its 150 MB are less than the two gathered copies it adds
    one = evaluate_decision(inst, Decision((False, False), 0, KEEP, (True, False)))
    assert one.static_device_bytes == 250 * MB + 400 * MB + 200 * MB
    assert both.device_optim_ns == replicated.device_optim_ns // 2 == 1 * ms
    assert both.backward_ns == replicated.backward_ns and both.device_gather_ns == 0
    assert both.iteration_ns == replicated.iteration_ns - 1 * ms
    serial = build_instance(
        _hand(),
        pack(_hand(), 128 * MiB),
        Constraints(device_memory_bytes=8 * 2**30),
        CostParams(copy_overlap=False),
    )
    assert (
        evaluate_decision(serial, Decision((False, False), 0, KEEP, (True, True))).device_gather_ns == 8 * ms
    )
    # through the wire: a policy with persistent sharded chunks evaluates to the same figures
    trace = _hand()
    policy = policy_of(trace, inst.layout, Decision((False, False), 0, KEEP, (True, True)))
    assert all(c.sharded for c in policy.chunks)
    got = evaluate(trace, policy, Constraints(device_memory_bytes=8 * 2**30))
    assert got.peak_device_bytes == both.peak_device_bytes


def test_cpsat_shards_persistent_chunks_on_the_device_when_device_memory_is_short() -> None:
    """Host memory too small to offload anything, device memory short of the replicated chunks but enough for
    their shards: CP-SAT (and ProTrain) shard both persistent chunks on the device; with room, neither needs to
    (sharding is then only the shard's shorter device step: 1 ms faster)."""
    limit = 700 * MB + 300 * MB  # the two chunks' shards and gathered copies, and the activations' peak
    inst = _inst(_hand(), host_memory_bytes=10 * MB)
    inst = build_instance(
        _hand(),
        inst.layout,
        Constraints(device_memory_bytes=limit, host_memory_bytes=10 * MB),
        CostParams(alpha=0.0),
    )
    got = solve_layout(inst, hint=None, time_limit_s=30, seed=0, gap_limit=0.0)
    assert got.status == "optimal" and got.decision is not None and got.cost is not None
    assert got.decision.offloaded == (False, False) and got.decision.sharded == (True, True)
    assert got.cost.static_device_bytes == 700 * MB
    pro = search(inst)
    assert pro.decision is not None and pro.decision.sharded == (True, True)
    assert pro.cost is not None and pro.cost.iteration_ns == got.cost.iteration_ns


def test_persistent_chunks_are_replicated_and_all_reduced() -> None:
    inst = _inst(_hand())
    cost = evaluate_decision(inst, Decision((False, False), 0, KEEP, (False, False)))
    # forward: no collectives; backward: window 0 hides chunk 1's all-reduce (4 ms), chunk 0's is exposed
    assert cost.forward_ns == 20 * ms
    assert cost.backward_ns == 20 * ms + 20 * ms + 4 * ms
    assert cost.device_optim_ns == 2 * ms  # two whole 100 MB chunks at 100 GB/s
    assert cost.iteration_ns == 20 * ms + 44 * ms + 2 * ms
    assert (cost.backward_collective_ns, cost.host_collective_ns) == (8 * ms, 0)
    assert cost.static_device_bytes == 800 * MB  # whole on each rank's device


def test_slow_collectives_are_exposed_where_compute_cannot_hide_them() -> None:
    inst = _inst(_hand(rate=5e9))  # 20 ms a reduce-scatter, 40 ms an all-reduce: longer than backward windows
    rep = evaluate_decision(inst, Decision((False, False), 0, KEEP, (False, False)))
    assert rep.forward_ns == 20 * ms
    assert rep.backward_ns == max(20 * ms, 40 * ms) + 20 * ms + 40 * ms
    # chunk 1 offloaded and sharded: reduce-scattered (20 ms) then its 50 MB shard copied out (5 ms) behind
    # chunk 0's backward (20 ms): the chain is exposed; chunk 0's all-reduce (40 ms) has no window after it
    sh = evaluate_decision(inst, Decision((False, True), 1, KEEP, (False, True)))
    assert sh.backward_ns == 20 * ms + 25 * ms + 40 * ms


def test_offloaded_shards_with_one_buffer_and_the_host_queue() -> None:
    inst = _inst(_hand(per_node=1))  # two nodes: private compute copies, all-gathered at step()
    cost = evaluate_decision(inst, Decision((True, True), 1, KEEP, (True, True)))
    # forward: upload chunk 0 whole (10 ms), no gather; one buffer: chunk 1's upload waits for window 0's
    # compute (10 + 10)
    assert cost.forward_ns == 10 * ms + 20 * ms + 10 * ms
    # backward: chunk 1 is still in the buffer; window 1 computes, then chunk 0 is uploaded again after it
    # (one buffer: 20 + 10); window 0 hides chunk 1's reduce-scatter (2 ms) and shard copy (5 ms); chunk 0's
    # reduce-scatter is exposed (2 ms)
    assert cost.backward_ns == 30 * ms + 20 * ms + 2 * ms
    # host: chunk 1's shard arrives at 30 + 2 + 5 ms; the worker all-gathers its `.grad` (2 ms) and steps it
    # (50 ms), then chunk 0's (arrived at 50 + 7 ms); at optimizer.step() both compute copies are all-gathered
    # (2 ms each), as the runtime queues them
    assert cost.host_end_ns == 37 * ms + 2 * (2 + 50) * ms
    assert cost.host_redo_ns == 4 * ms
    assert cost.iteration_ns == 40 * ms + 141 * ms + 4 * ms
    assert cost.host_optim_ns == 100 * ms and cost.host_collective_ns == 4 * ms
    # two 400 MB sharded chunks (see the instance test) on each rank, one rank per node; 200 MB pinned each
    assert cost.host_bytes == 800 * MB and cost.host_node_bytes == 800 * MB and cost.pinned_bytes == 400 * MB
    assert cost.static_device_bytes == 2 * 128 * MiB  # one full buffer (compute copy + gradient)


@pytest.mark.parametrize(("per_node", "collectives"), [(1, 4 * ms), (2, 20_000)])
def test_clipping_redoes_the_shard_steps_and_then_gathers(per_node: int, collectives: int) -> None:
    inst = _inst(_clipping(_hand(per_node=per_node, sample_bytes=MB)))
    assert inst.redo_host_steps
    cost = evaluate_decision(inst, Decision((True, True), 1, KEEP, (True, True)))
    # during backward the worker fills `.grad` and steps (speculatively): chunk 1 at 37 + 2 + 50, chunk 0 after
    # it at 141 ms
    assert cost.host_end_ns == 141 * ms
    # at optimizer.step() both shard steps are redone (on the `.grad` the user left: no second fill), then (two
    # nodes) both compute copies all-gathered, or (one node, a shared compute copy) one barrier: the 1 MB
    # all-gather sample's 20 us
    assert cost.host_redo_ns == 100 * ms + collectives
    # and two control checks (the same-use check at backward's start, every chunk offloaded; the agreement at its
    # end, in every plan since policy-1.14): the trace measured no `control_s`, so the 1 MB all-gather sample's
    # 20 us each
    assert cost.control_ns == 2 * 20_000
    assert cost.iteration_ns == 40 * ms + 141 * ms + 100 * ms + collectives + 2 * 20_000
    # the undo backup (12 bytes per element: master + Adam state) is a shard's too (beside 400 MB with a
    # private compute copy, 350 MB with a share of the node's: see the instance tests)
    assert inst.shard_host_bytes_of[0] == (400 if per_node == 1 else 350) * MB + 12 * 12_500_000


@pytest.mark.parametrize(("per_node", "collectives"), [(1, 2 * ms), (2, 20_000)])
def test_on_a_serial_device_every_collective_adds(per_node: int, collectives: int) -> None:
    inst = _inst(_hand(per_node=per_node, sample_bytes=MB, device_type="cpu"))  # type: ignore[arg-type]
    assert not inst.copy_overlap
    cost = evaluate_decision(inst, Decision((False, True), 1, KEEP, (False, True)))
    # forward: window 0 then uploads chunk 1 (10 ms) after compute
    assert cost.forward_ns == 10 * ms + 10 * ms + 10 * ms
    # backward: window 1; window 0 + chunk 1's reduce-scatter (2) and shard copy (5); chunk 0's all-reduce (4)
    assert cost.backward_ns == 20 * ms + 27 * ms + 4 * ms
    # then the device step of chunk 0 (1 ms), the `.grad` all-gather (2), the shard step (50) and the gather
    # (2 ms, two nodes) or the barrier (20 us, one node), serially; and two control checks (a chunk offloaded:
    # the same-use check; the agreement on the entries with a gradient at backward's end), 20 us each
    assert cost.control_ns == 2 * 20_000
    assert cost.iteration_ns == 30 * ms + 51 * ms + ms + 2 * ms + 50 * ms + collectives + 40_000


@pytest.mark.parametrize(("overlap", "window_ms"), [(1.0, 20.0), (0.5, 22.5), (0.0, 25.0)])
def test_measured_overlap_of_collectives_and_copies_sets_the_window(overlap: float, window_ms: float) -> None:
    # three persistent chunks; block 0 swapped: its 50 MB come back (5 ms H2D) during window 1, while chunk
    # 2's gradient is all-reduced (20 ms at 10 GB/s)
    inst = _inst(_hand(rate=10e9, overlap=overlap, n_blocks=3))
    assert inst.collective_overlap_permille == round(1000 * overlap)
    cost = evaluate_decision(inst, Decision((False,) * 3, 0, (Mode.swap, Mode.keep, Mode.keep), (False,) * 3))
    # window 2 (20 ms) + window 1: max(20, 5 + (1-f) 20, 20 + (1-f) 5) + window 0 (20 ms, hides chunk 1's
    # all-reduce) + chunk 0's all-reduce (20 ms, exposed)
    assert cost.backward_ns == round((20 + window_ms + 20 + 20) * ms)


def test_host_memory_is_the_nodes_shared_by_its_ranks() -> None:
    limit = 999 * MB  # one rank's 800 MB of offloaded shards fits; two ranks on a node (1600 MB) do not
    two_per_node = _inst(_hand(per_node=2), host_memory_bytes=limit)
    one_per_node = _inst(_hand(per_node=1), host_memory_bytes=limit)
    d = Decision((True, True), 1, KEEP, (True, True))
    assert not evaluate_decision(two_per_node, d).fits_host
    assert evaluate_decision(one_per_node, d).fits_host
    # and the solver sees it: two ranks per node keep a chunk on the device instead
    got = solve_layout(two_per_node, hint=None, time_limit_s=30, seed=0, gap_limit=0.0)
    assert got.decision is not None and got.cost is not None and got.cost.host_node_bytes <= limit
    assert not all(got.decision.offloaded)


def test_one_node_shares_the_compute_copy_where_two_nodes_keep_one_per_rank() -> None:
    # the same model and world size 2: both ranks on one node (a node-shared compute copy per sharded chunk,
    # one barrier per step) or one rank on each of two nodes (a private copy each, all-gathered at step())
    one = _inst(_hand(per_node=2, sample_bytes=MB))
    two = _inst(_hand(per_node=1, sample_bytes=MB))
    assert one.compute_copy_shared and not two.compute_copy_shared
    n, s, copy = 2, 12_500_000, 100 * MB  # ranks, shard elements, a chunk's whole fp32 compute copy
    # per rank: the .grad whole (100 MB) + the compute copy whole (100 MB) or the rank's share (50 MB) + 16
    # bytes per shard element; pinned: the copy (whole or the share) + staging and host gradient shards
    assert two.shard_host_bytes_of == (400 * MB, 400 * MB) and one.shard_host_bytes_of == (350 * MB, 350 * MB)
    assert two.shard_host_bytes_of[0] - one.shard_host_bytes_of[0] == (n - 1) * s * 4 == copy * (n - 1) // n
    assert two.shard_pinned_bytes_of == (200 * MB, 200 * MB)
    assert one.shard_pinned_bytes_of == (150 * MB, 150 * MB)
    # time: no all-gather on the shared path, one barrier instead (the 1 MB all-gather sample at 50 GB/s)
    assert two.gather_ns == (2 * ms, 2 * ms) and two.step_barrier_ns == 0
    assert one.gather_ns == (0, 0) and one.step_barrier_ns == 20_000
    d = Decision((True, True), 1, KEEP, (True, True))
    a, b = evaluate_decision(one, d), evaluate_decision(two, d)
    # forward, backward and the host steps are the same; at step() two gathers (4 ms) or one barrier (20 us)
    assert (a.forward_ns, a.backward_ns, a.host_end_ns) == (b.forward_ns, b.backward_ns, b.host_end_ns)
    assert (a.host_redo_ns, a.host_collective_ns) == (20_000, 20_000)
    assert (b.host_redo_ns, b.host_collective_ns) == (4 * ms, 4 * ms)
    assert b.iteration_ns - a.iteration_ns == 4 * ms - 20_000
    # node host: the one-node job holds 2 x 700 MB; with a private copy per rank it would hold 2 x 800 MB: the
    # node saves (N - 1)/N of its ranks' compute copies (2 ranks x 2 chunks x 100 MB)
    assert (a.host_bytes, a.host_node_bytes) == (700 * MB, 1400 * MB)
    assert (b.host_bytes, b.host_node_bytes) == (800 * MB, 800 * MB)
    assert n * b.host_bytes - a.host_node_bytes == (n - 1) * (n * 2 * copy) // n
    assert (a.pinned_bytes, b.pinned_bytes) == (300 * MB, 400 * MB)
    # one barrier per step however many chunks are sharded, none when none is
    assert evaluate_decision(one, Decision((True, True), 1, KEEP, (True, False))).host_redo_ns == 20_000
    assert evaluate_decision(one, Decision((True, True), 1, KEEP, (False, False))).host_redo_ns == 0
    assert evaluate_decision(one, Decision((False, False), 0, KEEP, (False, False))).host_collective_ns == 0


@pytest.mark.parametrize("solver", ["cpsat", "protrain"])
def test_sharing_the_compute_copy_fits_a_node_host_limit_that_private_copies_do_not(solver: str) -> None:
    # a 600 MB device holds neither chunk's 400 MB of states beside a buffer (2 x 128 MiB): both are offloaded.
    # Sharded on one node they take 2 x 700 MB of the node's host (see above), with a private compute copy per
    # rank 2 x 800 MB; replicated, 600 MB a chunk per rank. The node has 1500 MB.
    trace = _hand(per_node=2, sample_bytes=MB)
    cons = Constraints(device_memory_bytes=600 * MB, host_memory_bytes=1500 * MB)
    shared = build_instance(trace, pack(trace, 128 * MiB), cons, CostParams(alpha=0.0))
    two_nodes = build_instance(
        _hand(per_node=1, sample_bytes=MB), pack(trace, 128 * MiB), cons, CostParams(alpha=0.0)
    )
    # the same node as the planner modelled it before the copy was shared: a private whole copy per rank
    private = dataclasses.replace(
        shared,
        compute_copy_shared=False,
        gather_ns=two_nodes.gather_ns,
        step_barrier_ns=0,
        shard_host_bytes_of=two_nodes.shard_host_bytes_of,
        shard_pinned_bytes_of=two_nodes.shard_pinned_bytes_of,
    )

    def solve(inst: PolicyInstance) -> tuple[Decision | None, Cost | None]:
        if solver == "protrain":
            r = search(inst)
            return r.decision, r.cost
        got = solve_layout(inst, hint=None, time_limit_s=30, seed=0, gap_limit=0.0)
        return got.decision, got.cost

    d, cost = solve(shared)
    assert d is not None and cost is not None and cost.fits
    assert d.offloaded == (True, True) and d.sharded_chunks(shared) == (True, True)
    assert cost.host_node_bytes == 1400 * MB <= cons.host_memory_bytes  # type: ignore[operator]
    assert solve(private) == (None, None)


def test_a_single_rank_trace_rejects_a_sharding() -> None:
    inst = _inst(_hand(world=1))
    with pytest.raises(ValueError, match="sharded: a single-rank job shards nothing"):
        evaluate_decision(inst, Decision((True, True), 1, KEEP, (True, True)))


def test_an_offloaded_replicated_chunk_moves_and_steps_the_whole_chunk() -> None:
    inst = _inst(_hand())
    cost = evaluate_decision(inst, Decision((True, True), 1, KEEP, (False, False)))
    # forward: the whole 100 MB uploaded (10 ms), as a sharded chunk; one buffer: chunk 1 waits for window 0
    assert cost.forward_ns == 10 * ms + (10 + 10) * ms + 10 * ms
    # backward: window 0 all-reduces chunk 1's gradient (4 ms) then copies it out whole (10 ms), hidden in
    # 20 ms; window 1 refetches chunk 0 after its compute (one buffer: 20 + 10); chunk 0's all-reduce exposed
    assert cost.backward_ns == 20 * ms + 30 * ms + 4 * ms
    assert cost.host_optim_ns == 200 * ms and cost.host_collective_ns == 0  # two whole steps, no gathers
    # host: chunk 1 arrives at 30 + 4 + 10 ms, then two whole 100 ms steps
    assert cost.host_end_ns == 44 * ms + 200 * ms
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
def test_sharding_the_offloaded_chunks_divides_host_work_and_host_memory(solver: str) -> None:
    from planner_service.solver.cost_model import evaluate

    plans = _plans(300, solver)
    for world, (trace, cons, plan) in plans.items():
        assert plan.policy is not None and plan.predictions is not None, plan.solver.message
        assert plan.policy.world_size == world
        offloaded = [c.index for c in plan.policy.chunks if c.placement.value == "offloaded"]
        # every offloaded chunk is sharded here (it pays); persistent ones may be sharded on the device (ZeRO-3)
        assert set(offloaded if world > 1 else []) <= set(plan.policy.sharded_chunks)
        assert world > 1 or not plan.policy.sharded_chunks
        # the wire policy evaluates back to the plan's predictions (sharding and world size included)
        assert evaluate(trace, plan.policy, cons, None).iteration_s == pytest.approx(
            plan.predictions.iteration_s
        )
    # one rank of 300 MiB cannot hold the model's states: it offloads most of them; several ranks can shard the
    # persistent chunks on the device (ZeRO-3), which holds more of the model per rank, so they offload less;
    # each rank steps 1/N of the offloaded states on its host and keeps 1/N of them there (but the compute copy
    # and .grad whole)
    frac = {w: _offloaded_fraction(p.policy) for w, (_, _, p) in plans.items()}
    assert frac[1] > 0.5 and frac[4] <= frac[2] <= frac[1], frac
    t = {w: p.predictions.iteration_s for w, (_, _, p) in plans.items()}  # type: ignore[union-attr]
    host = {w: p.predictions.peak_host_bytes for w, (_, _, p) in plans.items()}  # type: ignore[union-attr]
    assert t[1] > t[2] > t[4]
    assert host[1] > host[2] > host[4]
    b = plans[2][2].predictions.breakdown  # type: ignore[union-attr]
    assert b["world_size"] == 2.0 and b["backward_collective_s"] > 0 and b["host_collective_s"] > 0
    assert "forward_collective_s" not in b  # a sharded chunk is uploaded whole: no gather before use


def test_with_room_for_everything_communication_is_not_free() -> None:
    plans = _plans(700)
    one, two = plans[1][2], plans[2][2]
    assert one.policy is not None and not any(c.placement.value == "offloaded" for c in one.policy.chunks)
    assert "world_size" not in one.predictions.breakdown  # type: ignore[union-attr]
    # the same per-rank work plus gradient all-reduces: no faster per iteration than one rank alone
    assert two.predictions.iteration_s >= one.predictions.iteration_s  # type: ignore[union-attr]


def _used_outside_owner(trace: Trace, chunk: int) -> Trace:
    """`trace` with the parameters of `chunk` used outside their owning module's forward (the profiler's flag)."""
    a, b = pack(trace, 128 * MiB).param_ranges[chunk]
    params = [
        p.model_copy(update={"used_outside_owner": a <= i < b}) for i, p in enumerate(trace.model.parameters)
    ]
    return trace.model_copy(update={"model": trace.model.model_copy(update={"parameters": params})})


def test_a_chunk_holding_a_parameter_used_outside_its_owners_forward_is_never_sharded_on_the_device() -> None:
    """As above, but chunk 0's parameters are used outside the forward of the module owning them (a parent's
    `hidden @ self.embed.weight.T`): sharded on the device they would read the released placeholder, so CP-SAT
    and ProTrain keep chunk 0 replicated (chunk 1 still sharded), the instance refuses a decision sharding it,
    and under the limit that only both shards fit nothing is feasible."""
    roomy = Constraints(device_memory_bytes=1400 * MB, host_memory_bytes=10 * MB)
    layout = _inst(_hand(), host_memory_bytes=10 * MB).layout
    trace = _used_outside_owner(_hand(), 0)
    assert trace.model.parameters[0].used_outside_owner and not trace.model.parameters[-1].used_outside_owner
    free = build_instance(_hand(), layout, roomy, CostParams(alpha=0.0))
    inst = build_instance(trace, layout, roomy, CostParams(alpha=0.0))
    assert inst.no_device_shard == (True, False) and free.no_device_shard == (False, False)
    got = solve_layout(free, hint=None, time_limit_s=30, seed=0, gap_limit=0.0)
    assert got.decision is not None and got.decision.sharded[0] and not got.decision.offloaded[0]  # has teeth
    got = solve_layout(inst, hint=None, time_limit_s=30, seed=0, gap_limit=0.0)
    assert got.status == "optimal" and got.decision is not None
    assert got.decision.offloaded == (False, False) and got.decision.sharded == (False, True)
    pro = search(inst)
    assert pro.decision is not None and not (pro.decision.sharded and pro.decision.sharded[0])
    with pytest.raises(
        ValueError, match=r"sharded\[0\]: a persistent chunk holding a parameter used outside"
    ):
        Decision((False, False), 0, KEEP, (True, True)).check(inst)
