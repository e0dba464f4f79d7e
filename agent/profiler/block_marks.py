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


@dataclass(frozen=True)
class Mark:
    time_s: float
    block: int | None  # the block that runs from this mark on (None: no block, e.g. the optimizer)
    phase: Phase
    live_bytes: int  # live bytes at this mark (0 when no gauge)
    peak_before_bytes: int  # peak over the segment that this mark ends (0 when no gauge)


@dataclass
class BlockTracker:
    """The current block and phase, updated by the profiler's hooks; keeps the marks of one iteration."""

    clock: object  # DeviceClock; typed loosely to keep this module free of torch
    gauge: Gauge | None = None
    block: int | None = None
    phase: Phase = Phase.forward
    marks: list[Mark] = field(default_factory=list)

    def move(self, block: int | None, phase: Phase) -> None:
        now = self.clock.now()  # type: ignore[attr-defined]
        live = peak = 0
        if self.gauge is not None:
            peak = self.gauge.take_peak()
            live = self.gauge.live_bytes()
        self.block, self.phase = block, phase
        self.marks.append(Mark(now, block, phase, live, peak))


@dataclass
class Segment:
    block: int | None
    phase: Phase
    seconds: float
    start_live: int
    end_live: int
    peak: int


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
    """Per block: peak during its runs in `phase` above the higher of the levels at their start and end.

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
        peak = s.peak
        while j + 1 < len(segs) and segs[j + 1].block == s.block and segs[j + 1].phase == phase:
            j += 1
            peak = max(peak, segs[j].peak)
        resident = max(s.start_live, segs[j].end_live)
        out[s.block] = max(out[s.block], peak - resident)
        i = j + 1
    return out
