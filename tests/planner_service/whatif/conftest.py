"""Fixtures for the what-if tests: one CPU hardware probe per session (for the profiler comparisons)."""

from __future__ import annotations

import pytest
import torch

from client.contract import CatalogEntry, Hardware, Trace


@pytest.fixture(scope="session")
def cpu_hardware() -> Hardware:
    """The measured CPU hardware, probed once and passed to `profile` so tests do not re-measure it."""
    from agent.profiler.hardware import probe_hardware

    return probe_hardware(torch.device("cpu"))


# A small Llama measured on this CPU, for the calibration tests (tests/planner_service/whatif/test_calibrate.py, test_whatif_api.py).
SMALL_LLAMA = dict(
    num_hidden_layers=3,
    hidden_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    intermediate_size=256,
    max_position_embeddings=128,
)
SMALL_LLAMA_WORKLOADS = [(2, 32), (4, 64)]


def small_llama_config() -> object:
    import transformers

    return transformers.AutoConfig.for_model("llama", **SMALL_LLAMA)


def cpu_entry(hw: Hardware) -> CatalogEntry:
    """This machine's CPU as a catalogue entry: its device name as the profiler reports it, nominal figures."""
    from planner_service.whatif.catalog import shipped

    e = shipped().entries[0].model_dump()
    e.update(
        key="this-cpu",
        name=hw.device_name,
        vendor="cpu",
        device_memory_bytes=hw.device_memory_bytes,
        memory_bandwidth_bytes_per_s=20e9,
        dense_flops={"bf16": 50e9, "fp16": 50e9, "fp32": 100e9},
        host_memory_bytes=hw.host_memory_bytes,
        cpu_cores=hw.cpu_cores,
        notes="this test machine's CPU",
    )
    return CatalogEntry.model_validate(e)


@pytest.fixture(scope="session")
def measured_small_llama(cpu_hardware: Hardware) -> list[Trace]:
    """Real measured traces (`agent.profile`, fp32, this CPU) of the small Llama at two workloads."""
    import transformers

    import agent

    out = []
    for batch, seq in SMALL_LLAMA_WORKLOADS:
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(small_llama_config())
        model.train()
        ids = torch.randint(0, SMALL_LLAMA["vocab_size"], (batch, seq))
        out.append(
            agent.profile(
                model,
                {"input_ids": ids, "labels": ids},
                allocation_trace=False,
                repeats=3,
                hardware=cpu_hardware,
            )
        )
    return out
