"""Frozen parameters in the planner: gradient and optimizer state (and the undo backup, and the optimizer's
time) count only for trainable parameters, exactly as the chunk runtime holds them; an all-trainable trace
is planned exactly as before, and the flag stays out of its JSON (content hash unchanged)."""

from __future__ import annotations

from client.contract import Constraints, Precision, Trace, parameter_slot_bytes
from planner_service.solver.chunk_grid import candidate_layouts
from planner_service.solver.instance import build_instance, element_bytes
from planner_service.solver.testing.synthetic import synthetic_trace


def frozen_except_attention(trace: Trace) -> Trace:
    params = [
        p.model_copy(update={"trainable": "attn" in p.name or "q_proj" in p.name})
        for p in trace.model.parameters
    ]
    assert any(p.trainable for p in params) and not all(p.trainable for p in params)
    return trace.model_copy(update={"model": trace.model.model_copy(update={"parameters": params})})


def test_trainable_flag_is_left_out_of_the_json_at_its_default() -> None:
    trace = synthetic_trace(n_blocks=2, hidden=128, vocab=500, batch=1, seq=32)
    assert all(p.trainable for p in trace.model.parameters)
    assert '"trainable"' not in trace.model_dump_json()
    frozen = frozen_except_attention(trace)
    assert '"trainable":false' in frozen.model_dump_json()
    assert Trace.model_validate_json(frozen.model_dump_json()) == frozen
    assert frozen.content_hash() != trace.content_hash()


def test_frozen_parameters_have_no_gradient_or_optimizer_state_in_the_chunk_state() -> None:
    trace = synthetic_trace(n_blocks=3, hidden=256, vocab=1000, batch=1, seq=64, precision=Precision.bf16)
    frozen = frozen_except_attention(trace)
    w = trace.workload
    elt = element_bytes(w.precision)
    constraints = Constraints(device_memory_bytes=trace.hardware.device_memory_bytes)
    layout = candidate_layouts(trace)[0]
    full = build_instance(trace, layout, constraints)
    part = build_instance(frozen, layout, constraints)
    for c, (a, b) in enumerate(layout.param_ranges):
        used = layout.used_bytes[c]
        ps = frozen.model.parameters[a:b]
        trained = sum(parameter_slot_bytes(p.numel, p.bytes // p.numel) for p in ps if p.trainable)
        per_trained = w.gradient_bytes_per_param + w.optimizer_state_bytes_per_param
        expected = used + (used // elt) * w.master_bytes_per_param + (trained // elt) * per_trained
        assert part.state_bytes(c) == expected
        assert part.state_bytes(c) < full.state_bytes(c)
        # offloaded: the runtime's host gradient is the whole chunk's whatever trains
        frozen_grad = (used // elt - trained // elt) * w.gradient_bytes_per_param
        undo = (used // elt - trained // elt) * w.undo_backup_bytes_per_param
        assert (
            part.host_bytes(c)
            == full.host_bytes(c)
            - (used // elt - trained // elt) * (w.optimizer_state_bytes_per_param)
            - undo
        )
        assert part.host_bytes(c) - part.state_bytes(c) >= frozen_grad
        assert part.host_optim_ns[c] <= full.host_optim_ns[c]
        assert part.device_optim_ns[c] <= full.device_optim_ns[c]
    assert part.pinned_bytes_of == full.pinned_bytes_of
