"""Plan replay: the k-th allocation of the iteration is served at its planned offset when order and size match."""

from __future__ import annotations

import pytest

from agent.allocator import PlannedAllocator, ServedFrom
from tests.agent.allocator.conftest import event, plan_for


def test_each_allocation_is_served_at_its_planned_offset(three_buffers) -> None:
    evs, plan = three_buffers
    with PlannedAllocator(plan, evs, debug=True) as pa:
        for _ in range(3):
            pa.begin_iteration()
            a = pa.malloc(1000)
            b = pa.malloc(600)
            pa.free(a)
            c = pa.malloc(1024)
            assert (pa.offset_of(a), pa.offset_of(b), pa.offset_of(c)) == (0, 1024, 0)
            assert pa.served_from(c) == ServedFrom.planned
            pa.free(b)
            pa.free(c)
        pa.check()
        s = pa.stats()
        assert (s.planned, s.fallbacks, s.mismatches, s.displaced) == (9, 0, 0, 0)


def test_sizes_match_after_rounding_to_the_plan_alignment(three_buffers) -> None:
    evs, plan = three_buffers
    with PlannedAllocator(plan, evs) as pa:
        pa.begin_iteration()
        a = pa.malloc(1001)  # planned 1000: same 1024-byte extent at 512-byte alignment
        assert pa.offset_of(a) == 0 and pa.served_from(a) == ServedFrom.planned
        pa.free(a)


def test_long_lived_buffers_made_before_the_first_iteration_take_their_slots_by_size() -> None:
    # two parameters (long-lived, made before the iteration, in reverse order) and one temporary
    evs = [event(0, 4096, 0, None, "param"), event(1, 2048, 1, None, "param"), event(2, 512, 2, 3)]
    plan = plan_for(evs, {0: 0, 1: 4096, 2: 6144})
    with PlannedAllocator(plan, evs, debug=True) as pa:
        p1 = pa.malloc(2048)
        p0 = pa.malloc(4096)
        assert (pa.offset_of(p0), pa.offset_of(p1)) == (0, 4096)
        assert pa.served_from(p0) == ServedFrom.persistent
        for _ in range(3):  # the cursor passes over the held parameters each iteration
            pa.begin_iteration()
            t = pa.malloc(512)
            assert pa.offset_of(t) == 6144 and pa.served_from(t) == ServedFrom.planned
            pa.free(t)
        s = pa.stats()
        assert (s.persistent, s.planned, s.fallbacks, s.skipped_slots, s.iterations) == (2, 3, 0, 0, 2)
        pa.check()


def test_gradients_freed_and_remade_each_iteration_return_to_their_slots() -> None:
    evs = [event(0, 1024, 0, None, "param"), event(1, 512, 1, 3), event(2, 1024, 2, None, "grad", "backward")]
    plan = plan_for(evs, {0: 0, 1: 1024, 2: 1536})
    with PlannedAllocator(plan, evs, debug=True) as pa:
        p = pa.malloc(1024)
        grad = None
        for _ in range(4):
            pa.begin_iteration()
            if grad is not None:
                pa.free(grad)  # zero_grad(set_to_none=True)
            t = pa.malloc(512)
            grad = pa.malloc(1024)
            pa.free(t)
            assert pa.offset_of(grad) == 1536 and pa.offset_of(p) == 0
        s = pa.stats()
        assert s.fallbacks == 0 and s.mismatches == 0
        pa.check()


def test_the_replay_wraps_around_without_begin_iteration(three_buffers) -> None:
    evs, plan = three_buffers
    with PlannedAllocator(plan, evs) as pa:
        pa.begin_iteration()
        for _ in range(4):
            a = pa.malloc(1000)
            b = pa.malloc(600)
            pa.free(a)
            c = pa.malloc(1024)
            pa.free(b)
            pa.free(c)
        s = pa.stats()
        assert (s.planned, s.iterations, s.fallbacks) == (12, 3, 0)


@pytest.mark.slow
def test_a_profiled_gpt2_iteration_replays_at_planned_offsets_with_no_fragmentation() -> None:
    import torch
    import transformers

    import agent
    from planner_service.solver.allocation import plan_allocation, simulate_caching_allocator

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=512, n_positions=64)
    model = transformers.GPT2LMHeadModel(cfg)
    batch = {"input_ids": torch.randint(0, 512, (2, 32)), "labels": torch.randint(0, 512, (2, 32))}
    trace = agent.profile(model, batch, repeats=1).allocation_trace
    assert trace is not None
    plan = plan_allocation(trace, time_limit_s=5.0)
    with PlannedAllocator(plan, trace.events, debug=True) as pa:
        pa.replay(3, free_at_end=False)
        pa.check()
        s = pa.stats()
        assert s.planned + s.persistent == s.allocs
        assert (s.fallbacks, s.mismatches, s.displaced) == (0, 0, 0)
        assert s.peak_reserved_bytes == s.arena_bytes == -(-plan.arena_bytes // 512) * 512
    caching = simulate_caching_allocator(trace, iterations=3)
    assert s.fragmentation_ratio <= caching.fragmentation_ratio
