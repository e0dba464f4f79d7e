"""Copy time by transfer size, read off a measured bandwidth curve (rate linear in log size: `transfer_ns`), and a
collective's time off its measured curve (time linear in size: `collective_ns`)."""

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


def collective_ns(curve: Sequence[RateSample], size_bytes: int) -> int:
    """Integer nanoseconds of one collective on a tensor of `size_bytes` (0 for nothing), read off its measured
    curve as a time: linear in size between samples, the smallest sample's time below it (a collective costs at
    least its latency), the largest sample's rate beyond it.

    Why not `transfer_ns` (rate linear in log size, right for copies): a collective's time is a latency plus
    bytes over a bandwidth, t = L + s / B, which is linear in s, so linear interpolation of time between two
    samples is exact for it, while interpolating the rate underestimates just above a latency-bound sample. With
    L = 2 ms and B = 1.5 GB/s (a 2-rank gloo all-reduce on the 2-core CPU VM), samples at 256 KiB and 4 MiB, a
    512 KiB all-reduce read 1.70 ms off the rate (true 2.35 ms), which made every CPU multi-rank plan's gradient
    reductions 30-40% short of what the runtime measured (docs/BENCHMARKS.md, session 10)."""
    if size_bytes <= 0:
        return 0
    if not curve:
        raise ValueError("collective curve: needs at least one sample")
    sizes = [s.size_bytes for s in curve]
    first, last = curve[0], curve[-1]
    if size_bytes <= sizes[0]:
        return max(1, round(first.size_bytes / first.bytes_per_s * 1e9))
    if size_bytes >= sizes[-1]:
        return max(1, round(size_bytes / last.bytes_per_s * 1e9))
    i = bisect.bisect_right(sizes, size_bytes)
    lo, hi = curve[i - 1], curve[i]
    t_lo, t_hi = lo.size_bytes / lo.bytes_per_s, hi.size_bytes / hi.bytes_per_s
    w = (size_bytes - lo.size_bytes) / (hi.size_bytes - lo.size_bytes)
    return max(1, round((t_lo + w * (t_hi - t_lo)) * 1e9))


class HostStepRate(Protocol):
    """The trace's host optimizer figures (`client.contract.OptimizerMeasurement`)."""

    @property
    def host_bytes_per_s(self) -> float: ...

    @property
    def host_step_overhead_s(self) -> float: ...

    @property
    def host_copy_bytes_per_s(self) -> float: ...


def host_step_ns(optimizer: HostStepRate, stepped_bytes: int) -> int:
    """Integer nanoseconds of one host optimizer step call over `stepped_bytes` (one chunk, or one rank's shard
    of it): the measured per-call overhead plus the bytes over the measured rate; 0 when nothing is stepped
    (a chunk without trained parameters makes no call). A trace without the overhead (0) reads bytes / rate."""
    if stepped_bytes <= 0:
        return 0
    return round((optimizer.host_step_overhead_s + stepped_bytes / optimizer.host_bytes_per_s) * 1e9)


def host_stepped_bytes(elements: int, elt: int, *, separate_master: bool) -> int:
    """Parameter bytes one host step streams for `elements` elements of compute element bytes `elt`: the fp32
    master's (4 per element) when the runtime keeps one (mixed precision), else the compute copy's. The probe's
    rate is fp32 parameter bytes per second, so a bf16 chunk with a master steps twice its compute bytes."""
    return elements * (4 if separate_master else elt)


def host_copy_ns(optimizer: HostStepRate, copied_bytes: int) -> int:
    """Integer nanoseconds of the runtime's host copies around one host step (`copied_bytes` written: the undo
    backup, the exposed `.grad`, a mixed-precision compute copy) at the measured host copy rate; 0 when nothing
    is copied or the trace has no rate (older traces)."""
    if copied_bytes <= 0 or optimizer.host_copy_bytes_per_s <= 0:
        return 0
    return round(copied_bytes / optimizer.host_copy_bytes_per_s * 1e9)


def host_validate_bytes(elements: int, elt: int, *, separate_master: bool) -> int:
    """Copy-equivalent bytes of `optimizer.step()`'s check of one offloaded chunk's exposed `.grad` (`elements`
    of compute element bytes `elt`: a chunk, or a rank's shard of one) against the host gradient its speculative
    step used (`GradientFlow.reconcile`: `torch.equal` reads both, about one copy of `elt` bytes per element),
    plus, where the host gradient has the fp32 master's dtype and the compute dtype is narrower (a separate
    master), its conversion to the compute dtype first (reads 4 bytes, writes `elt`: about (4 + elt) / 2
    copied). Charged at the host copy rate (`host_copy_ns`) on the training thread, after backward."""
    per_element = 2 * elt + ((4 + elt) if separate_master else 0)
    return elements * per_element // 2


def host_step_copy_bytes(
    elements: int,
    stepped: int,
    elt: int,
    undo_backup_bytes_per_param: int,
    *,
    separate_master: bool,
    fill: bool,
) -> int:
    """Bytes the runtime's host copies write around one offloaded chunk's host step (`agent/runtime/host_steps.py`),
    for `elements` elements of which `stepped` are stepped (a chunk, or a rank's shard of one), compute element
    bytes `elt`: the undo backup of the stepped elements (master and optimizer state), the exposed `.grad` of
    every element (`fill`: a replicated chunk's is a copy; a sharded chunk's is an all-gather, charged as a
    collective) and, with a separate fp32 master, the compute copy refreshed from it."""
    return (
        stepped * undo_backup_bytes_per_param
        + (elements * elt if fill else 0)
        + (stepped * elt if separate_master else 0)
    )
