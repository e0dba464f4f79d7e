"""The planner is optimal on tiny hand-made and random cases (checked by exhaustive enumeration),
with every pruning rule on and with each switched off; infeasibility is proven, not guessed."""

from __future__ import annotations

import dataclasses
import random

import pytest

from planner_service.solver.allocation import (
    Buffer,
    SearchRules,
    SearchStatus,
    plan_buffers,
    read_minimalloc_csv,
    search_placement,
    validate_placement,
)
from tests.planner_service.solver.allocation.conftest import minimalloc_file


def brute_force_arena(buffers: list[Buffer]) -> int:
    """Smallest arena over every assignment of integer offsets (depth-first, cut at the best so far)."""
    n = len(buffers)
    clash = [[buffers[i].overlaps_in_time(buffers[j]) for j in range(n)] for i in range(n)]
    best = sum(b.size for b in buffers)
    offs = [0] * n

    def place(i: int, arena: int) -> None:
        nonlocal best
        if i == n:
            best = min(best, arena)
            return
        size = buffers[i].size
        for o in range(0, best - size):
            if all(
                not clash[i][j] or o + size <= offs[j] or offs[j] + buffers[j].size <= o for j in range(i)
            ):
                offs[i] = o
                place(i + 1, max(arena, o + size))

    place(0, 0)
    return best


def random_instance(seed: int, n: int = 5) -> list[Buffer]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        lo = rng.randrange(0, 6)
        out.append(Buffer(f"b{i}", lo, lo + rng.randrange(1, 5), rng.randrange(1, 4)))
    return out


def test_staircase_is_packed_to_its_lower_bound() -> None:
    buffers = [
        Buffer("a", 0, 4, 2),
        Buffer("b", 0, 2, 1),
        Buffer("c", 2, 6, 2),
        Buffer("d", 4, 6, 1),
        Buffer("e", 1, 5, 1),
    ]
    plan = plan_buffers(buffers)
    validate_placement(buffers, plan.offsets)
    assert plan.arena_bytes == plan.lower_bound_bytes == brute_force_arena(buffers) == 5
    assert plan.status.value == "optimal"


def test_minimalloc_example_input_12_fits_capacity_12() -> None:
    buffers = read_minimalloc_csv(minimalloc_file("input.12.csv"))
    plan = plan_buffers(buffers, capacity_bytes=12)
    validate_placement(buffers, plan.offsets, capacity=12)
    assert plan.arena_bytes == 12 and plan.status.value == "optimal"


def test_case_whose_optimum_is_above_the_lower_bound_is_proven() -> None:
    # Live bytes never exceed 3, but a, b, c pairwise overlap in a cycle that forces an arena of 4.
    buffers = [
        Buffer("a", 0, 4, 2),
        Buffer("b", 2, 6, 1),
        Buffer("c", 4, 8, 2),
        Buffer("d", 0, 2, 1),
        Buffer("e", 6, 8, 1),
    ]
    expected = brute_force_arena(buffers)
    plan = plan_buffers(buffers)
    assert plan.arena_bytes == expected
    if expected > plan.lower_bound_bytes:
        assert plan.proven_bound_bytes == expected  # the search proved smaller arenas infeasible


@pytest.mark.parametrize("seed", range(25))
def test_random_tiny_instances_match_exhaustive_optimum(seed: int) -> None:
    buffers = random_instance(seed)
    plan = plan_buffers(buffers, time_limit_s=5.0)
    validate_placement(buffers, plan.offsets)
    assert plan.arena_bytes == brute_force_arena(buffers)
    assert plan.status.value == "optimal"


RULES = [f.name for f in dataclasses.fields(SearchRules) if f.type in ("bool", bool)]


@pytest.mark.parametrize("rule", RULES)
def test_each_rule_switched_off_keeps_search_exact(rule: str) -> None:
    rules = dataclasses.replace(SearchRules(), **{rule: False})
    for seed in range(6):
        buffers = random_instance(100 + seed)
        optimum = brute_force_arena(buffers)
        args = ([b.lower for b in buffers], [b.upper for b in buffers], [b.size for b in buffers])
        found = search_placement(*args, optimum, rules=rules)
        assert found.status == SearchStatus.found and found.offsets is not None
        validate_placement(buffers, found.offsets, capacity=optimum)
        assert search_placement(*args, optimum - 1, rules=rules).status == SearchStatus.infeasible


def test_capacity_below_lower_bound_is_infeasible_at_once() -> None:
    buffers = [Buffer("a", 0, 4, 600), Buffer("b", 2, 6, 600)]
    plan = plan_buffers(buffers, capacity_bytes=1000)
    assert plan.status.value == "infeasible"
    assert plan.lower_bound_bytes == 1200 and plan.offsets == [] and plan.search_nodes == 0


def test_alignment_pads_sizes_and_aligns_offsets() -> None:
    buffers = [Buffer("a", 0, 4, 100), Buffer("b", 1, 5, 700), Buffer("c", 2, 3, 1)]
    plan = plan_buffers(buffers, alignment_bytes=512)
    validate_placement(buffers, plan.offsets, alignment=512)
    assert all(o % 512 == 0 for o in plan.offsets)
    assert plan.arena_bytes <= 3 * 512 + 700  # padded sizes: 512 + 1024 + 512, the last one unpadded


def test_cpsat_baseline_agrees_with_exhaustive_optimum() -> None:
    from planner_service.solver.allocation.cpsat_baseline import cpsat_placement

    for seed in range(5):
        buffers = random_instance(200 + seed)
        optimum = brute_force_arena(buffers)
        args = ([b.lower for b in buffers], [b.upper for b in buffers], [b.size for b in buffers])
        found = cpsat_placement(*args, optimum, time_limit_s=10.0)
        assert found.status == SearchStatus.found and found.offsets is not None
        validate_placement(buffers, found.offsets, capacity=optimum)
        assert cpsat_placement(*args, optimum - 1, time_limit_s=10.0).status == SearchStatus.infeasible


@pytest.mark.slow
def test_deep_search_runs_on_its_own_large_stack() -> None:
    # A staircase of 7,000 short buffers: the search recurses once per placed buffer, 7,000 frames deep,
    # which overflows the main thread's 8 MiB C stack (segfault when run there); search_placement runs it
    # in a thread with a stack sized for it.
    n = 7000
    buffers = [Buffer(f"s{i}", i, i + 3, 1 + i % 3) for i in range(n)]
    args = ([b.lower for b in buffers], [b.upper for b in buffers], [b.size for b in buffers])
    found = search_placement(*args, 9, time_limit_s=120.0)
    assert found.status == SearchStatus.found and found.offsets is not None
    validate_placement(buffers, found.offsets, capacity=9)
