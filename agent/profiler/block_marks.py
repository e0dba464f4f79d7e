"""Where a training iteration is: the block running now and the phase, plus the marks where it changed.

Block indices are the contract's: 0 = prologue, 1..L = repeated blocks, L+1 = epilogue. Each `Mark`
records the time and the memory gauge at the moment the current (block, phase) changed, so the time and
memory of each block are read off the segments between consecutive marks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from client.contract import Phase


class Gauge(Protocol):
    """Live device bytes now, and the highest value since the last `take_peak()`."""

    def live_bytes(self) -> int: ...

    def take_peak(self) -> int:
        """The peak since the previous call (or since the gauge started), then start a new window."""
        ...

    def take_sub_peak(self) -> int:
        """As `take_peak`, within a segment (a gradient landing): records no mark of its own."""
        ...


@dataclass(frozen=True)
class Mark:
    time_s: float
    block: int | None  # the block that runs from this mark on (None: no block, e.g. the optimizer)
    phase: Phase
    live_bytes: int  # live bytes at this mark (0 when no gauge)
    peak_before_bytes: int  # peak over the segment that this mark ends (0 when no gauge)
    # the same two less the gradients that had landed in `.grad` by then (`BlockTracker.land`): what a block's
    # transient is read from, since the runtime moves each gradient into its chunk's gradient area (counted
    # apart, as model state) as it lands
    net_live_bytes: int = 0
    net_peak_before_bytes: int = 0


@dataclass
class BlockTracker:
    """The current block and phase, updated by the profiler's hooks; keeps the marks of one iteration.

    `land(nbytes)` (a post-accumulate-grad hook) says a gradient just landed in its parameter's `.grad`: from
    then on the marks' net figures leave it out. The peak before a landing still has it (it is the fresh
    gradient the runtime copies out: live beside the chunk's gradient area at that moment)."""

    clock: object  # DeviceClock; typed loosely to keep this module free of torch
    gauge: Gauge | None = None
    block: int | None = None
    phase: Phase = Phase.forward
    marks: list[Mark] = field(default_factory=list)
    landed_bytes: int = 0  # gradients landed in `.grad` since the iteration started
    _peak: int = 0  # over the current segment, up to the last landing
    _net_peak: int = 0

    def land(self, nbytes: int) -> None:
        if self.gauge is not None:
            sub = self.gauge.take_sub_peak()
            self._peak = max(self._peak, sub)
            self._net_peak = max(self._net_peak, sub - self.landed_bytes)
        self.landed_bytes += nbytes

    def move(self, block: int | None, phase: Phase) -> None:
        now = self.clock.now()  # type: ignore[attr-defined]
        live = peak = net_peak = 0
        if self.gauge is not None:
            sub = self.gauge.take_peak()
            peak = max(self._peak, sub)
            net_peak = max(self._net_peak, sub - self.landed_bytes)
            live = self.gauge.live_bytes()
        self._peak = self._net_peak = 0
        self.block, self.phase = block, phase
        self.marks.append(
            Mark(now, block, phase, live, peak, max(0, live - self.landed_bytes), max(0, net_peak))
        )


@dataclass
class Segment:
    block: int | None
    phase: Phase
    seconds: float
    start_live: int
    end_live: int
    peak: int
    # the same less the gradients landed in `.grad` (`Mark.net_live_bytes`); equal to the above when none landed
    net_start_live: int = 0
    net_end_live: int = 0
    net_peak: int = 0


def segments(marks: list[Mark]) -> list[Segment]:
    """The spans between consecutive marks, each attributed to the block and phase its first mark set."""
    out: list[Segment] = []
    for a, b in zip(marks, marks[1:], strict=False):
        out.append(
            Segment(
                a.block,
                a.phase,
                b.time_s - a.time_s,
                a.live_bytes,
                b.live_bytes,
                max(b.peak_before_bytes, a.live_bytes, b.live_bytes),
                a.net_live_bytes,
                b.net_live_bytes,
                max(b.net_peak_before_bytes, a.net_live_bytes, b.net_live_bytes),
            )
        )
    return out


def seconds_by_block(segs: list[Segment], n_blocks: int, phase: Phase) -> list[float]:
    totals = [0.0] * n_blocks
    for s in segs:
        if s.block is not None and s.phase == phase:
            totals[s.block] += s.seconds
    return totals


def transient_peaks(segs: list[Segment], n_blocks: int, phase: Phase) -> list[int]:
    """Per block: peak during its runs in `phase` above the level at their start (backward), or above the
    higher of the levels at their start and end (forward: what the block leaves live at its end, its output and
    saved activations, is counted apart as retained). Levels and peaks are net of the gradients landed in
    `.grad` (`Mark.net_live_bytes`): the planner counts those as model state, and the runtime moves each one
    there as it lands. In backward a gradient that stays live past the block without landing (a tied
    parameter's, held by autograd until its first use's backward) is in the transient of the block that
    produced it; the blocks after it count it as held (`planner_service/solver/held_gradients.py`).

    A block's run is a maximal sequence of consecutive segments attributed to it; when it runs more than
    once in a phase the largest transient counts.
    """
    out = [0] * n_blocks
    i = 0
    while i < len(segs):
        s = segs[i]
        if s.block is None or s.phase != phase:
            i += 1
            continue
        j = i
        peak = s.net_peak
        while j + 1 < len(segs) and segs[j + 1].block == s.block and segs[j + 1].phase == phase:
            j += 1
            peak = max(peak, segs[j].net_peak)
        resident = (
            s.net_start_live if phase == Phase.backward else max(s.net_start_live, segs[j].net_end_live)
        )
        out[s.block] = max(out[s.block], peak - resident)
        i = j + 1
    return out
