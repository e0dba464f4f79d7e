"""ProTrain baseline: its block layout, and pruning rules that never change the answer."""

from __future__ import annotations

import pytest

from client.contract import Constraints
from planner_service.solver import protrain
from planner_service.solver.chunk_grid import candidate_layouts
from planner_service.solver.instance import CostParams, Mode, build_instance
from planner_service.solver.testing.synthetic import synthetic_trace

GiB = 2**30
K, C, S = Mode.keep, Mode.checkpoint, Mode.swap


def test_swap_and_checkpoint_blocks_interleave_early_and_unoptimised_blocks_come_last():
    repeated = [1, 2, 3, 4, 5, 6]
    assert protrain.knob_modes(8, repeated, 2, 3) == (K, S, C, S, C, C, K, K)
    assert protrain.knob_modes(8, repeated, 3, 1) == (K, S, C, S, S, K, K, K)
    assert protrain.knob_modes(8, repeated, 0, 0) == (K,) * 8


def test_vectorised_knob_table_matches_the_layout_rule():
    repeated = [1, 2, 3, 5, 6, 7, 8]
    combos = [(s, c) for s in range(8) for c in range(8 - s)]
    table = protrain.knob_table(10, repeated, combos)
    for row, (s, c) in zip(table, combos, strict=True):
        assert tuple(Mode(int(x)) for x in row) == protrain.knob_modes(10, repeated, s, c)


@pytest.mark.parametrize("copy_overlap", [True, False])
@pytest.mark.parametrize("device_gib", [2, 3, 5])
def test_pruning_rules_do_not_change_the_baseline_answer(device_gib, copy_overlap):
    # both cost models: copies overlapping compute (GPU) and serial with it (CPU device)
    trace = synthetic_trace(n_blocks=8, hidden=1024, batch=8, seq=1024)
    cons = Constraints(device_memory_bytes=device_gib * GiB)
    for layout in candidate_layouts(trace)[:2]:
        inst = build_instance(trace, layout, cons, CostParams(copy_overlap=copy_overlap))
        pruned = protrain.search(inst)
        full = protrain.search(inst, prune_memory=False, prune_bound=False)
        assert (pruned.cost is None) == (full.cost is None)
        if full.cost is not None and pruned.cost is not None:
            assert pruned.cost.iteration_ns == full.cost.iteration_ns
            assert pruned.evaluated < full.evaluated


@pytest.mark.parametrize("host_fraction", [1.6, 2.0])
def test_pruning_rules_do_not_change_the_answer_when_the_job_clips_under_a_host_limit(host_fraction):
    # clipping: undo backups make the host side larger than the pinned states, and the redo adds time
    trace = synthetic_trace(n_blocks=8, hidden=1024, batch=8, seq=1024)
    w = trace.workload.model_copy(update={"clips_gradients": True, "undo_backup_bytes_per_param": 12})
    trace = trace.model_copy(update={"workload": w})
    state = trace.model.parameter_count * 16  # bytes of fp32 parameter + gradient + Adam moments
    cons = Constraints(device_memory_bytes=3 * GiB, host_memory_bytes=int(host_fraction * state))
    found = 0
    for layout in candidate_layouts(trace)[:2]:
        inst = build_instance(trace, layout, cons)
        assert inst.redo_host_steps
        pruned = protrain.search(inst)
        full = protrain.search(inst, prune_memory=False, prune_bound=False)
        assert (pruned.cost is None) == (full.cost is None)
        if full.cost is not None and pruned.cost is not None:
            assert pruned.cost.iteration_ns == full.cost.iteration_ns
            assert pruned.cost.fits and pruned.cost.host_redo_ns > 0
            found += 1
    assert found > 0
