"""Statistics: exact counters and byte totals on a scripted sequence (reserved = arena + plain allocations)."""

from __future__ import annotations

from agent.allocator import PlannedAllocator


def test_statistics_follow_a_scripted_sequence(three_buffers) -> None:
    evs, plan = three_buffers  # arena 4096: a [0,1024) b [1024,2048) c [0,1024)
    with PlannedAllocator(plan, evs, debug=True) as pa:
        assert pa.stats().reserved_bytes == 0  # nothing reserved before the first allocation
        pa.begin_iteration()
        a = pa.malloc(1000)
        s = pa.stats()
        assert (s.arena_bytes, s.reserved_bytes, s.allocated_bytes, s.requested_bytes) == (
            4096,
            4096,
            1024,
            1000,
        )
        x = pa.malloc(5000)  # matches no slot, 5120 B do not fit the free gap: plain allocation
        b = pa.malloc(600)
        s = pa.stats()
        assert (s.reserved_bytes, s.device_bytes, s.allocated_bytes, s.requested_bytes) == (
            9216,
            5120,
            7168,
            6600,
        )
        pa.free(a)
        pa.free(x)
        c = pa.malloc(1024)
        pa.free(b)
        pa.free(c)
        s = pa.stats()
        assert (s.allocs, s.frees, s.live_blocks) == (4, 4, 0)
        assert (s.planned, s.mismatches, s.pool_fallbacks, s.device_fallbacks, s.displaced) == (3, 1, 0, 1, 0)
        assert (s.reserved_bytes, s.allocated_bytes, s.requested_bytes, s.device_bytes) == (4096, 0, 0, 0)
        assert (s.peak_reserved_bytes, s.peak_allocated_bytes, s.peak_requested_bytes) == (9216, 7168, 6600)
        assert s.peak_device_bytes == 5120
        assert s.fallbacks == 1
        assert abs(s.fragmentation_ratio - (1 - 7168 / 9216)) < 1e-12
        pa.reset_peaks()
        s = pa.stats()
        assert (s.peak_reserved_bytes, s.peak_allocated_bytes, s.peak_device_bytes) == (4096, 0, 0)


def test_allocations_before_the_first_iteration_are_counted_apart(three_buffers) -> None:
    evs, plan = three_buffers
    with PlannedAllocator(plan, evs) as pa:
        early = pa.malloc(1000)  # no iteration yet: not replayed, plain allocation
        s = pa.stats()
        assert (s.before_cycle_allocs, s.device_fallbacks, s.mismatches, s.planned) == (1, 0, 0, 0)
        pa.free(early)


def test_an_unfinished_iteration_counts_its_skipped_slots(three_buffers) -> None:
    evs, plan = three_buffers
    with PlannedAllocator(plan, evs) as pa:
        pa.begin_iteration()
        a = pa.malloc(1000)
        pa.free(a)
        pa.begin_iteration()  # b and c never came
        s = pa.stats()
        assert (s.skipped_slots, s.iterations, pa.cursor()) == (2, 1, 0)
