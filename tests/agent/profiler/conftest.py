"""Fixtures for the profiler tests: small real Hugging Face models and one hardware probe per session."""

from __future__ import annotations

import pytest
import torch

from client.contract import Hardware


@pytest.fixture(scope="session")
def cpu_hardware() -> Hardware:
    """The measured CPU hardware, probed once and passed to `profile` so tests do not re-measure it."""
    from agent.profiler.hardware import probe_hardware

    return probe_hardware(torch.device("cpu"))
