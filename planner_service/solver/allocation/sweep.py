"""Sweep over logical time: sections (maximal live sets), pairwise overlaps, independent partitions.

Follows MiniMalloc's sweeper (google/minimalloc src/sweeper.cc, Apache-2.0), rewritten: endpoints are
visited in time order with frees before allocations at equal times; a *section* is recorded at the first
free after time advanced, so each section is a maximal set of simultaneously live buffers and every
buffer spans a contiguous range of sections. A *partition* is a run of sections that no buffer crosses:
partitions are solved independently. `cuts[s]` counts buffers spanning both section s and s+1.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(slots=True)
class Partition:
    buffers: list[int]  # indices into the problem's buffer lists
    section_lo: int  # first section of the partition
    section_hi: int  # one past the last section


@dataclass(slots=True)
class SweepResult:
    sections: list[list[int]]  # buffers live in each section
    section_lo: list[int]  # per buffer: first section it spans
    section_hi: list[int]  # per buffer: one past the last section it spans
    overlaps: list[list[int]]  # per buffer: buffers live at some common time
    partitions: list[Partition]

    def cuts(self) -> list[int]:
        cuts = [0] * max(len(self.sections) - 1, 0)
        for lo, hi in zip(self.section_lo, self.section_hi, strict=True):
            for s in range(lo, hi - 1):
                cuts[s] += 1
        return cuts


def sweep(lowers: Sequence[int], uppers: Sequence[int]) -> SweepResult:
    n = len(lowers)
    # (time, kind, index): kind 0 = free (right end) sorts before 1 = alloc (left end) at equal times.
    points = sorted([(uppers[i], 0, i) for i in range(n)] + [(lowers[i], 1, i) for i in range(n)])
    sections: list[list[int]] = []
    section_lo = [0] * n
    section_hi = [0] * n
    overlaps: list[list[int]] = [[] for _ in range(n)]
    partitions: list[Partition] = []
    live: dict[int, None] = {}  # insertion-ordered set
    last_time: int | None = None
    partition_start = 0
    for time, kind, i in points:
        if last_time is None:
            last_time = time
        if kind == 0:
            if last_time < time:
                last_time = time
                sections.append(list(live))
            del live[i]
            section_hi[i] = len(sections)
            if not live:
                partitions[-1].section_lo = partition_start
                partitions[-1].section_hi = len(sections)
                partition_start = len(sections)
        else:
            if not live:
                partitions.append(Partition(buffers=[], section_lo=0, section_hi=0))
            partitions[-1].buffers.append(i)
            for j in live:
                overlaps[i].append(j)
                overlaps[j].append(i)
            live[i] = None
            section_lo[i] = len(sections)
    return SweepResult(sections, section_lo, section_hi, overlaps, partitions)
