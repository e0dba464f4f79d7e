"""Single-rank jobs plan exactly as before multi-rank planning existed (issue 20).

`data/single_rank_golden.json` was written by this module (`--write`) at the commit before the cost model,
the CP-SAT model and the ProTrain search learned about world sizes (first written at that branch's base;
rewritten at 8385f19, main just before the multi-rank merge, which already counted the pinned arena and the
duplex copies of issue 19: the import of the two multi-rank helpers dropped for the run); policy-1.9 (session 16)
added one key to every prediction's breakdown, `uploads_per_iteration`, and nothing else (no case has a tied
parameter: every other figure and every CP-SAT model's bytes were checked unchanged by a `--write` run). A single-process trace, and the same
trace with an explicit one-rank process group, must give the same plans (policy and predictions, CP-SAT and
ProTrain, proven optima), the same cost of fixed decisions, and the same CP-SAT model, byte for byte.

Regenerate only when a single-rank change is intended:
    PYTHONPATH=$PWD python -m tests.planner_service.solver.test_single_rank_regression --write
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
import sys
from pathlib import Path
from typing import Any

import pytest

from client.contract import Constraints, DeviceType, Trace, Workload
from planner_service.solver import cpsat_model
from planner_service.solver.chunk_grid import candidate_layouts
from planner_service.solver.cost_model import evaluate_decision, iteration_ns_batch
from planner_service.solver.entry import solve_with_gap
from planner_service.solver.instance import CostParams, Decision, Mode, build_instance
from planner_service.solver.testing.synthetic import (
    BlockSpec,
    hand_trace,
    synthetic_distributed,
    synthetic_trace,
    with_distributed,
)

GOLDEN = Path(__file__).parent / "data" / "single_rank_golden.json"
GiB, MiB = 2**30, 2**20


def _clipping(trace: Trace) -> Trace:
    w = trace.workload.model_dump() | {"clips_gradients": True, "undo_backup_bytes_per_param": 12}
    return trace.model_copy(update={"workload": Workload.model_validate(w)})


def _hand(device_type: DeviceType, **kw: Any) -> Trace:
    specs = [
        BlockSpec(4 * MiB, 0.002, 0.004, 0.002, 64 * MiB, 8 * MiB, kind=k)
        for k in ["prologue", "block", "block", "block", "block", "epilogue"]
    ]
    return hand_trace(specs, device_type=device_type, **kw)


def cases() -> dict[str, tuple[Trace, Constraints]]:
    small = synthetic_trace(n_blocks=6, hidden=512, heads=8, batch=4, seq=512, vocab=8000)
    fp32 = synthetic_trace(n_blocks=5, hidden=256, heads=4, batch=2, seq=256, vocab=4000, precision="fp32")  # type: ignore[arg-type]
    return {
        "synthetic-roomy": (small, Constraints(device_memory_bytes=8 * GiB)),
        "synthetic-tight": (small, Constraints(device_memory_bytes=700 * MiB)),
        "synthetic-tighter": (small, Constraints(device_memory_bytes=420 * MiB, host_memory_bytes=4 * GiB)),
        "synthetic-fp32": (fp32, Constraints(device_memory_bytes=160 * MiB)),
        "synthetic-clips": (_clipping(small), Constraints(device_memory_bytes=500 * MiB)),
        "hand-cuda": (_hand(DeviceType.cuda), Constraints(device_memory_bytes=300 * MiB)),
        "hand-cuda-pinned": (
            _hand(DeviceType.cuda, pinned_memory_limit_bytes=64 * MiB),
            Constraints(device_memory_bytes=260 * MiB),
        ),
        "hand-cpu": (_hand(DeviceType.cpu), Constraints(device_memory_bytes=300 * MiB)),
    }


def _decisions(n_chunks: int, n_blocks: int, optimisable: tuple[bool, ...], seed: int) -> list[Decision]:
    rng = random.Random(seed)
    out = []
    for _ in range(6):
        off = tuple(rng.random() < 0.5 for _ in range(n_chunks))
        nb = rng.randint(1, max(1, sum(off))) if any(off) else rng.choice([0, 1])
        modes = tuple(Mode(rng.randint(0, 2)) if optimisable[b] else Mode.keep for b in range(n_blocks))
        out.append(Decision(offloaded=off, n_buffers=nb, modes=modes))
    return out


def snapshot(trace: Trace, cons: Constraints) -> dict[str, Any]:
    """What must not change: plans of both solvers, costs of fixed decisions, the CP-SAT model's bytes."""
    out: dict[str, Any] = {}
    for solver in ("cpsat", "protrain"):
        plan = solve_with_gap(trace, cons, solver=solver, seed=0, gap_limit=0.0)
        out[solver] = {
            "status": plan.solver.status.value,
            "policy": None if plan.policy is None else json.loads(plan.policy.model_dump_json()),
            "predictions": None
            if plan.predictions is None
            else json.loads(plan.predictions.model_dump_json()),
            "min_device_memory_bytes": plan.solver.min_device_memory_bytes,
        }
    costs = []
    models = []
    for i, lay in enumerate(candidate_layouts(trace)[:3]):
        inst = build_instance(trace, lay, cons, CostParams())
        for d in _decisions(inst.n_chunks, inst.n_blocks, inst.optimisable, seed=i):
            cost = evaluate_decision(inst, d)
            batch = int(
                iteration_ns_batch(inst, d.offloaded, d.n_buffers, __import__("numpy").array([d.modes]))[0]
            )
            costs.append({**dataclasses.asdict(cost), "batch_iteration_ns": batch})
        for objective in ("time", "memory"):
            proto = str(cpsat_model.build(inst, objective=objective).model.proto).encode()
            models.append(hashlib.sha256(proto).hexdigest())
    out["costs"] = costs
    out["cpsat_models"] = models
    return out


@pytest.fixture(scope="module")
def golden() -> dict[str, Any]:
    return dict(json.loads(GOLDEN.read_text()))


@pytest.mark.parametrize("name", sorted(cases()))
@pytest.mark.parametrize("group", ["none", "one-rank"])
def test_single_rank_plans_predictions_costs_and_models_are_unchanged(golden, name: str, group: str) -> None:  # type: ignore[no-untyped-def]
    trace, cons = cases()[name]
    if group == "one-rank":
        trace = with_distributed(trace, synthetic_distributed(1))
        assert trace.hardware.world_size == 1 and trace.hardware.distributed is not None
    got = snapshot(trace, cons)
    want = golden[name]
    for key in ("cpsat", "protrain", "cpsat_models"):
        assert got[key] == want[key], (name, key)
    # every figure the golden has (fields added since, e.g. collective time, are new, not changed)
    assert [{f: cost[f] for f in old} for cost, old in zip(got["costs"], want["costs"], strict=True)] == want[
        "costs"
    ]


if __name__ == "__main__" and "--write" in sys.argv:
    GOLDEN.write_text(
        json.dumps({n: snapshot(t, c) for n, (t, c) in sorted(cases().items())}, indent=1) + "\n"
    )
    print(f"wrote {GOLDEN}")
