"""A module whose parameters sit in two chunks (a tied parameter) needs both resident at once: every solver keeps
its offloaded ones within `n_buffers`, as the runtime demands (`ChunkLayout.from_policy` refuses the plan
otherwise: "policy.n_buffers: module ... needs 2 offloaded chunks [0, 3] resident at once, more than the 1
buffer(s)").

The hand trace is a masked LM in miniature: `head` (the output projection) has its weight tied to the embedding
(first chunk) and its own bias in the last chunk. At 336 MiB usable, the solvers used to offload both with one
buffer (ProTrain everything through one buffer, CP-SAT chunks 0, 2 and 3)."""

from __future__ import annotations

import pytest

from client.contract import BlockKind, Constraints, Placement, Policy, Trace
from planner_service.solver import protrain
from planner_service.solver.chunk_grid import co_needed_chunks, pack
from planner_service.solver.cost_model import evaluate_decision
from planner_service.solver.cpsat_solve import solve_layout
from planner_service.solver.entry import solve
from planner_service.solver.instance import CostParams, Decision, Mode, PolicyInstance, build_instance
from planner_service.solver.testing.synthetic import BlockSpec, hand_trace
from tests.planner_service.solver.test_policy_bruteforce import assert_cpsat_matches_brute_force

MiB = 2**20
CHUNK = 32 * MiB
USABLE = 336 * MiB  # where both solvers offloaded chunks 0 and 3 through one buffer before the fix


def spec(kind: BlockKind, parameter_bytes: int, activation_bytes: int) -> BlockSpec:
    # recompute far dearer than an upload: keeping activations with one buffer beats checkpointing with two
    return BlockSpec(
        parameter_bytes=parameter_bytes,
        forward_s=5e-3,
        backward_s=10e-3,
        recompute_s=50e-3,
        activation_bytes=activation_bytes,
        input_bytes=1 * MiB,
        kind=kind,
    )


def tied_trace(tied: bool = True) -> Trace:
    """Embedding (8 MiB), two 32 MiB blocks, head bias (8 MiB): four chunks of 32 MiB; `head.weight` is the
    embedding when `tied`."""
    trace = hand_trace(
        [
            spec(BlockKind.prologue, 8 * MiB, 1 * MiB),
            spec(BlockKind.block, 32 * MiB, 128 * MiB),
            spec(BlockKind.block, 32 * MiB, 128 * MiB),
            spec(BlockKind.epilogue, 8 * MiB, 1 * MiB),
        ]
    )
    params = list(trace.model.parameters)
    params[0] = params[0].model_copy(
        update={"name": "embed.weight", "aliases": ["head.weight"] if tied else []}
    )
    params[3] = params[3].model_copy(update={"name": "head.bias"})
    return trace.model_copy(update={"model": trace.model.model_copy(update={"parameters": params})})


def instance(trace: Trace) -> PolicyInstance:
    return build_instance(
        trace, pack(trace, CHUNK), Constraints(device_memory_bytes=USABLE), CostParams(alpha=0.0)
    )


def refused_by_runtime(policy: Policy, trace: Trace) -> list[str]:
    """Modules needing more offloaded chunks than buffers, by the runtime's rule written out independently:
    a module's parameters are the names (aliases included) one component below its path."""
    chunk_of = {n: c.index for c in policy.chunks for n in c.parameters}
    offloaded = {c.index for c in policy.chunks if c.placement == Placement.offloaded}
    needs: dict[str, set[int]] = {}
    for p in trace.model.parameters:
        for name in (p.name, *p.aliases):
            module = name.rsplit(".", 1)[0]
            if chunk_of[p.name] in offloaded:
                needs.setdefault(module, set()).add(chunk_of[p.name])
    return [m for m, cs in needs.items() if len(cs) > policy.n_buffers]


def test_a_tied_parameter_makes_its_module_need_the_first_and_last_chunk_together() -> None:
    trace = tied_trace()
    layout = pack(trace, CHUNK)
    assert layout.n_chunks == 4
    assert co_needed_chunks(trace, layout) == ((0, 3),)
    assert instance(trace).co_needed == ((0, 3),)
    assert co_needed_chunks(tied_trace(tied=False), layout) == ()


def test_protrain_gives_the_tied_module_a_buffer_per_offloaded_chunk_or_keeps_one_persistent() -> None:
    inst = instance(tied_trace())
    d = protrain.search(inst).decision
    assert d is not None
    assert d.n_buffers >= 2 or not (d.offloaded[0] and d.offloaded[3])
    assert d.n_buffers >= inst.min_buffers(d.offloaded)


def test_cpsat_gives_the_tied_module_a_buffer_per_offloaded_chunk_or_keeps_one_persistent() -> None:
    inst = instance(tied_trace())
    s = solve_layout(inst, hint=None, time_limit_s=10, seed=0, gap_limit=0.0)
    assert s.decision is not None and s.status == "optimal"
    d = s.decision
    assert d.n_buffers >= 2 or not (d.offloaded[0] and d.offloaded[3])
    # the same optimum as the ProTrain search wherever ProTrain's prefix rule reaches it, never a refused plan
    base = protrain.search(inst)
    assert base.cost is not None and s.cost is not None
    assert s.cost.iteration_ns <= base.cost.iteration_ns


def test_the_cost_model_refuses_a_decision_the_runtime_would_refuse() -> None:
    inst = instance(tied_trace())
    keep = (Mode.keep,) * inst.n_blocks
    with pytest.raises(ValueError, match=r"n_buffers: a module needs the offloaded chunks \[0, 3\] resident"):
        evaluate_decision(inst, Decision(offloaded=(True,) * 4, n_buffers=1, modes=keep))
    assert inst.min_buffers((True, False, False, True)) == 2
    assert inst.min_buffers((False, True, True, True)) == 1
    assert inst.min_buffers((False,) * 4) == 0
    evaluate_decision(inst, Decision(offloaded=(True,) * 4, n_buffers=2, modes=keep))


@pytest.mark.parametrize("solver", ["cpsat", "protrain"])
@pytest.mark.parametrize("usable_mib", [324, 336, 452])
def test_solved_plans_are_never_refused_by_the_runtime(solver: str, usable_mib: int) -> None:
    # 324-348 MiB: both solvers used to answer one buffer for chunks 0 and 3; 452 MiB: CP-SAT did
    trace = tied_trace()
    limit = int(usable_mib * MiB * 1.1) + 1  # the trace's default margin (alpha 0.10)
    plan = solve(trace, Constraints(device_memory_bytes=limit, time_limit_s=20), solver=solver)
    assert any(c.placement == Placement.offloaded for c in plan.policy.chunks)
    assert refused_by_runtime(plan.policy, trace) == []


@pytest.mark.parametrize("usable_mib", [300, 336, 452])
def test_cpsat_optimum_equals_the_brute_force_over_decisions_the_runtime_accepts(usable_mib: int) -> None:
    trace = tied_trace()
    cons = Constraints(device_memory_bytes=usable_mib * MiB, time_limit_s=60)
    assert assert_cpsat_matches_brute_force(trace, cons, CostParams(alpha=0.0)) >= 1
