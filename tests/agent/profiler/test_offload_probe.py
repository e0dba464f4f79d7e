"""The offloaded whole-model probe times the chunk runtime over every parameter with every chunk offloaded,
leaves the model as it was, and scales the one-block probe's chunk costs; it runs in CPU profiles of jobs of
several ranks, or where `MEMPLAN_WHOLE_MODEL_PROBE=1` (the 2-rank path: tests/agent/distributed)."""

from __future__ import annotations

import logging

import pytest
import torch

from agent.profiler import offload_probe, profile
from agent.profiler.offload_probe import OffloadProbe, probe_offloaded
from agent.profiler.parameters import OrderedParameter
from agent.profiler.runtime_costs import SCALE_BOUNDS, whole_model_scale
from agent.profiler.session import TrainingStep
from agent.testing.model_zoo import build, build_with_library_defaults, sample_batch
from client.contract import Hardware


def _ordered(model: torch.nn.Module) -> list[OrderedParameter]:
    named = list(model.named_parameters())
    return [
        OrderedParameter(param=p, name=n, module_path=n.rsplit(".", 1)[0], block=i // 4, aliases=(n,))
        for i, (n, p) in enumerate(named)
    ]


def test_probe_offloads_one_chunk_per_block_and_restores_everything() -> None:
    model, cfg = build("llama", layers=2, hidden=32, vocab=64, seq=16, seed=0)
    named = list(model.named_parameters())
    ordered = _ordered(model)
    values = [p.detach().clone() for _, p in named]
    storages = [p.data_ptr() for _, p in named]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = TrainingStep(model, sample_batch(cfg, 2, 16), None, opt, 4)
    probe = probe_offloaded(model, ordered, step, opt, torch.device("cpu"))
    assert probe is not None
    chunks = -(-len(named) // 4)
    assert len(probe.chunk_params) == len(probe.chunk_bytes) == chunks
    assert sum(probe.chunk_params) == len(named)
    assert sum(probe.chunk_bytes) == sum(p.numel() * p.element_size() for _, p in named)
    # every chunk at least once (here 4 parameters a chunk in declaration order, not in execution order as the
    # profile's: some chunks are used at several places of forward and uploaded again)
    assert probe.uploads >= chunks and probe.uploads == int(probe.uploads)
    assert probe.entry_points_s > 0
    for (_, p), v, ptr in zip(named, values, storages, strict=True):
        assert p.data_ptr() == ptr and torch.equal(p.detach(), v) and p.grad is None
    assert not opt.state  # the user's optimizer: a fresh one of its class stepped instead
    assert "zero_grad" not in vars(model) and not model._forward_pre_hooks and not model._forward_hooks


def test_frozen_parameters_or_an_unsupported_optimizer_are_not_probed() -> None:
    model, cfg = build("gpt2", layers=2, hidden=32, vocab=64, seq=16, seed=0)
    step = TrainingStep(model, sample_batch(cfg, 2, 16), None, torch.optim.AdamW(model.parameters()), 4)
    lbfgs = torch.optim.LBFGS(model.parameters())
    assert probe_offloaded(model, _ordered(model), step, lbfgs, torch.device("cpu")) is None
    next(model.parameters()).requires_grad_(False)
    adamw = torch.optim.AdamW(p for p in model.parameters() if p.requires_grad)
    assert probe_offloaded(model, _ordered(model), step, adamw, torch.device("cpu")) is None


def test_the_scale_is_the_whole_models_time_over_the_one_blocks_spread_within_bounds(
    cpu_hardware: Hardware,
) -> None:
    whole = OffloadProbe(entry_points_s=0.0, chunk_bytes=(0, 0), chunk_params=(3, 5), uploads=3.0)
    no_step = lambda nbytes: 0.0  # noqa: E731
    # spread: (inside + uploads per chunk x upload) per parameter tensor = (1 ms + 1.5 x 2 ms) x 8 = 32 ms
    spread = (1e-3 + 1.5 * 2e-3) * 8
    at = lambda s: whole_model_scale(  # noqa: E731
        OffloadProbe(s, whole.chunk_bytes, whole.chunk_params, whole.uploads),
        1e-3,
        2e-3,
        cpu_hardware,
        no_step,
    )
    assert at(spread) == pytest.approx(1.0)
    assert at(1.3 * spread) == pytest.approx(1.3)
    assert at(100 * spread) == SCALE_BOUNDS[1] and at(0.0) == SCALE_BOUNDS[0]
    assert (
        whole_model_scale(whole, 0.0, 0.0, cpu_hardware, no_step) == 1.0
    )  # nothing spread: nothing to scale
    # what the cost model charges apart (the host steps here) is not the runtime's own cost
    step_ms = lambda nbytes: 2e-3  # noqa: E731
    assert whole_model_scale(
        OffloadProbe(spread + 4e-3, (0, 0), (3, 5), 3.0), 1e-3, 2e-3, cpu_hardware, step_ms
    ) == pytest.approx(1.0)


@pytest.mark.parametrize("switch", ["1", "0", None])
def test_a_single_process_cpu_profile_runs_it_only_when_switched_on(
    switch: str | None,
    cpu_hardware: Hardware,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if switch is None:
        monkeypatch.delenv(offload_probe.ENV, raising=False)
    else:
        monkeypatch.setenv(offload_probe.ENV, switch)
    # a library-default model as from_pretrained gives it (tied embeddings, the KV cache on)
    model, cfg = build_with_library_defaults("qwen2", layers=2, hidden=32)
    batch = sample_batch(cfg, 2, 16)
    with caplog.at_level(logging.DEBUG, logger="agent.profiler"):
        trace = profile(model, batch, hardware=cpu_hardware, allocation_trace=False)
    scaled = [r for r in caplog.records if r.getMessage().startswith("chunk costs scaled by")]
    if switch != "1":
        assert not scaled
        return
    assert len(scaled) == 1
    scale, whole = scaled[0].args  # type: ignore[misc]
    assert SCALE_BOUNDS[0] <= scale <= SCALE_BOUNDS[1] and whole.entry_points_s > 0
    assert all(b.offload_overhead_s > 0 for b in trace.measurements.blocks)


def test_the_default_is_on_for_jobs_of_several_ranks_and_a_bad_switch_is_named(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(offload_probe.ENV, raising=False)
    assert offload_probe.enabled(2) and not offload_probe.enabled(1)
    monkeypatch.setenv(offload_probe.ENV, "0")
    assert not offload_probe.enabled(4)
    monkeypatch.setenv(offload_probe.ENV, "yes")
    with pytest.raises(ValueError, match="MEMPLAN_WHOLE_MODEL_PROBE: must be 0 or 1, got 'yes'"):
        offload_probe.enabled(2)
