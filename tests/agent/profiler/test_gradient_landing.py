"""Backward transients are read above the block's start level, net of the gradients landed in `.grad`
(`BlockTracker.land`); forward transients above the higher of the start and end levels, as before."""

from __future__ import annotations

import torch

from agent.profiler.block_marks import BlockTracker, segments, transient_peaks
from agent.profiler.device_clock import DeviceClock
from client.contract import Phase


class CountingGauge:
    """A gauge driven by hand: live bytes, and the peak since the last take."""

    def __init__(self, live: int) -> None:
        self.live = live
        self.peak = live

    def set(self, live: int) -> None:
        self.live = live
        self.peak = max(self.peak, live)

    def live_bytes(self) -> int:
        return self.live

    def take_peak(self) -> int:
        peak, self.peak = self.peak, self.live
        return peak

    def take_sub_peak(self) -> int:
        return self.take_peak()


def test_a_landed_gradient_counts_at_its_landing_and_leaves_the_levels_after_it() -> None:
    gauge = CountingGauge(100)
    bt = BlockTracker(DeviceClock(torch.device("cpu")), gauge=gauge)
    bt.move(1, Phase.backward)  # block 1's backward starts at 100
    gauge.set(150)  # its weight's fresh gradient, 50
    bt.land(50)  # lands in .grad: the runtime copies it into the chunk's gradient area and drops it
    gauge.set(170)  # a temporary of 20
    gauge.set(150)
    bt.move(0, Phase.backward)
    bt.move(None, Phase.optimizer)
    bwd = transient_peaks(segments(bt.marks), 2, Phase.backward)
    assert bwd[1] == 50  # the fresh gradient at its landing (the temporary, after it, adds 20 above 100)
    # before: 170 - max(start 100, end 150) = 20, the gradient read as resident


def test_a_gradient_held_past_the_block_is_in_its_transient() -> None:
    """A tied head's gradient: produced in the epilogue, held by autograd (not landed) until the embedding's."""
    gauge = CountingGauge(100)
    bt = BlockTracker(DeviceClock(torch.device("cpu")), gauge=gauge)
    bt.move(2, Phase.backward)
    gauge.set(130)  # the logits' gradient, 30
    gauge.set(230)  # the head's gradient, 100, held
    gauge.set(200)  # the logits' gradient freed
    bt.move(1, Phase.backward)
    bt.move(None, Phase.optimizer)
    assert transient_peaks(segments(bt.marks), 3, Phase.backward)[2] == 130  # before: 230 - 200 = 30


def test_forward_transients_stay_above_the_higher_of_start_and_end() -> None:
    gauge = CountingGauge(100)
    bt = BlockTracker(DeviceClock(torch.device("cpu")), gauge=gauge)
    bt.move(1, Phase.forward)
    gauge.set(180)
    gauge.set(140)  # leaves 40 saved
    bt.move(2, Phase.forward)
    bt.move(None, Phase.optimizer)
    assert transient_peaks(segments(bt.marks), 3, Phase.forward)[1] == 40
