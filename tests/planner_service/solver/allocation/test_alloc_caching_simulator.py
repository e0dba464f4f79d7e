"""The caching-allocator simulator reproduces hand-computed segment counts and peaks on scripted traces.

Every expected figure below is worked out by hand from PyTorch's rules (see caching_allocator.py)."""

from __future__ import annotations

import pytest

from planner_service.solver.allocation import simulate_caching_allocator
from planner_service.solver.allocation.caching_allocator import (
    CachingAllocatorSimulator,
    allocation_size,
    round_size,
)
from tests.planner_service.solver.allocation.conftest import event, trace

MIB = 1 << 20


def test_rounding_and_segment_sizes() -> None:
    assert round_size(1) == 512 and round_size(512) == 512 and round_size(513) == 1024
    assert allocation_size(round_size(100)) == 2 * MIB  # small pool segment
    assert allocation_size(MIB) == 2 * MIB  # exactly 1 MiB is still small
    assert allocation_size(MIB + 512) == 20 * MIB  # large request below 10 MiB
    assert allocation_size(10 * MIB) == 10 * MIB  # >= 10 MiB: rounded to 2 MiB
    assert allocation_size(round_size(11 * MIB + 1)) == 12 * MIB


def test_small_requests_share_one_2mib_segment() -> None:
    sim = CachingAllocatorSimulator()
    for _ in range(3):
        sim.malloc(100)  # 512 B blocks split off one 2 MiB segment
    report = sim.report(iterations=1)
    assert report.segments_allocated == 1 and report.small_segments_allocated == 1
    assert report.peak_reserved_bytes == 2 * MIB and report.peak_allocated_bytes == 1536
    assert report.fragmentation_ratio == pytest.approx(1 - 1536 / (2 * MIB))


def test_large_requests_split_a_20mib_segment_until_it_runs_out() -> None:
    sim = CachingAllocatorSimulator()
    sim.malloc(3 * MIB // 2)  # new 20 MiB segment, 18.5 MiB remainder split off
    sim.malloc(15 * MIB)  # best fit: the 18.5 MiB remainder, split again (3.5 MiB left > 1 MiB)
    assert sim.segments_allocated == 1
    sim.malloc(4 * MIB)  # 3.5 MiB is too small: a second 20 MiB segment
    assert (sim.segments_allocated, sim.large_segments, sim.reserved) == (2, 2, 40 * MIB)


def test_large_block_is_not_split_for_a_remainder_of_1mib_or_less() -> None:
    sim = CachingAllocatorSimulator()
    sim.malloc(19 * MIB + MIB // 2)  # 20 MiB segment, remainder 0.5 MiB: handed out whole
    assert sim.allocated == 20 * MIB
    sim.malloc(MIB + 512)  # so the next large request needs a new segment
    assert sim.segments_allocated == 2


def test_freed_neighbours_coalesce_and_are_reused() -> None:
    sim = CachingAllocatorSimulator()
    a = sim.malloc(600 * 1024)
    b = sim.malloc(600 * 1024)
    sim.free(a)
    sim.free(b)  # a, b and the remainder merge back into one free 2 MiB block
    sim.malloc(MIB)  # fits only because of the merge
    assert sim.segments_allocated == 1 and sim.reserved == 2 * MIB


def test_best_fit_prefers_the_smallest_sufficient_block() -> None:
    sim = CachingAllocatorSimulator()
    small_hole = sim.malloc(1024)
    keep = sim.malloc(512)
    big_hole = sim.malloc(4096)
    sim.malloc(512)
    sim.free(small_hole)
    sim.free(big_hole)
    h = sim.malloc(1000)  # rounds to 1024: the 1 KiB hole, not the 4 KiB one
    assert sim.address(h) == 0
    del keep


def test_miss_at_capacity_frees_cached_segments_and_retries() -> None:
    sim = CachingAllocatorSimulator(capacity_bytes=24 * MIB)
    sim.free(sim.malloc(12 * MIB))  # a cached 12 MiB segment
    sim.malloc(14 * MIB)  # 12 + 14 > 24: release the cached segment, then allocate
    report = sim.report(iterations=1)
    assert (report.segments_allocated, report.segments_released) == (2, 1)
    assert report.peak_reserved_bytes == 14 * MIB


def test_out_of_memory_is_reported() -> None:
    tr = trace(2, event(0, 12 * MIB, 0, 1))
    report = simulate_caching_allocator(tr, capacity_bytes=10 * MIB)
    assert report.out_of_memory and report.segments_allocated == 0


def test_trace_replay_reuses_segments_across_iterations() -> None:
    # Parameters (long-lived, 2 x 3 MiB: one 20 MiB segment, split), activations 600 KiB each (small pool).
    tr = trace(
        6,
        event(0, 3 * MIB, 0, None, "param"),
        event(1, 3 * MIB, 0, None, "param"),
        event(2, 600 * 1024, 1, 5),
        event(3, 600 * 1024, 2, 4),
        event(4, 600 * 1024, 3, 6),
    )
    report = simulate_caching_allocator(tr, iterations=3)
    # 3 x 600 KiB = 1800 KiB fit one 2 MiB small segment; iterations 2 and 3 reuse the cached blocks.
    assert (report.small_segments_allocated, report.large_segments_allocated) == (1, 1)
    assert report.peak_reserved_bytes == 22 * MIB
    assert report.peak_allocated_bytes == 6 * MIB + 3 * 600 * 1024
    assert report.peak_segments == 2
