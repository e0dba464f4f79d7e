"""The persistent-chunk probe times the chunk runtime's own path over every parameter and leaves the model as
it was; on CPU the trace's device optimizer throughput is the runtime's."""

from __future__ import annotations

import logging

import pytest
import torch

from agent.profiler import profile
from agent.profiler.parameters import OrderedParameter
from agent.profiler.persistent_probe import probe_persistent
from agent.testing.model_zoo import build, sample_batch
from client.contract import Hardware


def test_probe_times_the_runtime_path_in_one_chunk_per_block_and_restores_everything() -> None:
    model, _ = build("llama", layers=2, hidden=32, vocab=64, seq=16, seed=0)
    named = list(model.named_parameters())
    ordered = [
        OrderedParameter(param=p, name=n, module_path=n.rsplit(".", 1)[0], block=i // 4, aliases=(n,))
        for i, (n, p) in enumerate(named)
    ]
    values = [p.detach().clone() for _, p in named]
    storages = [p.data_ptr() for _, p in named]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    probe = probe_persistent(model, ordered, opt, torch.device("cpu"))
    assert probe is not None
    assert probe.chunks == -(-len(named) // 4)
    assert probe.stepped_bytes == sum(p.numel() * p.element_size() for _, p in named)
    assert probe.grad_hooks_s > 0 and probe.step_s > 0 and probe.total_s >= probe.step_s + probe.grad_hooks_s
    for (_, p), v, ptr in zip(named, values, storages, strict=True):
        assert p.data_ptr() == ptr and torch.equal(p.detach(), v) and p.grad is None
    assert not opt.state
    assert "zero_grad" not in vars(model) and not model._forward_pre_hooks and not model._forward_hooks


def test_cpu_trace_charges_the_persistent_path_as_the_device_optimizer_throughput(
    cpu_hardware: Hardware, caplog: pytest.LogCaptureFixture
) -> None:
    model, cfg = build("gpt2", layers=2, hidden=32, vocab=64, seq=16, seed=0)
    batch = sample_batch(cfg, 2, 16)
    with caplog.at_level(logging.DEBUG, logger="agent.profiler.profiling"):
        trace = profile(model, batch, hardware=cpu_hardware, allocation_trace=False)
    logged = [r for r in caplog.records if r.getMessage().startswith("persistent chunks:")]
    assert len(logged) == 1
    probe = logged[0].args[0]  # type: ignore[index]
    assert trace.measurements.optimizer.device_bytes_per_s == pytest.approx(
        probe.stepped_bytes / probe.total_s
    )
