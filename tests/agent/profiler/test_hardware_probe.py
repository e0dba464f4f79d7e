"""The hardware probe's copy timing: an error in either of the duplex probe's threads reaches the caller."""

from __future__ import annotations

import pytest
import torch


def test_a_copy_that_fails_in_the_probes_second_thread_raises_in_the_caller() -> None:
    """Defect (session 33): the duplex probe's second thread swallowed its error and left its time at 0, which
    became a bandwidth of 1e15 B/s and a pydantic error about it (under torch.inference_mode: copies into
    inference tensors fail outside it)."""
    from agent.profiler.device_clock import DeviceClock
    from agent.profiler.hardware import _threads_together

    clock = DeviceClock(torch.device("cpu"))
    ok = (torch.empty(8), torch.ones(8))
    bad = (torch.empty(8), torch.ones(9))  # shapes that cannot copy
    with pytest.raises(RuntimeError, match="size"):
        _threads_together(clock, ok, bad)
    first, second = _threads_together(clock, ok, ok)
    assert first > 0 and second > 0
