"""Policy-1.8: the runtime's host copies around each offloaded chunk's host step, charged by bytes off a serial
device (`OptimizerMeasurement.host_copy_bytes_per_s`).

Around a chunk's step the runtime copies its master and optimizer state into the undo backup of a speculative
step, its host gradient into the `.grad` it exposes (a sharded chunk's is an all-gather, charged as one) and,
with a separate fp32 master, the master into the compute copy (`agent/runtime/host_steps.py`). On the
session-15 VM the backup alone took 0.5-1.45x the fused AdamW step of the same chunk, and no term charged
it on a GPU. On a serial (CPU) device the runtime probe's measured offload overhead already includes the
copies, so nothing is added there. A trace without the rate (older ones) loads, keeps its hash and plans as
before.
"""

from __future__ import annotations

import json

from client.contract import Constraints, Trace
from planner_service.solver.bandwidth import host_step_copy_bytes
from planner_service.solver.chunk_grid import candidate_layouts
from planner_service.solver.instance import CostParams, PolicyInstance, build_instance, element_bytes
from planner_service.solver.testing.synthetic import synthetic_distributed, synthetic_trace, with_distributed

GiB = 2**30
RATE = 1e9  # bytes written per second: one ns per byte
UNDO = 12  # undo backup bytes per parameter: an fp32 master and AdamW's two fp32 moments


def _with(trace: Trace, rate: float) -> Trace:
    opt = trace.measurements.optimizer.model_copy(update={"host_copy_bytes_per_s": rate})
    meas = trace.measurements.model_copy(update={"optimizer": opt})
    workload = trace.workload.model_copy(update={"undo_backup_bytes_per_param": UNDO})
    out = trace.model_copy(update={"measurements": meas, "workload": workload})
    return Trace.model_validate_json(out.model_dump_json())


def _instance(trace: Trace, *, serial: bool = False) -> PolicyInstance:
    layout = candidate_layouts(trace, 1)[0]
    params = CostParams(copy_overlap=not serial)
    return build_instance(trace, layout, Constraints(device_memory_bytes=80 * GiB), params)


def test_a_trace_without_the_rate_loads_keeps_its_hash_and_charges_no_copy() -> None:
    trace = synthetic_trace(n_blocks=4)
    raw = json.loads(trace.model_dump_json())
    assert "host_copy_bytes_per_s" not in raw["measurements"]["optimizer"]  # left out at 0
    assert Trace.model_validate(raw).content_hash() == trace.content_hash()
    without, measured = _with(trace, 0.0), _with(trace, RATE)
    assert measured.content_hash() != without.content_hash()
    assert (
        _instance(without).host_optim_ns
        == _instance(without.model_copy(update={"workload": trace.workload})).host_optim_ns
    )


def test_each_replicated_chunk_pays_its_backup_and_its_grad_copy_by_bytes() -> None:
    without, measured = _with(synthetic_trace(n_blocks=4), 0.0), _with(synthetic_trace(n_blocks=4), RATE)
    old, new = _instance(without), _instance(measured)
    elt = element_bytes(measured.workload.precision)
    mixed = measured.workload.master_bytes_per_param > 0  # the synthetic job: bf16 with an fp32 master
    assert mixed
    charged = 0
    for a, b, used in zip(old.host_optim_ns, new.host_optim_ns, new.layout.used_bytes, strict=True):
        if a == 0:  # no trained bytes: no step, no copy
            assert b == 0
            continue
        # every parameter trains here: the backup, the .grad and the refreshed bf16 compute copy of every element
        assert (
            b - a
            == (used // elt) * (UNDO + 2 * elt)
            == host_step_copy_bytes(used // elt, used // elt, elt, UNDO, separate_master=True, fill=True)
        )
        charged += 1
    assert charged > 0


def test_a_sharded_step_pays_its_shards_backup_and_no_grad_copy() -> None:
    base = with_distributed(synthetic_trace(n_blocks=4), synthetic_distributed(2))
    old, new = _instance(_with(base, 0.0)), _instance(_with(base, RATE))
    grew = [b - a for a, b in zip(old.shard_host_optim_ns, new.shard_host_optim_ns, strict=True) if a]
    assert grew and all(g > 0 for g in grew)
    elt = element_bytes(base.workload.precision)
    for a, b, used in zip(
        old.shard_host_optim_ns, new.shard_host_optim_ns, new.layout.used_bytes, strict=True
    ):
        if a:
            shard = -(-(used // elt) // 2)
            # the shard's backup and refreshed compute copy; its .grad is an all-gather
            assert b - a == shard * (UNDO + elt)
    # the replicated alternative pays the whole chunk's copies, so sharding saves host copy time too
    assert sum(new.host_optim_ns) - sum(old.host_optim_ns) > sum(grew)


def test_a_serial_device_charges_no_copy_its_probe_measured_them() -> None:
    base = synthetic_trace(n_blocks=4)
    assert (
        _instance(_with(base, RATE), serial=True).host_optim_ns
        == _instance(_with(base, 0.0), serial=True).host_optim_ns
    )
