"""The wire contract rejects impossible values with field paths, hashes stably, and stays light to import."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
from pydantic import ValidationError

from client.contract import Constraints, Feedback, Plan, Trace
from client.units import format_bytes, parse_bytes
from planner_service.solver.testing.synthetic import synthetic_trace
from tests.client.contract.forms import schema_1, trace_with_events


def _raw() -> dict:
    return json.loads(synthetic_trace(n_blocks=3, hidden=64, vocab=100, batch=1, seq=16).canonical_json())


def _error_fields(raw: dict) -> list[str]:
    with pytest.raises(ValidationError) as info:
        Trace.model_validate(raw)
    return [".".join(str(p) for p in e["loc"]) + " :: " + e["msg"] for e in info.value.errors()]


def test_valid_trace_round_trips_through_json_unchanged() -> None:
    t = synthetic_trace(n_blocks=3, hidden=64, vocab=100)
    again = Trace.model_validate_json(t.model_dump_json())
    assert again == t
    assert again.content_hash() == t.content_hash()


def test_negative_size_is_rejected_naming_the_field() -> None:
    raw = _raw()
    raw["model"]["parameters"][0]["bytes"] = -4
    assert any(f.startswith("model.parameters.0.bytes") for f in _error_fields(raw))


def test_trainable_is_a_strict_boolean_left_out_at_its_default() -> None:
    """Defect found by the OpenAPI fuzzer: `trainable: 0` was accepted (lax bool) where the schema says
    boolean; every other flag of the contract is strict."""
    raw = _raw()
    raw["model"]["parameters"][0]["trainable"] = 0
    assert any(f.startswith("model.parameters.0.trainable") for f in _error_fields(raw))
    raw["model"]["parameters"][0]["trainable"] = False
    frozen = Trace.model_validate(raw)
    assert frozen.model.parameters[0].trainable is False
    assert b'"trainable"' not in Trace.model_validate(_raw()).canonical_json()


def test_use_blocks_start_at_the_first_use_ascend_name_real_blocks_and_are_left_out_when_empty() -> None:
    """`ParameterInfo.use_blocks` (session 9): optional and additive; a trace without it loads unchanged."""
    raw = _raw()
    first = raw["model"]["parameters"][0]
    assert "use_blocks" not in first
    last = len(raw["model"]["blocks"]) - 1
    first["use_blocks"] = [first["block"], last]
    assert Trace.model_validate(raw).model.parameters[0].use_blocks == [first["block"], last]
    for bad, says in (
        ([first["block"] + 1, last], "start with"),
        ([first["block"], last, last], "ascending"),
        ([first["block"], last + 1], "names no block"),
    ):
        first["use_blocks"] = bad
        assert any("parameters[0].use_blocks" in f and says in f for f in _error_fields(raw)), bad
    first["use_blocks"] = []
    assert b'"use_blocks"' not in Trace.model_validate(raw).canonical_json()
    assert Trace.model_validate(raw).content_hash() == Trace.model_validate(_raw()).content_hash()


def test_nan_and_infinity_are_rejected() -> None:
    for bad in (math.nan, math.inf):
        raw = _raw()
        raw["measurements"]["blocks"][1]["forward_s"] = bad
        assert any(f.startswith("measurements.blocks.1.forward_s") for f in _error_fields(raw))


def test_parameter_referencing_unknown_block_is_rejected() -> None:
    raw = _raw()
    raw["model"]["parameters"][-1]["block"] = 99
    assert any("parameters[" in f and "names no block" in f for f in _error_fields(raw))


def test_block_bytes_must_match_its_parameters() -> None:
    raw = _raw()
    raw["model"]["blocks"][1]["parameter_bytes"] += 1
    assert any("blocks[1].parameter_bytes" in f for f in _error_fields(raw))


def test_free_before_alloc_is_rejected() -> None:
    raw = _raw()
    raw["allocation_trace"] = {
        "source": "dispatch_tracker",
        "horizon": 10,
        "events": [
            {
                "id": 0,
                "size_bytes": 512,
                "alloc_index": 5,
                "free_index": 3,
                "category": "temp",
                "phase": "forward",
            }
        ],
    }
    assert any("free_index" in f for f in _error_fields(raw))


def _columns_trace(**columns: list) -> dict:
    raw = _raw()
    n = 4
    cols = {
        "id": list(range(n)),
        "size_bytes": [512] * n,
        "alloc_index": [0, 1, 2, 3],
        "free_index": [2, None, 4, 5],
        "category": ["temp"] * n,
        "block": [0, None, 1, 2],
        "phase": ["forward"] * n,
    }
    cols.update(columns)
    raw["allocation_trace"] = {"source": "dispatch_tracker", "horizon": 5, "event_columns": cols}
    return raw


def test_event_columns_are_checked_row_by_row_with_the_first_bad_row_named() -> None:
    Trace.model_validate(_columns_trace())  # valid as given
    cases = {
        "events[1].alloc_index: 5 is not below horizon 5": {"alloc_index": [0, 5, 2, 3]},
        "events[2].free_index: 2 is not after alloc_index 2": {"free_index": [2, None, 2, 5]},
        "events[3].free_index: 6 is beyond horizon 5": {"free_index": [2, None, 4, 6]},
        "events[2].id: 1 appears twice": {"id": [0, 1, 1, 3]},
        "allocation_trace.events[3].block: 9 names no block": {"block": [0, None, 1, 9]},
        "event_columns.phase: has 3 entries": {"phase": ["forward"] * 3},
    }
    for message, columns in cases.items():
        assert any(message in f for f in _error_fields(_columns_trace(**columns))), message
    assert any(
        f.startswith("allocation_trace.event_columns.category.1")
        for f in _error_fields(_columns_trace(category=["temp", "scratch", "temp", "temp"]))
    )


def test_event_column_names_are_the_enums_values_and_events_give_members() -> None:
    from typing import get_args

    from client.contract.trace import AllocationCategory, CategoryName, Phase, PhaseName

    assert list(get_args(CategoryName)) == [c.value for c in AllocationCategory]
    assert list(get_args(PhaseName)) == [p.value for p in Phase]
    trace = Trace.model_validate(_columns_trace())
    assert trace.allocation_trace is not None
    event = trace.allocation_trace.events[0]
    assert event.category is AllocationCategory.temp and event.phase is Phase.forward
    assert (
        trace.allocation_trace.columns.phase[0] == "forward"
        and trace.allocation_trace.columns.block[1] is None
    )


def test_schema_1_lists_and_schema_2_packed_arrays_are_the_same_trace() -> None:
    packed = trace_with_events()
    context: dict = {}
    old = Trace.model_validate_json(json.dumps(schema_1(packed)), context=context)
    assert old == packed and old.content_hash() == packed.content_hash()
    assert (old.schema_version, context["received_schema_version"]) == (2, 1)
    wire = json.loads(old.canonical_json())
    assert wire["schema_version"] == 2 and set(wire["allocation_trace"]) == {
        "source",
        "horizon",
        "event_arrays",
    }
    # Python input (json.loads of a trace) reads the base64 text as base64, as JSON input does
    assert Trace.model_validate(wire) == packed == Trace.model_validate_json(old.canonical_json())
    assert old.allocation_trace is not None and packed.allocation_trace is not None
    assert old.allocation_trace.events == packed.allocation_trace.events


def _packed_trace(horizon: int = 5, **columns: list) -> dict:
    """A 4-event trace in the packed form, with `columns` replacing valid defaults."""
    import base64

    import numpy as np

    from client.contract.trace import EVENT_DTYPES

    cols = {
        "id": [0, 1, 2, 3],
        "size_bytes": [512] * 4,
        "alloc_index": [0, 1, 2, 3],
        "free_index": [2, -1, 4, 5],
        "category": [4] * 4,
        "block": [0, -1, 1, 2],
        "phase": [0] * 4,
    }
    cols.update(columns)
    raw = _raw()
    raw["allocation_trace"] = {
        "source": "dispatch_tracker",
        "horizon": horizon,
        "event_arrays": {
            "count": 4,
            **{
                f: base64.urlsafe_b64encode(np.array(v, dtype=EVENT_DTYPES[f]).tobytes()).decode()
                for f, v in cols.items()
            },
        },
    }
    return raw


def test_packed_events_are_checked_by_arrays_with_the_first_bad_row_named() -> None:
    Trace.model_validate(_packed_trace())  # valid as given
    cases = {
        "events[1].alloc_index: 5 is not below horizon 5": {"alloc_index": [0, 5, 2, 3]},
        "events[2].free_index: 2 is not after alloc_index 2": {"free_index": [2, -1, 2, 5]},
        "events[3].free_index: 6 is beyond horizon 5": {"free_index": [2, -1, 4, 6]},
        "events[1].free_index: 0 must be -1 (long-lived) or at least 1": {"free_index": [2, 0, 4, 5]},
        "events[2].id: 1 appears twice": {"id": [0, 1, 1, 3]},
        "events[0].id: -4 is negative": {"id": [-4, 1, 2, 3]},
        "events[3].size_bytes: 0 is not in 1..2**53": {"size_bytes": [512, 512, 512, 0]},
        # each size valid, together past 2**53: the planners' int64 sums wrapped (session 19 probe)
        "event_arrays.size_bytes: the 4 events add up to": {"size_bytes": [2**53, 2**53, 512, 512]},
        "events[1].category: 5 names no category": {"category": [4, 5, 4, 4]},
        "events[2].phase: 3 names no phase": {"phase": [0, 0, 3, 0]},
        "events[1].block: -2 must be -1 (none)": {"block": [0, -2, 1, 2]},
        "allocation_trace.events[3].block: 9 names no block": {"block": [0, -1, 1, 9]},
        "event_arrays.phase: 3 bytes; 4 events of u1 are 4 bytes": {"phase": [0, 0, 0]},
    }
    for message, columns in cases.items():
        assert any(message in f for f in _error_fields(_packed_trace(**columns))), message
    raw = _packed_trace()
    raw["allocation_trace"]["event_arrays"]["size_bytes"] = "not base64!"
    assert any(f.startswith("allocation_trace.event_arrays.size_bytes") for f in _error_fields(raw))
    raw = _packed_trace()
    del raw["allocation_trace"]["event_arrays"]
    assert any("event_arrays: required" in f for f in _error_fields(raw))


def test_event_arrays_from_numbers_refuse_values_the_packed_dtype_cannot_hold() -> None:
    from client.contract import EventArrays
    from client.contract.trace import CATEGORIES

    ok = dict(id=[0], size_bytes=[8], alloc_index=[0], free_index=[1], category=[4], block=[-1], phase=[0])
    assert EventArrays.from_arrays(**ok).count == 1
    with pytest.raises(ValueError, match="event_arrays.alloc_index: values do not fit <i4"):
        EventArrays.from_arrays(**(ok | {"alloc_index": [2**31]}))
    with pytest.raises(ValueError, match="'scratch' is not one of param, grad"):
        EventArrays.codes(["temp", "scratch"], CATEGORIES)


def test_unknown_fields_and_wrong_schema_version_are_rejected() -> None:
    raw = _raw()
    raw["surprise"] = 1
    assert any(f.startswith("surprise") for f in _error_fields(raw))
    raw = _raw()
    raw["schema_version"] = 3
    assert any(f.startswith("schema_version") for f in _error_fields(raw))


def test_measurements_must_cover_every_block_in_order() -> None:
    raw = _raw()
    raw["measurements"]["blocks"].pop()
    assert any("measurements.blocks" in f for f in _error_fields(raw))


def test_more_blocks_than_the_declared_limit_are_rejected() -> None:
    from client.contract.common import MAX_BLOCKS

    raw = _raw()
    raw["model"]["blocks"] = raw["model"]["blocks"] * (MAX_BLOCKS // 3 + 2)
    assert any(f.startswith("model.blocks") and "at most" in f for f in _error_fields(raw))


def test_the_forward_and_step_parts_of_the_per_chunk_cost_are_parts_of_it_and_left_out_when_zero() -> None:
    """`BlockMeasurement.offload_forward_s`, `offload_step_s` (session 32): optional and additive, so traces from
    before them keep their content hashes; together never more than the `offload_overhead_s` they are parts of."""
    raw = _raw()
    block = raw["measurements"]["blocks"][1]
    assert "offload_forward_s" not in block and "offload_step_s" not in block
    before = Trace.model_validate(raw).content_hash()
    block["offload_forward_s"] = block["offload_step_s"] = 0.0
    assert Trace.model_validate(raw).content_hash() == before
    block["offload_overhead_s"], block["offload_forward_s"] = 0.002, 0.003
    assert any(
        f.startswith("measurements.blocks.1")
        and "offload_forward_s: offload_forward_s 0.003 + offload_step_s 0.0 is more than offload_overhead_s"
        in f
        for f in _error_fields(raw)
    )
    block["offload_forward_s"], block["offload_step_s"] = 0.0015, 0.001  # together more than the whole
    assert any(
        "offload_step_s: offload_forward_s 0.0015 + offload_step_s 0.001" in f for f in _error_fields(raw)
    )
    block["offload_forward_s"], block["offload_step_s"] = 0.0005, 0.0015
    split = Trace.model_validate(raw)
    assert split.measurements.blocks[1].offload_forward_s == 0.0005
    assert split.measurements.blocks[1].offload_step_s == 0.0015
    assert b'"offload_forward_s":0.0005' in split.canonical_json()


def test_content_hash_ignores_key_order_but_not_content() -> None:
    t = synthetic_trace(n_blocks=2, hidden=64, vocab=100)
    shuffled = Trace.model_validate(dict(reversed(list(json.loads(t.model_dump_json()).items()))))
    assert shuffled.content_hash() == t.content_hash()
    other = synthetic_trace(n_blocks=2, hidden=64, vocab=101)
    assert other.content_hash() != t.content_hash()


def test_feasible_plan_without_policy_is_rejected() -> None:
    with pytest.raises(ValidationError, match="policy"):
        Plan.model_validate(
            {
                "trace_hash": "x",
                "constraints": {"device_memory_bytes": 1},
                "solver": {"solver": "s", "solver_version": "1", "status": "optimal", "solve_s": 0},
            }
        )


def test_feedback_and_constraints_validate_ranges() -> None:
    with pytest.raises(ValidationError, match="steps_measured"):
        Feedback(iteration_s=1.0, peak_device_bytes=1, peak_host_bytes=1, steps_measured=0)
    with pytest.raises(ValidationError, match="device_memory_bytes"):
        Constraints(device_memory_bytes=0)


@pytest.mark.parametrize(
    ("text", "value"),
    [("8GiB", 8 * 2**30), ("512MiB", 512 * 2**20), ("1.5GB", 1_500_000_000), ("4096", 4096), ("2 kib", 2048)],
)
def test_byte_sizes_parse(text: str, value: int) -> None:
    assert parse_bytes(text) == value


def test_bad_byte_size_names_the_input() -> None:
    with pytest.raises(ValueError, match="8 parsecs"):
        parse_bytes("8 parsecs")
    assert format_bytes(3 * 2**30) == "3.00 GiB"


def test_client_imports_without_torch_fastapi_or_ortools() -> None:
    code = (
        "import sys, client, client.sdk, client.cli.remote, memplan.cli; "
        "bad=[m for m in ('torch','fastapi','ortools','sqlalchemy') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_hardware_key_names_the_cpu_by_its_ram_and_never_says_0gib() -> None:
    from client.contract import DeviceType

    hw = synthetic_trace(n_blocks=2).hardware
    cpu = hw.model_copy(
        update={
            "device_type": DeviceType.cpu,
            "device_name": "AMD EPYC",
            "device_memory_bytes": 200 * 2**20,
            "host_memory_bytes": 64 * 2**30,
        }
    )
    assert cpu.key == "cpu:AMD EPYC:64GiB:x1"  # a limit of 200 MiB a job planned under names no machine
    assert cpu.machine_device_memory_bytes == 64 * 2**30
    small = hw.model_copy(update={"device_memory_bytes": 512 * 2**20})
    assert small.key.endswith(":512MiB:x1")
    assert hw.key.endswith(":80GiB:x1")


def test_workload_clipping_fields_are_strict() -> None:
    """`clips_gradients` takes a JSON boolean only (0/1 are refused, as for every Bool of the contract)."""
    import pydantic

    from client.contract import Workload

    base = {
        "batch_size": 1,
        "sequence_length": 1,
        "precision": "fp32",
        "optimizer": "adamw",
        "optimizer_state_bytes_per_param": 8,
        "gradient_bytes_per_param": 4,
    }
    assert Workload.model_validate({**base, "clips_gradients": True}).clips_gradients is True
    assert Workload.model_validate(base).undo_backup_bytes_per_param == 0
    for bad in (
        {"clips_gradients": 0},
        {"undo_backup_bytes_per_param": 81},
        {"undo_backup_bytes_per_param": 1.0},
    ):
        with pytest.raises(pydantic.ValidationError):
            Workload.model_validate({**base, **bad})


def test_a_job_that_clips_has_its_own_workload_key() -> None:
    """A plan reused from history must come from a job that clips alike (its prediction counts the redo)."""
    from client.contract import Workload

    base = {
        "batch_size": 2,
        "sequence_length": 16,
        "precision": "fp32",
        "optimizer": "adamw",
        "optimizer_state_bytes_per_param": 8,
        "gradient_bytes_per_param": 4,
    }
    plain = Workload.model_validate(base)
    clipped = Workload.model_validate({**base, "clips_gradients": True})
    assert plain.key == "b2:s16:fp32:adamw"  # keys of jobs that do not clip are as before
    assert clipped.key == "b2:s16:fp32:adamw:clip"


def test_plan_statuses_are_one_enum_whose_final_members_are_the_three_outcomes() -> None:
    """Issue 18: the statuses were spelled out in six places; the contract's `PlanStatus` is the one list."""
    from client.contract import FINAL_PLAN_STATUSES, PENDING_PLAN_STATUSES, PlanRecord, PlanStatus

    assert [s.value for s in PlanStatus] == ["queued", "running", "done", "failed", "infeasible"]
    assert {s for s in PlanStatus if s.final} == FINAL_PLAN_STATUSES == {"done", "failed", "infeasible"}
    assert {s for s in PlanStatus if s.pending} == PENDING_PLAN_STATUSES == {"queued", "running"}
    fields = PlanRecord.model_json_schema()["$defs"]["PlanStatus"]
    assert fields["enum"] == [s.value for s in PlanStatus]  # the wire's list is the enum's
    with pytest.raises(ValidationError, match="status"):
        PlanRecord.model_validate({"status": "paused"})


