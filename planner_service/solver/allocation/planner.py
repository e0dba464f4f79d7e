"""Allocation planner: a constructive placement first, then exact search towards the live-bytes lower bound.

Two entry points:

* `plan_buffers(buffers, ...)`: the plain (id, lower, upper, size) problem (MiniMalloc CSV path);
* `plan_allocation(trace, ...)`: an `AllocationTrace` of one steady-state training iteration, returned
  as the contract's `AllocationPlan`; read from the trace's columns (never its 10^5 event objects).

Strategy, within `time_limit_s` in all (the constructive step always completes, so there is always a
placement to return; everything after it stops at the deadline and keeps the best placement so far):

1. lower bound LB = max over time of live bytes (numpy, O(n log n)); a capacity below it is reported
   infeasible at once;
2. best fit in time order, forwards (and backwards when time is left; `sweep_fit.py`, O(n log n): a
   few seconds for 10^6 buffers), the better one: the placement every later step improves;
3. problems of at most `SEARCH_MAX_BUFFERS` buffers ("small"): best fit over four orders
   (`greedy_tree.py`: the placement of `greedy.py`'s quadratic best fit, found through segment trees
   over time, abandoned at the deadline), then the exact search (`search.py`) at the
   capacity when one is given and not met, then at tighter targets (LB first, then bisection): `found`
   improves the arena, `infeasible` raises the proven bound;
4. larger problems: split at the times where nothing is live (`intervals.partitions`); only the
   partition that sets the arena can lower it, so partitions are refined worst first, each small one
   by step 3 with the time left, until the worst one cannot be improved or time runs out. Identical
   partitions (a repeated micro-step, shifted in time) are solved once and the answer reused.
   A partition above `SEARCH_MAX_BUFFERS` (or with more than `SEARCH_MAX_PAIRS` overlapping pairs) gets
   the best fit over orders only, as far as the deadline allows.

Status: optimal when the arena equals the proven bound (LB, or higher when the search proved every
smaller arena infeasible), feasible when a placement fits, infeasible when capacity < LB or the search
proved the capacity too small, unknown when time ran out with no placement under the capacity.

Alignment: sizes are padded to `alignment` and everything runs in alignment units, so every offset is
a multiple of the alignment; "optimal" is then with respect to the padded sizes (the reported lower
bound stays the raw live bytes, so the gap includes the padding).

Periodic steady state: in an `AllocationTrace` a buffer with `free_index=None` lives across iterations
(parameters, gradients, optimizer state). It is live at every time, so it is placed at the bottom,
stacked (moving a buffer live at all times to the bottom, and the buffers below it up by its size,
never breaks a placement, so this loses nothing), and the iteration's other buffers, which all end
by the horizon, are planned above them. Iteration k+1 then finds exactly the addresses iteration k
used, free again: the plan stays valid however many iterations follow (`validate_allocation` checks two
iterations unrolled).

Why one module over 400 lines: the constructive placement, its refinement and the two entry points share one
buffer model and one lower bound; the exact search is `search.py`.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from client.contract import AllocationPlan, AllocationTrace, BufferOffset, SolverStatus
from planner_service.solver.allocation.buffers import (
    AllocationInputError,
    Buffer,
    check_buffers,
)
from planner_service.solver.allocation.greedy import ORDERS
from planner_service.solver.allocation.greedy_tree import TreeBestFit
from planner_service.solver.allocation.intervals import overlap_pairs, partitions, peak_live, trace_arrays
from planner_service.solver.allocation.search import SearchRules, SearchStatus, search_placement
from planner_service.solver.allocation.sweep_fit import sweep_best_fit

SOLVER_NAME = "memplan-alloc (best-fit + MiniMalloc-style search)"
# Above this many buffers a problem is split into partitions (step 4), and a partition gets no search:
# the search's cost per node grows with the partition (ordering and section checks are linear in it).
SEARCH_MAX_BUFFERS = 20_000
# The search's preprocessing enumerates every pair of buffers live together, in Python (about 0.25 us a
# pair): above this many pairs it would eat seconds of the budget before the first node, so it is skipped.
SEARCH_MAX_PAIRS = 4_000_000
# Partitions up to this size still get best fit over the static orders (`greedy_tree.py`, abandoned at
# the deadline), not the search; its node lists take about 200 bytes a buffer.
GREEDY_MAX_BUFFERS = 2_000_000
# Time `plan_allocation` keeps, per event, to turn the placement into the contract's plan after the
# refinement stops (BufferOffset objects and the plan's validation), so the whole call meets its limit.
FINISH_S_PER_EVENT = 5e-6


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


@dataclass(slots=True)
class _Refined:
    """Result of refining one problem in alignment units."""

    offsets: np.ndarray
    arena: int
    proven: int  # proven lower bound on the arena, units
    infeasible: bool  # the search proved the capacity too small
    nodes: int
    method: str


def _sweep(lo: np.ndarray, up: np.ndarray, units: np.ndarray, deadline: float) -> tuple[np.ndarray, str]:
    """Best fit in time order, forwards, and backwards if time is left; the better of the two."""
    fwd = sweep_best_fit(lo, up, units)
    if time.perf_counter() > deadline:
        return fwd, "sweep/forward"
    rev = sweep_best_fit(lo, up, units, reverse=True)
    if int((rev + units).max()) < int((fwd + units).max()):
        return rev, "sweep/backward"
    return fwd, "sweep/forward"


def _refine(
    lo: np.ndarray,
    up: np.ndarray,
    units: np.ndarray,
    start: np.ndarray,
    start_method: str,
    lb_units: int,
    cap_units: int | None,
    deadline: float,
    rules: SearchRules,
    minimize: bool,
    log: list[str],
    a: int,
    search: bool = True,
) -> _Refined:
    """Step 3: best fit over the static orders, then (with `search`) the exact search, until the deadline."""
    best = start
    best_arena = int((start + units).max())
    method = start_method
    trees: TreeBestFit | None = None
    for order in ORDERS:
        if best_arena <= lb_units or time.perf_counter() > deadline:
            break
        trees = trees or TreeBestFit(lo, up, units)
        arr = trees.place(order, deadline=deadline)
        if arr is None:
            log.append(f"best fit ({order}) stopped at the deadline")
            break
        arena = int((arr + units).max())
        if arena < best_arena:
            best, best_arena, method = arr, arena, f"best-fit/{order}"
    log.append(f"best fit: {best_arena * a} bytes ({method})")
    proven = lb_units
    nodes = 0
    lows, ups, sizes = lo.tolist(), up.tolist(), units.tolist()

    def run(target: int, budget: float) -> SearchStatus:
        nonlocal best, best_arena, method, proven, nodes
        res = search_placement(lows, ups, sizes, target, time_limit_s=budget, rules=rules)
        nodes += res.nodes
        log.append(
            f"search at {target * a} bytes: {res.status.value} ({res.nodes} nodes, {res.elapsed_s:.2f} s)"
        )
        if res.status == SearchStatus.found and res.offsets is not None:
            arr = np.asarray(res.offsets, dtype=np.int64)
            arena = int((arr + units).max())
            if arena < best_arena:
                best, best_arena, method = arr, arena, f"search/{res.preorder}"
        elif res.status == SearchStatus.infeasible:
            proven = max(proven, target + 1)
        return res.status

    # Fit under the capacity first.
    infeasible_proven = False
    if search and best_arena > lb_units:
        pairs = overlap_pairs(lo, up)
        if pairs > SEARCH_MAX_PAIRS:
            log.append(f"search skipped: {pairs} overlapping pairs > {SEARCH_MAX_PAIRS}")
            search = False
    if not search:
        return _Refined(best, best_arena, proven, infeasible_proven, nodes, method)
    if cap_units is not None and best_arena > cap_units and deadline - time.perf_counter() > 1e-3:
        st = run(cap_units, deadline - time.perf_counter())
        infeasible_proven = st == SearchStatus.infeasible
    # Tighten towards the proven bound while time is left: the bound itself first, then bisection.
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
    return _Refined(best, best_arena, proven, infeasible_proven, nodes, method)


def _signature(lo: np.ndarray, up: np.ndarray, units: np.ndarray) -> bytes:
    """Identity of a partition up to a shift in time (same buffers in the same order)."""
    t0 = lo.min()
    h = hashlib.blake2b(digest_size=20)
    for arr in (lo - t0, up - t0, units):
        h.update(np.ascontiguousarray(arr, dtype=np.int64).tobytes())
    return h.digest()


def _refine_partitions(
    lo: np.ndarray,
    up: np.ndarray,
    units: np.ndarray,
    offsets: np.ndarray,
    method: str,
    lb_units: int,
    cap_units: int | None,
    deadline: float,
    rules: SearchRules,
    minimize: bool,
    log: list[str],
    a: int,
) -> _Refined:
    """Step 4: refine the partitions that set the arena, worst first, while time is left."""
    parts = partitions(lo, up)
    n_parts = parts.count
    tops = offsets + units
    part_arena = np.zeros(n_parts, dtype=np.int64)
    np.maximum.at(part_arena, parts.of_buffer, tops)
    log.append(f"{n_parts} independent partitions, largest {int(np.diff(parts.starts).max())} buffers")
    done = np.zeros(n_parts, dtype=np.bool_)
    proven = lb_units
    nodes = 0
    infeasible = False
    cache: dict[bytes, np.ndarray | None] = {}
    improved = 0
    while time.perf_counter() < deadline:
        worst = int(part_arena.max())
        at_worst = part_arena == worst
        if (done & at_worst).any():
            break  # a partition that cannot improve sets the arena: refining others changes nothing
        p = int(np.flatnonzero(at_worst)[0])
        done[p] = True
        idx = parts.of(p)
        if idx.shape[0] > GREEDY_MAX_BUFFERS:
            log.append(f"partition {p}: {idx.shape[0]} buffers > {GREEDY_MAX_BUFFERS}: sweep placement kept")
            continue
        plo, pup, pun = lo[idx], up[idx], units[idx]
        sig = _signature(plo, pup, pun)
        if sig in cache:
            rel = cache[sig]
        else:
            p_lb = peak_live(plo, pup, pun)
            sub = _refine(
                plo,
                pup,
                pun,
                offsets[idx],
                method,
                p_lb,
                cap_units,
                deadline,
                rules,
                minimize,
                log,
                a,
                search=idx.shape[0] <= SEARCH_MAX_BUFFERS,
            )
            nodes += sub.nodes
            proven = max(proven, sub.proven)
            if sub.infeasible:
                infeasible = True
                break
            rel = sub.offsets if sub.arena < worst else None
            cache[sig] = rel
        if rel is not None:
            offsets[idx] = rel
            part_arena[p] = int((rel + pun).max())
            improved += 1
    if improved:
        method = f"{method} + refined partitions"
    log.append(f"refined {improved} partitions ({len(cache)} distinct solved)")
    return _Refined(offsets, int(part_arena.max()) if n_parts else 0, proven, infeasible, nodes, method)


def _plan_units(
    lo: np.ndarray,
    up: np.ndarray,
    raw: np.ndarray,
    *,
    capacity_bytes: int | None,
    alignment_bytes: int,
    time_limit_s: float,
    rules: SearchRules | None,
    base_offset_bytes: int,
    minimize: bool,
    t0: float,
) -> tuple[np.ndarray, BufferPlan]:
    """The planner on arrays (checked by the caller). Offsets returned as an int64 array, bytes."""
    lb = peak_live(lo, up, raw)
    log: list[str] = [f"lower bound {lb} bytes"]
    empty = np.zeros(0, dtype=np.int64)
    if capacity_bytes is not None and base_offset_bytes + lb > capacity_bytes:
        log.append(f"capacity {capacity_bytes} < lower bound {base_offset_bytes + lb}: infeasible")
        return empty, BufferPlan(
            [], 0, lb, lb, SolverStatus.infeasible, time.perf_counter() - t0, "bound", log=log
        )
    if raw.shape[0] == 0:
        return empty, BufferPlan(
            [], base_offset_bytes, 0, 0, SolverStatus.optimal, time.perf_counter() - t0, "empty"
        )
    a = alignment_bytes
    units = -(-raw // a)
    lb_units = peak_live(lo, up, units)
    cap_units = None if capacity_bytes is None else (capacity_bytes - base_offset_bytes) // a
    deadline = t0 + time_limit_s
    rules = rules or SearchRules()
    start, start_method = _sweep(lo, up, units, deadline)
    log.append(f"sweep best fit: {int((start + units).max()) * a} bytes ({start_method})")
    if raw.shape[0] <= SEARCH_MAX_BUFFERS:
        res = _refine(
            lo, up, units, start, start_method, lb_units, cap_units, deadline, rules, minimize, log, a
        )
    else:
        res = _refine_partitions(
            lo, up, units, start, start_method, lb_units, cap_units, deadline, rules, minimize, log, a
        )
    solve_s = time.perf_counter() - t0
    proven_bytes = max(lb, res.proven * a - (a - 1)) if res.proven > lb_units else lb
    if res.infeasible:
        return empty, BufferPlan(
            [], 0, lb, proven_bytes, SolverStatus.infeasible, solve_s, "search", res.nodes, log
        )
    offsets = base_offset_bytes + res.offsets * a
    arena = int((offsets + raw).max())
    if cap_units is not None and res.arena > cap_units:
        status = SolverStatus.unknown
    elif res.arena <= res.proven:
        status = SolverStatus.optimal
    else:
        status = SolverStatus.feasible
    return offsets, BufferPlan([], arena, lb, proven_bytes, status, solve_s, res.method, res.nodes, log)


def plan_buffers(
    buffers: Sequence[Buffer],
    *,
    capacity_bytes: int | None = None,
    alignment_bytes: int = 1,
    time_limit_s: float = 10.0,
    rules: SearchRules | None = None,
    base_offset_bytes: int = 0,
    minimize: bool = True,
) -> BufferPlan:
    """Place `buffers` (validated first) minimising the arena, under `capacity_bytes` when given.

    With `minimize=False` and a capacity, stop at the first placement under the capacity (MiniMalloc's
    question); the status is then optimal only if that placement happens to meet the bound.

    `base_offset_bytes` (a multiple of the alignment) shifts every offset; it is used to plan above
    buffers already placed, and counts against the capacity.
    """
    t0 = time.perf_counter()
    _check_options(alignment_bytes, base_offset_bytes, time_limit_s)
    check_buffers(buffers)
    lo = np.fromiter((b.lower for b in buffers), dtype=np.int64, count=len(buffers))
    up = np.fromiter((b.upper for b in buffers), dtype=np.int64, count=len(buffers))
    raw = np.fromiter((b.size for b in buffers), dtype=np.int64, count=len(buffers))
    offsets, plan = _plan_units(
        lo,
        up,
        raw,
        capacity_bytes=capacity_bytes,
        alignment_bytes=alignment_bytes,
        time_limit_s=time_limit_s,
        rules=rules,
        base_offset_bytes=base_offset_bytes,
        minimize=minimize,
        t0=t0,
    )
    plan.offsets = offsets.tolist()
    return plan


def _check_options(alignment_bytes: int, base_offset_bytes: int, time_limit_s: float) -> None:
    if alignment_bytes < 1:
        raise AllocationInputError(f"alignment_bytes: must be at least 1, got {alignment_bytes}")
    if base_offset_bytes % alignment_bytes:
        raise AllocationInputError("base_offset_bytes: must be a multiple of alignment_bytes")
    if time_limit_s <= 0:
        raise AllocationInputError(f"time_limit_s: must be positive, got {time_limit_s}")


def trace_buffers(trace: AllocationTrace) -> tuple[list[Buffer], list[Buffer]]:
    """(long-lived, iteration) buffers of a trace; long-lived ones span the whole horizon."""
    c = trace.columns
    long_lived: list[Buffer] = []
    iteration: list[Buffer] = []
    for eid, size, alloc, free in zip(c.id, c.size_bytes, c.alloc_index, c.free_index, strict=True):
        if free is None:
            long_lived.append(Buffer(str(eid), 0, trace.horizon, size))
        else:
            iteration.append(Buffer(str(eid), alloc, free, size))
    return long_lived, iteration


_OFFSET_FIELDS = set(BufferOffset.model_fields)


def _buffer_offsets(ids: list[int], offsets: list[int]) -> list[BufferOffset]:
    """`BufferOffset`s built without validation, as `model_construct` would, at ~1 us instead of ~20 us each.

    Safe because every value is already valid: ids come from the validated trace, offsets are non-negative
    Python ints. (At 10^6 events `model_construct` alone took 20 s.) The fields-set is shared: both fields
    are set on every instance, so assignments cannot change it.
    """
    new = object.__new__
    setattr_ = object.__setattr__
    out: list[BufferOffset] = []
    append = out.append
    for i, o in zip(ids, offsets, strict=True):
        obj = new(BufferOffset)
        setattr_(obj, "__dict__", {"id": i, "offset_bytes": o})
        setattr_(obj, "__pydantic_fields_set__", _OFFSET_FIELDS)
        setattr_(obj, "__pydantic_extra__", None)
        setattr_(obj, "__pydantic_private__", None)
        append(obj)
    return out


def plan_allocation(
    trace: AllocationTrace,
    *,
    capacity_bytes: int | None = None,
    alignment_bytes: int = 512,
    time_limit_s: float = 10.0,
    seed: int = 0,
) -> AllocationPlan:
    """Offsets for every buffer of a steady-state iteration, valid when iterations repeat.

    `seed` is accepted for interface stability; the planner is deterministic and does not use it.
    """
    del seed  # deterministic: no randomness anywhere in the planner (the treap's priorities use a fixed seed)
    t0 = time.perf_counter()
    a = alignment_bytes
    _check_options(a, 0, time_limit_s)
    arr = trace_arrays(trace)
    ll = arr.long_lived
    n = arr.ids.shape[0]
    offsets = np.zeros(n, dtype=np.int64)
    # Long-lived buffers stacked at the bottom in id order, each padded to the alignment.
    ll_idx = np.flatnonzero(ll)
    ll_idx = ll_idx[np.argsort(arr.ids[ll_idx], kind="stable")]
    padded = -(-arr.sizes[ll_idx] // a) * a
    offsets[ll_idx] = np.concatenate(([0], np.cumsum(padded)[:-1])) if ll_idx.size else padded
    base = int(padded.sum())
    long_raw = int(arr.sizes[ll_idx].sum())
    it_idx = np.flatnonzero(~ll)
    # Keep time to build the plan's offsets after the refinement stops.
    reserve = min(FINISH_S_PER_EVENT * n, time_limit_s / 4)
    sub_offsets, sub = _plan_units(
        arr.alloc[it_idx],
        arr.free[it_idx],
        arr.sizes[it_idx],
        capacity_bytes=capacity_bytes,
        alignment_bytes=a,
        time_limit_s=time_limit_s - reserve - (time.perf_counter() - t0),
        rules=None,
        base_offset_bytes=base,
        minimize=True,
        t0=time.perf_counter(),
    )
    lower_bound = long_raw + sub.lower_bound_bytes
    if sub.status == SolverStatus.infeasible:
        return AllocationPlan(
            arena_bytes=0,
            lower_bound_bytes=lower_bound,
            alignment_bytes=a,
            offsets=[],
            status=SolverStatus.infeasible,
            solve_s=time.perf_counter() - t0,
            solver=SOLVER_NAME,
        )
    offsets[it_idx] = sub_offsets
    arena = int((offsets + arr.sizes).max()) if n else 0
    status = sub.status
    if capacity_bytes is not None and arena > capacity_bytes:
        status = SolverStatus.unknown
    placed = _buffer_offsets(arr.ids.tolist(), offsets.tolist())
    return AllocationPlan(
        arena_bytes=arena,
        lower_bound_bytes=lower_bound,
        alignment_bytes=a,
        offsets=placed,
        status=status,
        solve_s=time.perf_counter() - t0,
        solver=SOLVER_NAME,
    )
