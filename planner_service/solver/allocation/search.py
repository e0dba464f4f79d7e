"""Exact placement search in the style of MiniMalloc: canonical solutions with named pruning rules.

A rewrite (numba-compiled Python) of the search in google/minimalloc `src/solver.cc` (Moffitt, ASPLOS
2023; Apache-2.0). The question it answers: can every buffer be placed below `capacity`? Depth-first:

* the state is, per unplaced buffer, its *minimum offset* (the top of the highest placed buffer that it
  overlaps in time) and, per section (see `sweep.py`), a *floor* and the *total* size still unplaced;
* each node places one buffer at its minimum offset (only such "gravity" placements are needed: any
  solution can be pushed down into one), trying unplaced buffers in order of minimum offset, then
  static preorder (*dynamic ordering*).

Pruning rules, each switchable in `SearchRules` for ablation:

* ``canonical_only``: buffers are placed in non-decreasing offset order, ties in preorder, so each
  placement is reached once, not once per permutation;
* ``check_dominance``: never place a buffer at or above the lowest top any unplaced buffer could reach
  (that buffer would fit underneath; a solution that puts it there dominates);
* ``section_inference``: a section's floor plus the sizes still to place in it must fit the capacity;
* ``monotonic_floor``: in canonical order nothing later goes below the current offset, so it is a floor
  for every section;
* ``unallocated_floor``: a section's floor is at least the smallest minimum offset of its unplaced buffers;
* ``hatless_pruning``: when the placed buffer overlaps no unplaced buffer, the alternatives at this node
  cannot do better, so they are skipped;
* ``dynamic_decomposition``: when placed buffers leave no unplaced buffer crossing a section boundary,
  both sides are solved independently (their failures do not multiply).

Static preorders (MiniMalloc's "WAT", "TAW", "TWA": W lifetime width, A area = width*size, T the largest
section total the buffer is in; larger first) are tried round-robin with a doubling node budget, so one
bad preorder cannot stall the search.

Why numba: the same search in plain Python ran at ~1,400 nodes/s on these instances and placed none of
the A-F challenging instances in 60 s; compiled it runs the same rules orders of magnitude faster.
The compiled functions are cached on disk (`cache=True`), so only the first run on a machine compiles.

All integers are in the caller's units (bytes, or alignment units; see `planner.py`).

Why one module over 400 lines: the search is one numba-compiled recursion (`_dfs`) with its pruning rules and
their helpers, compiled together.
"""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

import numba
import numpy as np
from numba import njit

from planner_service.solver.allocation.numba_clock import now
from planner_service.solver.allocation.sweep import sweep

_NONE = -1
_FOUND = 1
_NOT_FOUND = 0
_ABORTED = -1  # node budget of the round spent, or the deadline passed (ctr[_C_DEADLINE] set)

# Indices into the `ctr` counter array shared by the compiled functions.
_C_NODES_LEFT, _C_NODES, _C_BACKTRACKS, _C_DEADLINE = 0, 1, 2, 3
# Indices into the `params` array.
(
    _P_CAPACITY,
    _P_CANONICAL,
    _P_DOMINANCE,
    _P_INFERENCE,
    _P_MONOTONIC,
    _P_UNALLOC,
    _P_HATLESS,
    _P_DECOMP,
    _P_CHECK_MASK,
) = range(9)
# The deadline is checked every 256 nodes on small problems (a node costs microseconds there) and at
# every node above this many buffers, where one node costs up to milliseconds (linear in the partition).
_CHECK_EVERY_NODE_ABOVE = 2000

# The deadline check (`numba_clock.now`, every 256 nodes, or every node on large problems) briefly takes the GIL back through numba's object mode;
# everything else runs without it (nogil=True), so solves in several threads proceed in parallel.
warnings.filterwarnings(
    "ignore",
    message="Code running in object mode won't allow parallel execution",
    category=numba.NumbaWarning,
)

