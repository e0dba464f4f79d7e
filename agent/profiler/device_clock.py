"""Device clocks: wall time on CPU, synchronised wall time on CUDA, for timing iterations and hook marks.

On CPU an op has finished when the call returns, so `time.perf_counter` is exact. On CUDA kernels run
asynchronously; the clock synchronises the device before reading the time, so each mark is the moment
all work queued so far has finished. (Synchronising at every hook costs some overlap between host and
device; the per-block sums are rescaled to an un-hooked iteration's wall time afterwards, which is the
calibration the profiler applies to remove hook overhead.) The CUDA path is written to the PyTorch API
but could not be run on the development machine, which has no GPU.
"""

from __future__ import annotations

import time

import torch


class DeviceClock:
    """`now()` in seconds, after the device has finished its queued work."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._cuda = device.type == "cuda"

    def synchronize(self) -> None:
        if self._cuda:
            torch.cuda.synchronize(self.device)

    def now(self) -> float:
        self.synchronize()
        return time.perf_counter()