def test_a_parameter_shape_must_hold_its_numel() -> None:
    """Session 19 probe: a shape of [-3, 7] (or one whose product is not `numel`) was accepted."""
    from client.contract.trace import ParameterInfo

    ok = {"name": "w", "block": 0, "shape": [3, 7], "dtype": "float32", "numel": 21, "bytes": 84}
    assert ParameterInfo.model_validate(ok).numel == 21
    assert ParameterInfo.model_validate(ok | {"shape": [], "numel": 1, "bytes": 4}).shape == []
    with pytest.raises(ValueError, match="negative dimension"):
        ParameterInfo.model_validate(ok | {"shape": [-3, -7]})
    with pytest.raises(ValueError, match=r"holds 20 elements, numel says 21"):
        ParameterInfo.model_validate(ok | {"shape": [4, 5]})


def test_a_sweeps_time_limit_is_a_strict_number_like_every_other() -> None:
    """Session 19 probe: `SweepRequest.time_limit_s` took `true` and "1" (a plain float)."""
    import pydantic

    from client.contract.whatif import SweepRequest

    body = {
        "config": {"model_type": "llama"},
        "hardware": ["h100-sxm"],
        "batch_sizes": [1],
        "sequence_lengths": [8],
    }
    assert SweepRequest.model_validate(body | {"time_limit_s": 3}).time_limit_s == 3.0
    for bad in (True, "1"):
        with pytest.raises(pydantic.ValidationError, match="time_limit_s"):
            SweepRequest.model_validate(body | {"time_limit_s": bad})
