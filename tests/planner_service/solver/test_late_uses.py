"""A tied chunk used again in a later window (GPT-2's word embedding as `lm_head`): its re-upload in forward and
the chunk it displaces for backward, in the cost model, the batch timer and CP-SAT alike (`late_uses.py`)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from client.contract import Constraints, Trace
from planner_service.solver.chunk_grid import ChunkGrid, candidate_layouts, layout_from_chunks
from planner_service.solver.cost_model import evaluate_decision, iteration_ns_batch
from planner_service.solver.instance import CostParams, Decision, Mode, build_instance
from planner_service.solver.late_uses import late_use_windows
from tests.planner_service.solver.test_multi_rank_policy import _multi_rank, cpsat_equals_brute_force
from tests.planner_service.solver.test_policy_bruteforce import (
    assert_cpsat_matches_brute_force,
    limits_between_extremes,
    random_trace,
)

MiB = 2**20
# (seed, world size, copies overlap compute): seeds whose limits leave a layout with a tied chunk feasible
MULTI_RANK_CASES = [(0, 2, True), (1, 2, False), (7, 4, True)]


def tied(trace: Trace) -> Trace:
    """The trace with block 0's parameter used again by the last block as `head.weight` (a tied `lm_head` without parameters of its own)."""
    params = list(trace.model.parameters)
    last = len(trace.model.blocks) - 1
    params[0] = params[0].model_copy(update={"aliases": ["head.weight"], "use_blocks": [0, last]})
    return trace.model_copy(update={"model": trace.model.model_copy(update={"parameters": params})})


def one_chunk_per_block(trace: Trace) -> ChunkGrid:
    params = trace.model.parameters
    return layout_from_chunks(trace, max(p.bytes for p in params), [[p.name] for p in params])


def test_the_tied_chunk_is_used_again_in_the_last_window() -> None:
    trace = tied(random_trace(np.random.default_rng(5), n_blocks=5))
    lay = one_chunk_per_block(trace)
    assert lay.n_chunks == 5
    assert late_use_windows(trace, lay) == ((0, 4),)
    assert late_use_windows(random_trace(np.random.default_rng(5), n_blocks=5), lay) == ()
    # an older trace without use_blocks: the alias's module path names the block
    params = list(trace.model.parameters)
    params[0] = params[0].model_copy(update={"use_blocks": []})
    older = trace.model_copy(update={"model": trace.model.model_copy(update={"parameters": params})})
    assert late_use_windows(older, lay) == ((0, 4),)


@pytest.mark.parametrize("n_buffers", [1, 2, 3])
def test_a_tied_chunk_out_of_the_buffers_costs_its_reupload_and_the_displaced_chunks(n_buffers: int) -> None:
    """Serial copies (a CPU device): every upload adds its time, so the difference is exactly the extra uploads:
    the tied chunk again in forward, and the first chunk left resident after forward again in backward."""
    rng = np.random.default_rng(11)
    base = random_trace(rng, n_blocks=6)
    cons = Constraints(device_memory_bytes=1 << 40, host_memory_bytes=1 << 40)
    params = CostParams(alpha=0.05, copy_overlap=False)
    lay = one_chunk_per_block(base)
    plain, tie = build_instance(base, lay, cons, params), build_instance(tied(base), lay, cons, params)
    C = lay.n_chunks
    d = Decision(offloaded=(True,) * C, n_buffers=n_buffers, modes=(Mode.keep,) * plain.n_blocks)
    a, b = evaluate_decision(plain, d), evaluate_decision(tie, d)
    U = plain.upload_ns
    first_resident = C - n_buffers
    assert b.forward_ns - a.forward_ns == U[0]
    assert b.backward_ns - a.backward_ns == U[first_resident]
    assert b.iteration_ns - a.iteration_ns == U[0] + U[first_resident]
    rows = np.array([d.modes], dtype=np.int8)
    assert int(iteration_ns_batch(tie, d.offloaded, n_buffers, rows)[0]) == b.iteration_ns
    # everything offloaded fits in the buffers: nothing is evicted, nothing uploaded again
    d_all = Decision(offloaded=(True,) * C, n_buffers=C, modes=(Mode.keep,) * plain.n_blocks)
    assert evaluate_decision(tie, d_all).iteration_ns == evaluate_decision(plain, d_all).iteration_ns
    # the tied chunk on the device: no upload at all
    d_dev = Decision(offloaded=(False,) + (True,) * (C - 1), n_buffers=1, modes=(Mode.keep,) * plain.n_blocks)
    assert evaluate_decision(tie, d_dev).iteration_ns == evaluate_decision(plain, d_dev).iteration_ns