_HEURISTIC_CODES = {"W": 0, "A": 1, "T": 2, "Z": 3, "S": 4, "E": 5}


class SearchStatus(StrEnum):
    found = "found"  # every buffer placed within capacity
    infeasible = "infeasible"  # the search proved that no placement fits
    timeout = "timeout"  # the deadline came first


@dataclass(frozen=True, slots=True)
class SearchRules:
    """Switches for the pruning rules (all on by default, as in MiniMalloc) and the preorders to try."""

    canonical_only: bool = True
    check_dominance: bool = True
    section_inference: bool = True
    monotonic_floor: bool = True
    unallocated_floor: bool = True
    hatless_pruning: bool = True
    dynamic_decomposition: bool = True
    preorders: tuple[str, ...] = ("WAT", "TAW", "TWA")

    def __post_init__(self) -> None:
        for h in self.preorders:
            bad = [c for c in h if c not in _HEURISTIC_CODES]
            if not h or bad:
                raise ValueError(f"preorders: {h!r} must use letters from {''.join(_HEURISTIC_CODES)}")


@dataclass(slots=True)
class SearchResult:
    status: SearchStatus
    offsets: list[int] | None
    nodes: int
    backtracks: int
    elapsed_s: float
    preorder: str | None = None


@njit(cache=True, nogil=True)
def _preorder(members, heuristic, lowers, uppers, sizes, blo, bhi, total):  # type: ignore[no-untyped-def]
    """Members sorted by the heuristic's keys (each descending), ties by buffer index."""
    m = members.shape[0]
    order = np.argsort(members, kind="mergesort")
    keys = np.empty((6, m), dtype=np.int64)
    for k in range(m):
        b = members[k]
        width = uppers[b] - lowers[b]
        t = 0
        for s in range(blo[b], bhi[b]):
            if total[s] > t:
                t = total[s]
        keys[0, k] = width
        keys[1, k] = width * sizes[b]
        keys[2, k] = t
        keys[3, k] = sizes[b]
        keys[4, k] = lowers[b]
        keys[5, k] = uppers[b]
    for j in range(heuristic.shape[0] - 1, -1, -1):  # least significant key first, stable sorts
        key = -keys[heuristic[j]][order]
        order = order[np.argsort(key, kind="mergesort")]
    return members[order]


@njit(cache=True, nogil=True)
def _check(sec_a, sec_b, offset, floor, total, params):  # type: ignore[no-untyped-def]
    cap = params[_P_CAPACITY]
    mono = params[_P_MONOTONIC] != 0
    infer = params[_P_INFERENCE] != 0
    for s in range(sec_a, sec_b):
        f = floor[s]
        if mono and f < offset:
            f = offset
        if infer:
            f += total[s]
        if f > cap:
            return False
    return True


