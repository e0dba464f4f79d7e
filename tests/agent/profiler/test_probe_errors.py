"""The profiler's probes do not hide bugs: a TypeError/ValueError inside a probe is raised, not turned into a
missing measurement with a warning (issue 18). Other failures of a probe (a block that cannot be re-run) stay a
warning and a trace without that measurement.

The faults are injected into the agent's own probe functions (stand-ins for a bug); the model and the rest of
the profile are real.
"""

from __future__ import annotations

import logging

import pytest
import torch

import agent.profiler.profiling as profile_module
from agent.testing.model_zoo import build_with_library_defaults, sample_batch


def _job() -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    model, config = build_with_library_defaults("gpt2", layers=2, hidden=64, vocab=128, seq=32)
    return model, sample_batch(config, 2, 16)


@pytest.mark.parametrize("name", ["probe_block", "probe_persistent"])
@pytest.mark.parametrize("error", [TypeError, ValueError])
def test_a_bug_inside_a_probe_is_raised(
    monkeypatch: pytest.MonkeyPatch, name: str, error: type[Exception]
) -> None:
    def broken(*args: object, **kwargs: object) -> None:
        raise error(f"bug inside {name}")

    monkeypatch.setattr(profile_module, name, broken)
    model, batch = _job()
    with pytest.raises(error, match=f"bug inside {name}"):
        profile_module.profile(model, batch, repeats=1, allocation_trace=False)


def test_a_probe_that_cannot_run_is_a_warning_and_a_trace(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def cannot(*args: object, **kwargs: object) -> None:
        raise RuntimeError("cannot re-run this block")

    monkeypatch.setattr(profile_module, "probe_block", cannot)
    model, batch = _job()
    with caplog.at_level(logging.WARNING, logger="agent"):
        trace = profile_module.profile(model, batch, repeats=1, allocation_trace=False)
    assert any(
        "runtime probe skipped (RuntimeError: cannot re-run this block)" in r.getMessage()
        for r in caplog.records
    )
    assert all(b.swap_out_s == 0.0 for b in trace.measurements.blocks)