def test_with_one_buffer_the_reupload_is_serial_with_the_last_window_on_a_gpu() -> None:
    rng = np.random.default_rng(12)
    base = random_trace(rng, n_blocks=5)
    cons = Constraints(device_memory_bytes=1 << 40, host_memory_bytes=1 << 40)
    lay = one_chunk_per_block(base)
    inst = build_instance(tied(base), lay, cons, CostParams(alpha=0.05))
    C = lay.n_chunks
    one = Decision(offloaded=(True,) + (False,) * (C - 1), n_buffers=1, modes=(Mode.keep,) * inst.n_blocks)
    # only the tied chunk offloaded: it stays in its buffer, nothing more
    plain = build_instance(base, lay, cons, CostParams(alpha=0.05))
    assert evaluate_decision(inst, one).iteration_ns == evaluate_decision(plain, one).iteration_ns
    d = Decision(offloaded=(True, True) + (False,) * (C - 2), n_buffers=1, modes=(Mode.keep,) * inst.n_blocks)
    # the last window's compute (its chunk is on the device) plus the re-upload, however short the upload
    assert evaluate_decision(inst, d).forward_ns - evaluate_decision(plain, d).forward_ns == inst.upload_ns[0]


@pytest.mark.parametrize(("seed", "overlap"), [(1, True), (2, True), (3, False), (4, False)])
def test_cpsat_optimum_equals_brute_force_with_a_tied_chunk(seed: int, overlap: bool) -> None:
    rng = np.random.default_rng(8000 + seed)
    trace = tied(random_trace(rng, n_blocks=int(rng.integers(4, 8))))
    cons = limits_between_extremes(rng, trace)
    params = CostParams(alpha=0.05, full_duplex=bool(seed % 2), copy_overlap=overlap)
    assert assert_cpsat_matches_brute_force(trace, cons, params, serial=not overlap) >= 1


@pytest.mark.parametrize(("seed", "world", "copy_overlap"), MULTI_RANK_CASES)
def test_cpsat_optimum_equals_brute_force_with_a_tied_chunk_on_several_ranks(
    seed: int, world: int, copy_overlap: bool
) -> None:
    rng = np.random.default_rng(8100 + seed)
    trace, cons = _multi_rank(rng, world, 2, 0.5, n_blocks=int(rng.integers(4, 6)))
    trace = tied(trace)
    params = CostParams(alpha=0.05, full_duplex=bool(seed % 2), copy_overlap=copy_overlap)
    compared = 0
    for lay in candidate_layouts(trace):
        if 4**lay.n_chunks * 3 ** (len(trace.model.blocks) - 2) > 20_000:
            continue
        inst = build_instance(trace, lay, cons, params)
        compared += cpsat_equals_brute_force(inst) and bool(inst.late_uses)
    assert compared >= 1, "this case compares no layout with a tied chunk: pick another seed"


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("copy_overlap", [True, False])
def test_vectorised_timer_agrees_with_the_cost_model_on_every_decision(
    world: int, copy_overlap: bool
) -> None:
    rng = np.random.default_rng(8200 + world)
    if world == 1:
        trace = tied(random_trace(rng, n_blocks=6))
    else:
        trace = tied(_multi_rank(rng, world, 2, 0.4, n_blocks=6)[0])
    cons = Constraints(device_memory_bytes=1 << 40, host_memory_bytes=1 << 40)
    lay = one_chunk_per_block(trace)
    inst = build_instance(
        trace, lay, cons, CostParams(alpha=0.05, full_duplex=True, copy_overlap=copy_overlap)
    )
    assert inst.late_uses == ((0, lay.n_chunks - 1),)
    C = lay.n_chunks
    rows = np.array(
        [
            [Mode.keep]
            + [rng.choice([Mode.keep, Mode.checkpoint, Mode.swap]) for _ in range(inst.n_blocks - 2)]
            + [Mode.keep]
            for _ in range(4)
        ],
        dtype=np.int8,
    )
    checked = 0
    for off in itertools.product((False, True), repeat=C):
        for nb in range(1, sum(off) + 1):
            sh = tuple(o and c % 2 == 0 for c, o in enumerate(off)) if world > 1 else ()
            batch = iteration_ns_batch(inst, off, nb, rows, sh)
            for r, row in enumerate(rows):
                d = Decision(off, nb, tuple(Mode(int(m)) for m in row), sh)
                assert int(batch[r]) == evaluate_decision(inst, d).iteration_ns
                checked += 1
    assert checked > 100
