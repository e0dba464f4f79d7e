"""A collective's time off its measured curve (`bandwidth.collective_ns`, session 10).

A collective takes a latency plus bytes over a bandwidth, t = L + s / B: linear in the size, so reading its time
linearly between two measured sizes is exact, where reading the rate linearly in log size (right for copies,
`transfer_ns`) underestimated a chunk just above a latency-bound sample by ~28% (the 2-rank CPU plans' gradient
reductions measured 30-40% over their prediction: docs/BENCHMARKS.md, session 10).
"""

from __future__ import annotations

import pytest

from client.contract import CollectiveSample
from planner_service.solver.bandwidth import collective_ns, transfer_ns

KiB, MiB = 2**10, 2**20
L, B = 2e-3, 1.5e9  # seconds, bytes/s: a 2-rank gloo all-reduce on the 2-core VM, about


def _t(size: int) -> float:
    return L + size / B


def _curve(*sizes: int) -> list[CollectiveSample]:
    return [CollectiveSample(size_bytes=s, bytes_per_s=s / _t(s)) for s in sizes]


@pytest.mark.parametrize("size", [300 * KiB, 512 * KiB, MiB, 3 * MiB])
def test_between_samples_the_latency_plus_bandwidth_time_is_read_exactly(size: int) -> None:
    curve = _curve(256 * KiB, 4 * MiB)
    assert collective_ns(curve, size) == pytest.approx(_t(size) * 1e9, abs=2)
    # the rate read linearly in log size reads less, most just above the latency-bound sample
    assert transfer_ns(curve, size) < collective_ns(curve, size)


def test_512_kib_reads_2_35_ms_where_the_log_rate_read_1_70() -> None:
    curve = _curve(256 * KiB, 4 * MiB)
    assert collective_ns(curve, 512 * KiB) / 1e6 == pytest.approx(2.35, abs=0.01)
    assert transfer_ns(curve, 512 * KiB) / 1e6 == pytest.approx(1.70, abs=0.01)


def test_below_the_smallest_sample_a_collective_costs_its_latency_and_beyond_the_largest_its_rate() -> None:
    curve = _curve(256 * KiB, 4 * MiB)
    t0 = round(_t(256 * KiB) * 1e9)
    assert collective_ns(curve, 4 * KiB) == collective_ns(curve, 256 * KiB) == t0
    assert collective_ns(curve, 8 * MiB) == round(8 * MiB / curve[-1].bytes_per_s * 1e9)
    assert collective_ns(curve, 0) == 0
    with pytest.raises(ValueError, match="at least one sample"):
        collective_ns([], 1)


def test_a_one_sample_curve_at_or_above_it_is_the_flat_rate() -> None:
    # the hand-computed planner tests' flat curves: unchanged figures at and above their one sample
    flat = [CollectiveSample(size_bytes=MiB, bytes_per_s=50e9)]
    for size in (MiB, 100 * 10**6):
        assert collective_ns(flat, size) == transfer_ns(flat, size)
