"""Allocation planner: best-fit upper bound, then exact search towards the live-bytes lower bound.

Two entry points:

* `plan_buffers(buffers, ...)`: the plain (id, lower, upper, size) problem (MiniMalloc CSV path);
* `plan_allocation(trace, ...)`: an `AllocationTrace` of one steady-state training iteration, returned
  as the contract's `AllocationPlan`.

Strategy, within `time_limit_s` in all:

1. lower bound LB = max over time of live bytes; a capacity below it is reported infeasible at once;
2. best-fit over several orders (`greedy.py`) gives a placement and an upper bound UB in milliseconds;
3. when a capacity is given and UB exceeds it, the exact search (`search.py`) is run at the capacity;
4. while the best arena is above the proven bound and time is left, the search is run at tighter
   targets (LB first, then bisection): `found` improves the arena, `infeasible` raises the proven bound.

Status: optimal when the arena equals the proven bound (LB, or higher when the search proved every
smaller arena infeasible), feasible when a placement fits, infeasible when capacity < LB or the search
proved the capacity too small, unknown when time ran out with no placement under the capacity.

Alignment: sizes are padded to `alignment` and the search runs in alignment units, so every offset is
a multiple of the alignment; "optimal" is then with respect to the padded sizes (the reported lower
bound stays the raw live bytes, so the gap includes the padding).

Periodic steady state: in an `AllocationTrace` a buffer with `free_index=None` lives across iterations
(parameters, gradients, optimizer state). It is live at every time, so it is placed at the bottom,
stacked (moving a buffer live at all times to the bottom, and the buffers below it up by its size,
never breaks a placement, so this loses nothing), and the iteration's other buffers, which all end
by the horizon, are planned above them. Iteration k+1 then finds exactly the addresses iteration k
used, free again: the plan stays valid however many iterations follow (`validate_allocation` checks two
iterations unrolled).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from client.contract import AllocationPlan, AllocationTrace, BufferOffset, SolverStatus
from planner_service.solver.allocation.buffers import (
    AllocationInputError,
    Buffer,
    check_buffers,
    peak_live_bytes,
)
from planner_service.solver.allocation.greedy import ORDERS, best_fit
from planner_service.solver.allocation.search import SearchRules, SearchStatus, search_placement

SOLVER_NAME = "memplan-alloc (best-fit + MiniMalloc-style search)"
# Above this many buffers the search is skipped: its cost per node grows with the partition (ordering
# and section checks are linear in it), so on such problems it would rarely improve on best fit in time.
SEARCH_MAX_BUFFERS = 20_000


@dataclass(slots=True)
class BufferPlan:
    """A placement of plain buffers and the evidence of how good it is."""

    offsets: list[int]  # bytes, one per buffer in input order; empty when infeasible
    arena_bytes: int  # max(offset + size); 0 when infeasible
    lower_bound_bytes: int  # max over time of live bytes
    proven_bound_bytes: int  # lower bound proven by search (>= lower_bound_bytes)
    status: SolverStatus
    solve_s: float
    method: str  # which step produced the placement
    search_nodes: int = 0
    log: list[str] = field(default_factory=list)

    @property
    def gap(self) -> float:
        return 0.0 if self.lower_bound_bytes == 0 else self.arena_bytes / self.lower_bound_bytes - 1.0


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def plan_buffers(
    buffers: Sequence[Buffer], *, capacity_bytes: int | None = None, alignment_bytes: int = 1,
    time_limit_s: float = 10.0, rules: SearchRules | None = None, base_offset_bytes: int = 0,
    minimize: bool = True,
) -> BufferPlan:
    """Place `buffers` (validated first) minimising the arena, under `capacity_bytes` when given.

    With `minimize=False` and a capacity, stop at the first placement under the capacity (MiniMalloc's
    question); the status is then optimal only if that placement happens to meet the bound.

    `base_offset_bytes` (a multiple of the alignment) shifts every offset; it is used to plan above
    buffers already placed, and counts against the capacity.
    """
    t0 = time.perf_counter()
    if alignment_bytes < 1:
        raise AllocationInputError(f"alignment_bytes: must be at least 1, got {alignment_bytes}")
    if base_offset_bytes % alignment_bytes:
        raise AllocationInputError("base_offset_bytes: must be a multiple of alignment_bytes")
    if time_limit_s <= 0:
        raise AllocationInputError(f"time_limit_s: must be positive, got {time_limit_s}")
    check_buffers(buffers)
    lowers = [b.lower for b in buffers]
    uppers = [b.upper for b in buffers]
    raw = [b.size for b in buffers]
    lb = peak_live_bytes(lowers, uppers, raw)
    log: list[str] = [f"lower bound {lb} bytes"]
    if capacity_bytes is not None and base_offset_bytes + lb > capacity_bytes:
        log.append(f"capacity {capacity_bytes} < lower bound {base_offset_bytes + lb}: infeasible")
        return BufferPlan([], 0, lb, lb, SolverStatus.infeasible, time.perf_counter() - t0, "bound", log=log)
    if not buffers:
        return BufferPlan([], base_offset_bytes, 0, 0, SolverStatus.optimal, time.perf_counter() - t0, "empty")
    a = alignment_bytes
    units = [_ceil_div(s, a) for s in raw]
    lb_units = peak_live_bytes(lowers, uppers, units)
    cap_units = None if capacity_bytes is None else (capacity_bytes - base_offset_bytes) // a
    deadline = t0 + time_limit_s

    def arena_units(offs: Sequence[int]) -> int:
        return max(o + u for o, u in zip(offs, units, strict=True))

    # 2. Best fit over every order.
    best: list[int] | None = None
    best_arena = 0
    method = ""
    for order in ORDERS:
        offs = best_fit(lowers, uppers, units, order)
        arena = arena_units(offs)
        if best is None or arena < best_arena:
            best, best_arena, method = offs, arena, f"best-fit/{order}"
    assert best is not None
    log.append(f"best fit: {best_arena * a} bytes ({method})")
    proven = lb_units
    nodes = 0
    rules = rules or SearchRules()

    def run(target: int, budget: float) -> SearchStatus:
        nonlocal best, best_arena, method, proven, nodes
        res = search_placement(lowers, uppers, units, target, time_limit_s=budget, rules=rules)
        nodes += res.nodes
        log.append(f"search at {target * a} bytes: {res.status.value} ({res.nodes} nodes, {res.elapsed_s:.2f} s)")
        if res.status == SearchStatus.found and res.offsets is not None:
            arena = arena_units(res.offsets)
            if arena < best_arena:
                best, best_arena, method = res.offsets, arena, f"search/{res.preorder}"
        elif res.status == SearchStatus.infeasible:
            proven = max(proven, target + 1)
        return res.status

    # 3. Fit under the capacity first.
    infeasible_proven = False
    if len(buffers) > SEARCH_MAX_BUFFERS:
        minimize = False
        log.append(f"search skipped: {len(buffers)} buffers > {SEARCH_MAX_BUFFERS}")
    if cap_units is not None and best_arena > cap_units and len(buffers) <= SEARCH_MAX_BUFFERS:
        st = run(cap_units, max(deadline - time.perf_counter(), 1e-3))
        infeasible_proven = st == SearchStatus.infeasible
    # 4. Tighten towards the proven bound while time is left: the bound itself first, then bisection.
    lo_try = proven  # no target below this is worth trying (proven infeasible, or timed out)
    first = True
    while minimize and not infeasible_proven and lo_try < best_arena:
        left = deadline - time.perf_counter()
        if left <= 0.05:
            break
        target = lo_try if first else (lo_try + best_arena - 1) // 2
        first = False
        st = run(target, left if target == best_arena - 1 else left / 2)
        if st == SearchStatus.timeout:
            lo_try = target + 1
        lo_try = max(lo_try, proven)
    solve_s = time.perf_counter() - t0
    proven_bytes = max(lb, proven * a - (a - 1)) if proven > lb_units else lb
    if infeasible_proven:
        return BufferPlan([], 0, lb, proven_bytes, SolverStatus.infeasible, solve_s, "search", nodes, log)
    offsets = [base_offset_bytes + o * a for o in best]
    arena = max(o + s for o, s in zip(offsets, raw, strict=True))
    if cap_units is not None and best_arena > cap_units:
        status = SolverStatus.unknown
    elif best_arena <= proven:
        status = SolverStatus.optimal
    else:
        status = SolverStatus.feasible
    return BufferPlan(offsets, arena, lb, proven_bytes, status, solve_s, method, nodes, log)


def trace_buffers(trace: AllocationTrace) -> tuple[list[Buffer], list[Buffer]]:
    """(long-lived, iteration) buffers of a trace; long-lived ones span the whole horizon."""
    long_lived: list[Buffer] = []
    iteration: list[Buffer] = []
    for e in trace.events:
        if e.free_index is None:
            long_lived.append(Buffer(str(e.id), 0, trace.horizon, e.size_bytes))
        else:
            iteration.append(Buffer(str(e.id), e.alloc_index, e.free_index, e.size_bytes))
    return long_lived, iteration


def plan_allocation(
    trace: AllocationTrace, *, capacity_bytes: int | None = None, alignment_bytes: int = 512,
    time_limit_s: float = 10.0, seed: int = 0,
) -> AllocationPlan:
    """Offsets for every buffer of a steady-state iteration, valid when iterations repeat.

    `seed` is accepted for interface stability; the planner is deterministic and does not use it.
    """
    del seed  # deterministic: no randomness anywhere in the planner
    t0 = time.perf_counter()
    a = alignment_bytes
    long_lived, iteration = trace_buffers(trace)
    offsets: dict[str, int] = {}
    base = 0
    for b in sorted(long_lived, key=lambda b: int(b.id)):
        offsets[b.id] = base
        base += _ceil_div(b.size, a) * a
    long_raw = sum(b.size for b in long_lived)
    sub = plan_buffers(iteration, capacity_bytes=capacity_bytes, alignment_bytes=a, time_limit_s=time_limit_s,
                       base_offset_bytes=base)
    lower_bound = long_raw + sub.lower_bound_bytes
    solve_s = time.perf_counter() - t0
    if sub.status == SolverStatus.infeasible:
        return AllocationPlan(arena_bytes=0, lower_bound_bytes=lower_bound, alignment_bytes=a, offsets=[],
                              status=SolverStatus.infeasible, solve_s=solve_s, solver=SOLVER_NAME)
    for b, off in zip(iteration, sub.offsets, strict=True):
        offsets[b.id] = off
    arena = max([off + b.size for b, off in zip(iteration, sub.offsets, strict=True)]
                + [offsets[b.id] + b.size for b in long_lived] + [0])
    status = sub.status
    if capacity_bytes is not None and arena > capacity_bytes:
        status = SolverStatus.unknown
    return AllocationPlan(
        arena_bytes=arena,
        lower_bound_bytes=lower_bound,
        alignment_bytes=a,
        offsets=[BufferOffset(id=e.id, offset_bytes=offsets[str(e.id)]) for e in trace.events],
        status=status,
        solve_s=solve_s,
        solver=SOLVER_NAME,
    )
