"""Allocation planner: static offsets for a training iteration's buffers, certified against a lower bound.

Public API (the service composes it into plans; the runtime arena consumes it):

* `plan_allocation(trace, ...) -> AllocationPlan` and `validate_allocation(trace, plan, ...)` on the
  contract's `AllocationTrace`;
* `simulate_caching_allocator(trace) -> CachingAllocatorReport`: PyTorch's CUDA caching allocator replayed;
* the plain-buffer layer for MiniMalloc CSV files: `Buffer`, `plan_buffers`, `validate_placement`,
  `read_minimalloc_csv`, `write_minimalloc_csv`, `search_placement`.

All three trace-level functions read the trace's columns and scale to 10^6 events (compiled sweeps over
treaps and segment trees; see docs/architecture/allocation.md, "Scale"); `scaled_traces` builds large
test traces from a profiled one.
"""

from planner_service.solver.allocation.buffers import (
    AllocationInputError,
    Buffer,
    lower_bound,
    peak_live_bytes,
)
from planner_service.solver.allocation.caching_allocator import (
    CachingAllocatorReport,
    simulate_caching_allocator,
)
from planner_service.solver.allocation.csv_io import (
    format_minimalloc_csv,
    parse_minimalloc_csv,
    read_minimalloc_csv,
    write_minimalloc_csv,
)
from planner_service.solver.allocation.planner import BufferPlan, plan_allocation, plan_buffers
from planner_service.solver.allocation.search import SearchResult, SearchRules, SearchStatus, search_placement
from planner_service.solver.allocation.trace_check import validate_allocation
from planner_service.solver.allocation.validate import AllocationValidationError, validate_placement

__all__ = [
    "AllocationInputError",
    "AllocationValidationError",
    "Buffer",
    "BufferPlan",
    "CachingAllocatorReport",
    "SearchResult",
    "SearchRules",
    "SearchStatus",
    "format_minimalloc_csv",
    "lower_bound",
    "parse_minimalloc_csv",
    "peak_live_bytes",
    "plan_allocation",
    "plan_buffers",
    "read_minimalloc_csv",
    "search_placement",
    "simulate_caching_allocator",
    "validate_allocation",
    "validate_placement",
    "write_minimalloc_csv",
]
