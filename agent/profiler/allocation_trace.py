"""Turn recorded storages (CPU tracker or CUDA allocator history) into a contract `AllocationTrace`.

Logical time is the event index: every allocation and every free is one event, in the order they
happened. Storages alive before the window (parameters, buffers, optimizer states) come first, at
indices 0..n-1, with `free_index` None. Categories:
- param: parameters and buffers (model state that is not trained state is kept with the parameters);
- optimizer: optimizer state tensors;
- grad: storages that are some parameter's `.grad` at the end of the iteration (allocated in backward,
  freed only by the next iteration's `zero_grad`, so `free_index` None);
- activation: storages saved for backward (saved-tensor hooks);
- temp: everything else.
A non-long-lived storage still alive when the window closes (none, normally: the profiler drops its
references to the output and loss before closing) is given `free_index = horizon`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from agent.profiler.storage_tracker import StorageRecord
from client.contract import AllocationCategory, AllocationTrace, EventArrays
from client.contract.common import MAX_ALLOCATION_EVENTS
from client.contract.trace import CATEGORIES, EVENT_FIELDS, PHASES

LONG_LIVED = (AllocationCategory.param, AllocationCategory.grad, AllocationCategory.optimizer)


class AllocationTraceTooLarge(ValueError):
    """The iteration made more allocation events than the contract allows."""


def build_allocation_trace(
    records: Iterable[StorageRecord],
    n_events: int,
    *,
    grad_sids: set[int],
    grad_blocks: dict[int, int | None],
    source: str,
) -> AllocationTrace:
    """The AllocationTrace of one window; `grad_sids` are records that ended as parameter gradients."""
    if n_events > MAX_ALLOCATION_EVENTS:
        raise AllocationTraceTooLarge(
            f"allocation_trace.events: the iteration made {n_events} events, over the contract's "
            f"{MAX_ALLOCATION_EVENTS}; profile with allocation_trace=False or a smaller batch"
        )
    horizon = max(1, n_events)
    cols: dict[str, list[Any]] = {f: [] for f in EVENT_FIELDS}
    for r in records:
        block = r.block
        if r.category is not None:
            category = r.category
        elif r.sid in grad_sids:
            category = AllocationCategory.grad
            block = grad_blocks.get(r.sid, block)
        elif r.saved_for_backward:
            category = AllocationCategory.activation
        else:
            category = AllocationCategory.temp
        if category in LONG_LIVED:
            free_index = -1
        else:
            free_index = r.free_event if r.free_event is not None else horizon
        for f, v in zip(
            EVENT_FIELDS,
            (r.sid, r.nbytes, r.alloc_event, free_index, category, -1 if block is None else block, r.phase),
            strict=True,
        ):
            cols[f].append(v)
    # Columns straight into the contract's packed wire form (validated there by array checks), no per-event
    # objects and no per-value validation.
    arrays = EventArrays.from_arrays(
        **cols
        | {
            "category": EventArrays.codes(cols["category"], CATEGORIES),
            "phase": EventArrays.codes(cols["phase"], PHASES),
        }
    )
    return AllocationTrace(source=source, horizon=horizon, event_arrays=arrays)  # source: str -> Literal