@njit(cache=True, nogil=True)
def _dfs(  # type: ignore[no-untyped-def]
    pbufs,
    sec_a,
    sec_b,
    orig,
    min_offset,
    min_pidx,
    lowers,
    uppers,
    sizes,
    blo,
    bhi,
    ov_ptr,
    ov_idx,
    sc_ptr,
    sc_idx,
    offsets,
    solution,
    mo,
    floor,
    total,
    cuts,
    ctr,
    params,
    heuristic,
    deadline,
):
    """One node: place an unplaced buffer of partition `pbufs` (sections [sec_a, sec_b)) at its min offset."""
    if ctr[_C_NODES_LEFT] <= 0:
        return _ABORTED
    ctr[_C_NODES_LEFT] -= 1
    ctr[_C_NODES] += 1
    if (ctr[_C_NODES] & params[_P_CHECK_MASK]) == 0 and now() > deadline:
        ctr[_C_DEADLINE] = 1
        return _ABORTED
    m = pbufs.shape[0]
    keys = np.empty(orig.shape[0], dtype=np.int64)
    cnt = 0
    for p in orig:
        b = pbufs[p]
        if offsets[b] == _NONE:
            keys[cnt] = mo[b] * m + p
            cnt += 1
    if cnt == 0:
        for b in pbufs:
            solution[b] = offsets[b]
        return _FOUND
    keys = np.sort(keys[:cnt])
    ordering = keys % m
    min_height = np.int64(1) << 62
    for p in ordering:
        b = pbufs[p]
        if mo[b] + sizes[b] < min_height:
            min_height = mo[b] + sizes[b]
    n_sections = floor.shape[0]
    for i in range(cnt):
        offset = keys[i] // m
        pidx = ordering[i]
        if params[_P_CANONICAL] and (offset < min_offset or (offset == min_offset and pidx < min_pidx)):
            continue
        if params[_P_DOMINANCE] and offset >= min_height:
            break  # sorted by offset: every later candidate is dominated too
        b = pbufs[pidx]
        offsets[b] = offset
        height = offset + sizes[b]
        # Raise the minimum offsets of unplaced buffers that overlap b in time (changes recorded).
        n_ov = ov_ptr[b + 1] - ov_ptr[b]
        ch_buf = np.empty(n_ov, dtype=np.int64)
        ch_val = np.empty(n_ov, dtype=np.int64)
        n_ch = 0
        hatless = True
        aff_lo = n_sections
        aff_hi = 0
        for j in range(ov_ptr[b], ov_ptr[b + 1]):
            o = ov_idx[j]
            if offsets[o] != _NONE:
                continue
            hatless = False
            if mo[o] >= height:
                continue
            ch_buf[n_ch] = o
            ch_val[n_ch] = mo[o]
            n_ch += 1
            mo[o] = height
            if params[_P_UNALLOC]:
                if blo[o] < aff_lo:
                    aff_lo = blo[o]
                if bhi[o] > aff_hi:
                    aff_hi = bhi[o]
        # Sections b lives in: floor up to its top; its size leaves the unplaced total.
        save_lo = blo[b] if blo[b] < aff_lo else aff_lo
        save_hi = bhi[b] if bhi[b] > aff_hi else aff_hi
        saved_floor = floor[save_lo:save_hi].copy()
        for s in range(blo[b], bhi[b]):
            floor[s] = height
            total[s] -= sizes[b]
        # Unallocated floor: no unplaced buffer of a section can go below its own minimum offset.
        for s in range(aff_lo, aff_hi):
            lowest = -1
            for j in range(sc_ptr[s], sc_ptr[s + 1]):
                o = sc_idx[j]
                if offsets[o] == _NONE and (lowest < 0 or mo[o] < lowest):
                    lowest = mo[o]
            if lowest > floor[s]:
                floor[s] = lowest
        result = _NOT_FOUND
        if _check(sec_a, sec_b, offset, floor, total, params):
            # Dynamic decomposition: split where no unplaced buffer crosses a section boundary any more.
            n_cut = 1
            cutpoints = np.empty(bhi[b] - blo[b] + 2, dtype=np.int64)
            cutpoints[0] = sec_a
            if params[_P_DECOMP]:
                solution[b] = offset
                for s in range(blo[b], bhi[b] - 1):
                    cuts[s] -= 1
                    if cuts[s] == 0:
                        cutpoints[n_cut] = s + 1
                        n_cut += 1
            if n_cut == 1:
                result = _dfs(
                    pbufs,
                    sec_a,
                    sec_b,
                    ordering,
                    offset,
                    pidx,
                    lowers,
                    uppers,
                    sizes,
                    blo,
                    bhi,
                    ov_ptr,
                    ov_idx,
                    sc_ptr,
                    sc_idx,
                    offsets,
                    solution,
                    mo,
                    floor,
                    total,
                    cuts,
                    ctr,
                    params,
                    heuristic,
                    deadline,
                )
            else:
                cutpoints[n_cut] = sec_b
                n_cut += 1
                result = _FOUND
                for c in range(1, n_cut):
                    lo = cutpoints[c - 1]
                    hi = cutpoints[c]
                    members = np.empty(m, dtype=np.int64)
                    n_mem = 0
                    for o in pbufs:
                        if offsets[o] == _NONE and not (bhi[o] <= lo or hi <= blo[o]):
                            members[n_mem] = o
                            n_mem += 1
                    if n_mem == 0:
                        continue
                    sub = _preorder(members[:n_mem], heuristic, lowers, uppers, sizes, blo, bhi, total)
                    result = _dfs(
                        sub,
                        lo,
                        hi,
                        np.arange(n_mem),
                        np.int64(0),
                        np.int64(0),
                        lowers,
                        uppers,
                        sizes,
                        blo,
                        bhi,
                        ov_ptr,
                        ov_idx,
                        sc_ptr,
                        sc_idx,
                        offsets,
                        solution,
                        mo,
                        floor,
                        total,
                        cuts,
                        ctr,
                        params,
                        heuristic,
                        deadline,
                    )
                    if result != _FOUND:
                        break
            if params[_P_DECOMP]:
                for s in range(blo[b], bhi[b] - 1):
                    cuts[s] += 1
        floor[save_lo:save_hi] = saved_floor
        for s in range(blo[b], bhi[b]):
            total[s] += sizes[b]
        for j in range(n_ch - 1, -1, -1):
            mo[ch_buf[j]] = ch_val[j]
        offsets[b] = _NONE
        if result != _NOT_FOUND:
            return result
        if hatless and params[_P_HATLESS]:
            break
    ctr[_C_BACKTRACKS] += 1
    return _NOT_FOUND


