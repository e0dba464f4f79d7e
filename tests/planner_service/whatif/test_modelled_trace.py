"""The modelled Trace: marked modelled on the wire, measured traces unchanged, times from the roofline."""

from __future__ import annotations

import json

import pytest

from client.contract import ModelledFrom, OptimizerKind, Trace
from planner_service.solver.testing.synthetic import synthetic_trace
from planner_service.whatif import roofline
from planner_service.whatif.catalog import load_catalog
from planner_service.whatif.fake_iteration import OpCosts
from planner_service.whatif.modelled_trace import ModelledWorkload, iterate, trace_on

transformers = pytest.importorskip("transformers")


def test_measured_traces_keep_their_json_and_hash() -> None:
    t = synthetic_trace()
    assert "modelled" not in json.loads(t.model_dump_json())
    assert t.source == "measured"
    marked = t.model_copy(
        update={"modelled": ModelledFrom(hardware_key="l4", method="m", factors={"matmul": 0.6})}
    )
    assert marked.content_hash() != t.content_hash()
    again = Trace.model_validate_json(marked.model_dump_json())
    assert again.source == "modelled" and again.modelled == marked.modelled


def test_a_modelled_trace_is_a_valid_wire_trace_that_says_how_it_was_made() -> None:
    cfg = transformers.AutoConfig.for_model(
        "qwen2",
        num_hidden_layers=6,
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=256,
        vocab_size=1000,
    )
    cat = load_catalog(use_env=False)
    it = iterate(cfg, ModelledWorkload(4, 256, "bf16", OptimizerKind.adamw))
    a100, h100 = trace_on(it, cat["a100-80gb-sxm"]), trace_on(it, cat["h100-sxm"], host_memory_bytes=2**36)
    for t in (a100, h100):
        t2 = Trace.model_validate_json(t.model_dump_json())
        assert t2.source == "modelled" and not t2.modelled.calibrated
        assert (
            "4 of 6 blocks" in t2.modelled.method
            and t2.modelled.factors == roofline.Efficiency().as_factors()
        )
        assert t2.measurements.extrapolated and len(t2.model.blocks) == 8
        assert t2.workload.optimizer_state_bytes_per_param == 4 and t2.workload.gradient_bytes_per_param == 2
    assert h100.hardware.host_memory_bytes == 2**36
    # memory does not depend on the GPU; time does (an H100 is faster in FLOPs and in bandwidth)
    assert [b.activation_bytes for b in a100.measurements.blocks] == [
        b.activation_bytes for b in h100.measurements.blocks
    ]
    assert a100.measurements.peak_device_bytes == h100.measurements.peak_device_bytes
    assert h100.measurements.iteration_s < a100.measurements.iteration_s
    for b in a100.measurements.blocks:
        assert b.recompute_s == b.forward_s and b.backward_s > 0


def test_roofline_prices_an_op_by_its_binding_resource() -> None:
    e = load_catalog(use_env=False)["h100-sxm"]
    eff = roofline.Efficiency(dispatch_s=0.0)
    gemm = OpCosts(flops=[2 * 8192**3], bytes=[3 * 8192**2 * 2], matmul=[True])  # compute-bound
    copy = OpCosts(flops=[0.0], bytes=[2 * 2**30], matmul=[False])  # bandwidth-bound
    assert roofline.block_seconds(gemm, e, "bf16", eff) == pytest.approx(
        2 * 8192**3 / (e.dense_flops.bf16 * 0.6)
    )
    assert roofline.block_seconds(copy, e, "bf16", eff) == pytest.approx(
        2 * 2**30 / (e.memory_bandwidth_bytes_per_s * 0.7)
    )
    tiny = OpCosts(flops=[0.0] * 100, bytes=[64.0] * 100, matmul=[False] * 100)
    assert roofline.block_seconds(tiny, e, "bf16") == pytest.approx(100 * roofline.Efficiency().dispatch_s)


def test_models_built_and_run_in_threads_at_once_are_the_ones_asked_for() -> None:
    """Session 20: `from_config(dtype=)` switches torch's process-wide default dtype while it builds, so two
    what-if requests (or sweeps) at once in the service's thread pool built parts of one model in the other's
    dtype: 642 of 1,280 parameters of 16 concurrent builds, and two identical sweeps got two different traces
    of one point. Builds and runs of fake models now take turns (`architecture.FAKE_RUNS`)."""
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from planner_service.whatif.architecture import fake_model

    cfg = transformers.AutoConfig.for_model(
        "llama", num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=256, max_position_embeddings=64,
    )  # fmt: skip
    want = {"fp32": torch.float32, "bf16": torch.bfloat16}

    def wrong_dtype(dtype: str) -> int:
        model, _ = fake_model(cfg, dtype)
        return sum(p.dtype != want[dtype] for p in model.parameters())

    with ThreadPoolExecutor(8) as pool:
        assert sum(pool.map(wrong_dtype, ["fp32", "bf16"] * 8)) == 0

    def record(dtype: str) -> tuple[int, ...]:
        r = iterate(cfg, ModelledWorkload(2, 16, dtype)).record
        return (r.resident_bytes, r.dynamic_peak_bytes, r.live_after_backward_bytes, *r.activation_bytes)

    alone = {d: record(d) for d in ("fp32", "bf16")}
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(record, ["fp32", "bf16"] * 4))
    assert together == [alone["fp32"], alone["bf16"]] * 4


def test_hybrid_layer_stacks_are_the_blocks_and_run_whole() -> None:
    """A hybrid model's layer list mixes classes (Jamba: Mamba and attention layers): the what-if finds the
    same blocks as the profiler (the list of `num_hidden_layers` layers), and runs every layer rather than
    copying the fourth block's figures to the rest (the layers differ)."""
    from agent.profiler.block_detection import detect_blocks
    from planner_service.whatif.architecture import fake_model, repeated_blocks
    from planner_service.whatif.modelled_trace import varied_layers

    cfg = transformers.JambaConfig(
        hidden_size=64, num_hidden_layers=6, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=128, num_experts=2, num_experts_per_tok=1, mamba_d_state=8, mamba_dt_rank=8,
        attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
        use_mamba_kernels=False, vocab_size=256, bos_token_id=0, eos_token_id=255, pad_token_id=1,
    )  # fmt: skip
    fake, _ = fake_model(cfg)
    real = transformers.AutoModelForCausalLM.from_config(cfg)
    assert (
        repeated_blocks(fake).names
        == detect_blocks(real).names
        == tuple(f"model.layers.{i}" for i in range(6))
    )
    assert varied_layers(cfg, 6)
    llama = transformers.AutoConfig.for_model(
        "llama", num_hidden_layers=6, hidden_size=64, num_attention_heads=2
    )
    assert not varied_layers(llama, 6)
    assert iterate(cfg, ModelledWorkload(1, 16, "bf16")).sampled_blocks is None  # every layer ran
