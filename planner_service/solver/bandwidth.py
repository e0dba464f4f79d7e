"""Copy (or collective) time by transfer size, read off a measured bandwidth curve (log-size interpolation)."""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from typing import Protocol


class RateSample(Protocol):
    """A point of a curve: `BandwidthSample` (copies) or `CollectiveSample` (collectives, issue 20)."""

    @property
    def size_bytes(self) -> int: ...

    @property
    def bytes_per_s(self) -> float: ...


def bytes_per_s_at(curve: Sequence[RateSample], size_bytes: int) -> float:
    """Bandwidth for a copy of `size_bytes`: linear in log(size) between samples, flat beyond the ends."""
    if not curve:
        raise ValueError("bandwidth curve: needs at least one sample")
    sizes = [s.size_bytes for s in curve]
    if size_bytes <= sizes[0]:
        return curve[0].bytes_per_s
    if size_bytes >= sizes[-1]:
        return curve[-1].bytes_per_s
    i = bisect.bisect_right(sizes, size_bytes)
    lo, hi = curve[i - 1], curve[i]
    w = (math.log(size_bytes) - math.log(lo.size_bytes)) / (math.log(hi.size_bytes) - math.log(lo.size_bytes))
    return lo.bytes_per_s + w * (hi.bytes_per_s - lo.bytes_per_s)


def transfer_ns(curve: Sequence[RateSample], size_bytes: int) -> int:
    """Integer nanoseconds to copy `size_bytes` in one transfer (0 for nothing)."""
    if size_bytes <= 0:
        return 0
    return max(1, round(size_bytes / bytes_per_s_at(curve, size_bytes) * 1e9))


class HostStepRate(Protocol):
    """The trace's host optimizer figures (`client.contract.OptimizerMeasurement`)."""

    @property
    def host_bytes_per_s(self) -> float: ...

    @property
    def host_step_overhead_s(self) -> float: ...


def host_step_ns(optimizer: HostStepRate, stepped_bytes: int) -> int:
    """Integer nanoseconds of one host optimizer step call over `stepped_bytes` (one chunk, or one rank's shard
    of it): the measured per-call overhead plus the bytes over the measured rate; 0 when nothing is stepped
    (a chunk without trained parameters makes no call). A trace without the overhead (0) reads bytes / rate."""
    if stepped_bytes <= 0:
        return 0
    return round((optimizer.host_step_overhead_s + stepped_bytes / optimizer.host_bytes_per_s) * 1e9)