def _csr(lists: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    ptr = np.zeros(len(lists) + 1, dtype=np.int64)
    ptr[1:] = np.cumsum([len(x) for x in lists]) if lists else []
    idx = np.fromiter((v for x in lists for v in x), dtype=np.int64, count=int(ptr[-1]))
    return ptr, idx


# The compiled search recurses once per placed buffer of a partition, on the C stack. Above this many
# buffers it runs in a thread whose stack is sized for it (the main thread's is typically 8 MiB).
_THREAD_ABOVE_BUFFERS = 500
_STACK_BYTES_PER_BUFFER = 16 << 10
_MAX_STACK_BYTES = 1 << 30
_STACK_LOCK = threading.Lock()  # threading.stack_size is process-wide: set, start, restore


def search_placement(
    lowers: Sequence[int],
    uppers: Sequence[int],
    sizes: Sequence[int],
    capacity: int,
    *,
    time_limit_s: float = 10.0,
    rules: SearchRules | None = None,
) -> SearchResult:
    """Find offsets with every buffer below `capacity` and no two time-overlapping buffers sharing addresses.

    Status `found` with offsets, `infeasible` when the (complete) search proved none exists, or `timeout`.
    """
    n = len(sizes)
    if n <= _THREAD_ABOVE_BUFFERS:
        return _search_placement(lowers, uppers, sizes, capacity, time_limit_s=time_limit_s, rules=rules)
    stack = min(max(64 << 20, n * _STACK_BYTES_PER_BUFFER), _MAX_STACK_BYTES)
    out: list[SearchResult] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            out.append(
                _search_placement(lowers, uppers, sizes, capacity, time_limit_s=time_limit_s, rules=rules)
            )
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            errors.append(exc)

    with _STACK_LOCK:
        previous = threading.stack_size(stack)
        try:
            worker = threading.Thread(target=run, name="alloc-search")
            worker.start()
        finally:
            threading.stack_size(previous)
    worker.join()
    if errors:
        raise errors[0]
    return out[0]


def _search_placement(
    lowers: Sequence[int],
    uppers: Sequence[int],
    sizes: Sequence[int],
    capacity: int,
    *,
    time_limit_s: float = 10.0,
    rules: SearchRules | None = None,
) -> SearchResult:
    """Find offsets with every buffer below `capacity` and no two time-overlapping buffers sharing addresses.

    Status `found` with offsets, `infeasible` when the (complete) search proved none exists, or `timeout`.
    """
    t0 = time.perf_counter()
    rules = rules or SearchRules()
    n = len(sizes)
    if n == 0:
        return SearchResult(SearchStatus.found, [], 0, 0, 0.0)
    deadline = t0 + time_limit_s
    sw = sweep(lowers, uppers)
    lo = np.asarray(lowers, dtype=np.int64)
    up = np.asarray(uppers, dtype=np.int64)
    sz = np.asarray(sizes, dtype=np.int64)
    blo = np.asarray(sw.section_lo, dtype=np.int64)
    bhi = np.asarray(sw.section_hi, dtype=np.int64)
    ov_ptr, ov_idx = _csr(sw.overlaps)
    sc_ptr, sc_idx = _csr(sw.sections)
    n_sections = len(sw.sections)
    params = np.array(
        [
            capacity,
            rules.canonical_only,
            rules.check_dominance,
            rules.section_inference,
            rules.monotonic_floor,
            rules.unallocated_floor,
            rules.hatless_pruning,
            rules.dynamic_decomposition,
            0 if n > _CHECK_EVERY_NODE_ABOVE else 255,
        ],
        dtype=np.int64,
    )
    total0 = np.zeros(n_sections, dtype=np.int64)
    for s, members in enumerate(sw.sections):
        total0[s] = int(sz[members].sum())
    cuts0 = np.asarray(sw.cuts() or [0], dtype=np.int64)
    ctr = np.zeros(4, dtype=np.int64)
    node_limit = n if len(rules.preorders) > 1 else 1 << 62
    status = SearchStatus.timeout
    solution = np.full(n, _NONE, dtype=np.int64)
    used = None
    while status == SearchStatus.timeout:
        node_limit = min(node_limit * 2, 1 << 62)
        exhausted_budget = False
        for h in rules.preorders:
            heuristic = np.array([_HEURISTIC_CODES[c] for c in h], dtype=np.int64)
            offsets = np.full(n, _NONE, dtype=np.int64)
            mo = np.zeros(n, dtype=np.int64)
            floor = np.zeros(n_sections, dtype=np.int64)
            total = total0.copy()
            cuts = cuts0.copy()
            ctr[_C_NODES_LEFT] = node_limit
            result = _FOUND
            for part in sw.partitions:
                members = _preorder(
                    np.asarray(part.buffers, dtype=np.int64), heuristic, lo, up, sz, blo, bhi, total
                )
                result = _dfs(
                    members,
                    part.section_lo,
                    part.section_hi,
                    np.arange(len(members)),
                    0,
                    0,
                    lo,
                    up,
                    sz,
                    blo,
                    bhi,
                    ov_ptr,
                    ov_idx,
                    sc_ptr,
                    sc_idx,
                    offsets,
                    solution,
                    mo,
                    floor,
                    total,
                    cuts,
                    ctr,
                    params,
                    heuristic,
                    deadline,
                )
                if result != _FOUND:
                    break
            used = h
            if result == _FOUND:
                status = SearchStatus.found
                break
            if result == _NOT_FOUND:
                status = SearchStatus.infeasible
                break
            if ctr[_C_DEADLINE] or time.perf_counter() > deadline:
                break
            exhausted_budget = True
        if status != SearchStatus.timeout or not exhausted_budget:
            break
    offsets_out = [int(v) for v in solution] if status == SearchStatus.found else None
    return SearchResult(
        status,
        offsets_out,
        int(ctr[_C_NODES]),
        int(ctr[_C_BACKTRACKS]),
        time.perf_counter() - t0,
        preorder=used,
    )
