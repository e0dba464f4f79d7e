"""Plain CP-SAT placement model (NoOverlap2D over time x address): the baseline the search is measured against.

Not used by the planner: on MiniMalloc's challenging instances this model is far slower than the
structured search in `search.py` (see docs/BENCHMARKS.md, "Allocation planner"). Kept so the comparison
can be re-run.

Model (units: the caller's, bytes or alignment units; times are event indices):
* one integer offset x_i in [0, capacity - size_i] per buffer;
* a fixed-size address interval [x_i, x_i + size_i) and a fixed time interval [lower_i, upper_i);
* NoOverlap2D over the (time, address) rectangles;
* symmetry breaking: buffers with identical lifetime and size are interchangeable, so their offsets are
  ordered (x_i < x_j for i < j in input order);
* with `minimize`, an arena variable >= every x_i + size_i is minimised; otherwise any fit is accepted.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Sequence

from ortools.sat.python import cp_model

from planner_service.solver.allocation.search import SearchResult, SearchStatus


def cpsat_placement(
    lowers: Sequence[int],
    uppers: Sequence[int],
    sizes: Sequence[int],
    capacity: int,
    *,
    time_limit_s: float = 30.0,
    workers: int = 2,
    symmetry_breaking: bool = True,
    minimize: bool = False,
    seed: int = 0,
) -> SearchResult:

    t0 = time.perf_counter()
    model = cp_model.CpModel()
    n = len(sizes)
    xs = []
    time_intervals = []
    addr_intervals = []
    for i in range(n):
        if sizes[i] > capacity:
            return SearchResult(
                SearchStatus.infeasible, None, 0, 0, time.perf_counter() - t0, preorder="cpsat"
            )
        x = model.new_int_var(0, capacity - sizes[i], f"x{i}")
        xs.append(x)
        addr_intervals.append(model.new_fixed_size_interval_var(x, sizes[i], f"addr{i}"))
        time_intervals.append(model.new_fixed_size_interval_var(lowers[i], uppers[i] - lowers[i], f"time{i}"))
    model.add_no_overlap_2d(time_intervals, addr_intervals)
    if symmetry_breaking:
        groups: dict[tuple[int, int, int], list[int]] = defaultdict(list)
        for i in range(n):
            groups[(lowers[i], uppers[i], sizes[i])].append(i)
        for members in groups.values():
            for a, b in zip(members, members[1:], strict=False):
                model.add(xs[a] + sizes[a] <= xs[b])
    if minimize:
        arena = model.new_int_var(0, capacity, "arena")
        for i in range(n):
            model.add(arena >= xs[i] + sizes[i])
        model.minimize(arena)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = time_limit_s
    solver.parameters.num_workers = workers
    solver.parameters.random_seed = seed
    status = solver.solve(model)
    elapsed = time.perf_counter() - t0
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return SearchResult(
            SearchStatus.found, [int(solver.value(x)) for x in xs], 0, 0, elapsed, preorder="cpsat"
        )
    if status == cp_model.INFEASIBLE:
        return SearchResult(SearchStatus.infeasible, None, 0, 0, elapsed, preorder="cpsat")
    return SearchResult(SearchStatus.timeout, None, 0, 0, elapsed, preorder="cpsat")
