"""Session 9 trace fields (issue 20): the host step's per-call overhead (`OptimizerMeasurement.host_step_overhead_s`)
and the measured all-reduce curve (`CollectiveCurves.all_reduce`).

Both are optional: a trace from before them loads, keeps its content hash (the JSON leaves them out at their
defaults) and plans as before; the cost model charges each offloaded chunk's host step the overhead once
(single-rank and sharded steps), and reads a replicated chunk's gradient average off the all-reduce curve
when there is one (else a reduce-scatter plus an all-gather).
"""

from __future__ import annotations

import json

from client.contract import CollectiveSample, Constraints, Trace
from planner_service.solver.bandwidth import transfer_ns
from planner_service.solver.chunk_grid import candidate_layouts
from planner_service.solver.cost_model import evaluate_decision
from planner_service.solver.instance import Decision, Mode, build_instance
from planner_service.solver.testing.synthetic import synthetic_distributed, synthetic_trace, with_distributed

GiB = 2**30
OVERHEAD_S = 0.25e-3


def _with_optimizer(trace: Trace, **update: float) -> Trace:
    opt = trace.measurements.optimizer.model_copy(update=update)
    meas = trace.measurements.model_copy(update={"optimizer": opt})
    return Trace.model_validate_json(trace.model_copy(update={"measurements": meas}).model_dump_json())


def test_old_trace_without_the_fields_loads_and_keeps_its_hash() -> None:
    trace = with_distributed(synthetic_trace(n_blocks=4), synthetic_distributed(2))
    raw = json.loads(trace.model_dump_json())
    assert "host_step_overhead_s" not in raw["measurements"]["optimizer"]  # left out at 0
    assert "all_reduce" not in raw["hardware"]["distributed"]["collectives"]  # left out when empty
    loaded = Trace.model_validate(raw)
    assert loaded.measurements.optimizer.host_step_overhead_s == 0.0
    assert loaded.hardware.distributed is not None and loaded.hardware.distributed.collectives is not None
    assert loaded.hardware.distributed.collectives.all_reduce == []
    assert loaded.content_hash() == trace.content_hash()
    measured = _with_optimizer(trace, host_step_overhead_s=OVERHEAD_S)
    assert (
        json.loads(measured.model_dump_json())["measurements"]["optimizer"]["host_step_overhead_s"]
        == OVERHEAD_S
    )
    assert measured.content_hash() != trace.content_hash()


def _instance(trace: Trace):  # type: ignore[no-untyped-def]
    constraints = Constraints(device_memory_bytes=80 * GiB)
    layout = candidate_layouts(trace, 1)[0]
    return build_instance(trace, layout, constraints)


def test_each_offloaded_chunk_step_pays_the_overhead_once() -> None:
    base = synthetic_trace(n_blocks=4)
    old, new = _instance(base), _instance(_with_optimizer(base, host_step_overhead_s=OVERHEAD_S))
    overhead_ns = round(OVERHEAD_S * 1e9)
    for a, b in zip(old.host_optim_ns, new.host_optim_ns, strict=True):
        assert b == (a + overhead_ns if a > 0 else 0)  # a chunk without trained bytes makes no call
    decision = Decision(offloaded=(True,) * new.n_chunks, n_buffers=1, modes=(Mode.keep,) * new.n_blocks)
    stepped = sum(1 for h in old.host_optim_ns if h > 0)
    assert stepped > 0
    assert (
        evaluate_decision(new, decision).host_optim_ns
        == evaluate_decision(old, decision).host_optim_ns + stepped * overhead_ns
    )


def test_sharded_steps_pay_the_overhead_and_all_reduce_reads_its_curve() -> None:
    base = with_distributed(synthetic_trace(n_blocks=4), synthetic_distributed(2))
    old = _instance(base)
    new = _instance(_with_optimizer(base, host_step_overhead_s=OVERHEAD_S))
    overhead_ns = round(OVERHEAD_S * 1e9)
    for a, b in zip(old.shard_host_optim_ns, new.shard_host_optim_ns, strict=True):
        assert b == (a + overhead_ns if a > 0 else 0)
    # an all-reduce curve (flat: 1 GB/s) replaces reduce-scatter + all-gather for replicated chunks
    d = base.hardware.distributed
    assert d is not None and d.collectives is not None
    curve = [CollectiveSample(size_bytes=2**20, bytes_per_s=1e9)]
    collectives = d.collectives.model_copy(update={"all_reduce": curve})
    measured = with_distributed(base, d.model_copy(update={"collectives": collectives}))
    inst = _instance(measured)
    # at 1 GB/s (flat) a chunk's all-reduce takes one ns per byte of its gradient
    params = measured.model.parameters
    grad_bytes = [
        sum(params[i].numel for i in range(a, b)) * measured.workload.gradient_bytes_per_param
        for a, b in inst.layout.param_ranges
    ]
    assert inst.all_reduce_ns == tuple(transfer_ns(curve, g) for g in grad_bytes) == tuple(grad_bytes)
    assert inst.all_reduce_ns != old.all_reduce_ns  # before: reduce-scatter + all-gather on the other curves
