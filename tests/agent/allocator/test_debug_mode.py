"""Debug mode: no two live buffers ever share a byte, proven on the data and by the core's own check."""

from __future__ import annotations

import random

import pytest

from agent.allocator import AllocatorInvariantError, PlannedAllocator, iteration_ops
from tests.agent.allocator.conftest import event, plan_for


def _layered_trace(n_layers: int = 6) -> tuple[list, object]:
    """Forward keeps one activation per layer, each layer makes a temp; backward frees in reverse."""
    evs = [event(0, 3000, 0, None, "param")]
    t, acts, next_id = 1, [], 1
    for k in range(n_layers):
        acts.append((next_id, 1024 * (1 + k % 3), t))
        evs.append(event(next_id + 1, 700 + 300 * k, t + 1, t + 2))
        next_id += 2
        t += 3
    for j, (aid, size, at) in enumerate(reversed(acts)):
        evs.append(event(aid, size, at, t + j, "activation"))
    offsets, top = {0: 0}, 3072
    for aid, size, _ in acts:  # activations stacked, temps in one shared region above them
        offsets[aid] = top
        top += -(-size // 512) * 512
    for e in evs:
        offsets.setdefault(e.id, top)
    return evs, plan_for(evs, offsets)


def test_no_two_live_buffers_share_bytes_under_mismatched_traffic() -> None:
    evs, plan = _layered_trace()
    rng = random.Random(7)
    ops = iteration_ops(evs)
    with PlannedAllocator(plan, evs, debug=True) as pa:
        live: dict[int, tuple[int, int, int]] = {}  # buffer -> (address, size, fill byte)

        def verify() -> None:
            for addr, size, fill in live.values():
                view = pa.tensor(addr, size)
                assert bool((view == fill).all()), "a live buffer's bytes were overwritten"

        for it in range(12):
            pa.begin_iteration()
            scale = 1.0 if it % 3 == 0 else rng.choice([0.5, 0.8, 1.3, 2.0])
            for op in ops.ops:
                k = op if op >= 0 else -op - 1
                if op >= 0:
                    if k in live:  # long-lived, still held
                        continue
                    size = ops.sizes[k] if k == 0 else max(1, int(ops.sizes[k] * scale))
                    addr = pa.malloc(size)
                    fill = 1 + (it * 31 + k) % 250
                    pa.tensor(addr, size).fill_(fill)
                    live[k] = (addr, size, fill)
                    if rng.random() < 0.2:  # an unplanned allocation that lives a while
                        extra = pa.malloc(rng.randint(1, 6000))
                        live[1000 + len(live)] = (extra, 1, 0)
                        pa.tensor(extra, 1).fill_(0)
                else:
                    pa.free(live.pop(k)[0])
                verify()
            for key in [k for k in live if k >= 1000]:
                pa.free(live.pop(key)[0])
            pa.check()
        s = pa.stats()
        assert s.debug_violations == 0
        assert s.mismatches > 0 and s.fallbacks > 0 and s.planned > 0 and s.shrunk > 0


def test_debug_mode_reports_a_free_of_a_pointer_it_never_handed_out(three_buffers) -> None:
    evs, plan = three_buffers
    with PlannedAllocator(plan, evs, debug=True) as pa:
        pa.begin_iteration()
        a = pa.malloc(1000)
        with pytest.raises(ValueError, match="not a live block"):
            pa.free(a + 8)
        assert pa.stats().unknown_frees == 1
        with pytest.raises(AllocatorInvariantError, match="debug mode recorded violations"):
            pa.check()
        pa.free(a)


def test_the_check_passes_on_a_consistent_allocator_with_blocks_live(three_buffers) -> None:
    evs, plan = three_buffers
    with PlannedAllocator(plan, evs) as pa:
        pa.begin_iteration()
        blocks = [pa.malloc(n) for n in (1000, 600, 3000, 70_000)]
        pa.check()
        for b in blocks:
            pa.free(b)
        pa.check()
