"""A bf16 chunk with an fp32 master: its host step streams the master's bytes, 4 per element, twice the chunk's
compute bytes (`bandwidth.host_stepped_bytes`). The probe's host rate is fp32 parameter bytes per second, and the
runtime steps the master (`agent/runtime/stepper.py`); before policy-1.10 the cost model charged the compute
bytes, half the step (found on an H200: the train_throughput bf16 row predicted 75 ms and measured 436 ms)."""

from __future__ import annotations

from client.contract import Constraints, Precision, Trace
from planner_service.solver.bandwidth import host_step_ns, host_stepped_bytes
from planner_service.solver.chunk_grid import candidate_layouts
from planner_service.solver.instance import CostParams, PolicyInstance, build_instance, element_bytes
from planner_service.solver.testing.synthetic import synthetic_distributed, synthetic_trace, with_distributed

GiB = 2**30


def _master(trace: Trace, master_bytes: int) -> Trace:
    return trace.model_copy(
        update={"workload": trace.workload.model_copy(update={"master_bytes_per_param": master_bytes})}
    )


def _instance(trace: Trace) -> PolicyInstance:
    layout = candidate_layouts(trace, 1)[0]
    return build_instance(
        trace, layout, Constraints(device_memory_bytes=80 * GiB), CostParams(copy_overlap=False)
    )


def test_stepped_bytes_are_the_masters_with_one_else_the_compute_copys() -> None:
    assert host_stepped_bytes(1000, 2, separate_master=True) == 4000
    assert host_stepped_bytes(1000, 2, separate_master=False) == 2000
    assert host_stepped_bytes(1000, 4, separate_master=False) == 4000


def test_a_bf16_chunk_with_a_master_steps_twice_its_compute_bytes() -> None:
    trace = synthetic_trace(n_blocks=4)
    assert trace.workload.precision == Precision.bf16
    opt = trace.measurements.optimizer
    mixed, pure = _instance(_master(trace, 4)), _instance(_master(trace, 0))
    elt = element_bytes(trace.workload.precision)
    stepped = 0
    # a serial device: the copies around the step are in the measured offload overhead, so the step alone differs
    for a, b, used in zip(mixed.host_optim_ns, pure.host_optim_ns, mixed.layout.used_bytes, strict=True):
        if not b:
            assert not a
            continue
        assert a == host_step_ns(opt, (used // elt) * 4) and b == host_step_ns(opt, used)
        assert a > b  # the master's bytes are twice the compute copy's
        stepped += 1
    assert stepped > 0


def test_a_sharded_bf16_chunk_steps_its_masters_shard() -> None:
    trace = with_distributed(synthetic_trace(n_blocks=4), synthetic_distributed(2))
    opt = trace.measurements.optimizer
    mixed, pure = _instance(_master(trace, 4)), _instance(_master(trace, 0))
    elt = element_bytes(trace.workload.precision)
    checked = 0
    for a, b, used in zip(
        mixed.shard_host_optim_ns, pure.shard_host_optim_ns, mixed.layout.used_bytes, strict=True
    ):
        if not b:
            continue
        shard = -(-(used // elt) // 2)
        assert a == host_step_ns(opt, shard * 4) and b == host_step_ns(opt, shard * elt)
        checked += 1
    assert checked > 0
