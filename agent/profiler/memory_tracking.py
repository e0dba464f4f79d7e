"""The tracked iteration (step 5 of `profiling.profile`): a storage tracker (CPU: `TorchDispatchMode`; CUDA: the
allocator's history) and saved-tensor hooks give per-block activation, input and transient bytes, the peak and
the allocation trace."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from agent.profiler.allocation_trace import AllocationTraceTooLarge, build_allocation_trace
from agent.profiler.block_detection import RepeatedBlocks
from agent.profiler.block_marks import BlockTracker, Gauge, segments, transient_peaks
from agent.profiler.cuda_history import CudaAllocatorHistory, CudaGauge, history_records, state_records
from agent.profiler.device_clock import DeviceClock
from agent.profiler.hooks import BlockHooks
from agent.profiler.optimizer_probe import state_tensors
from agent.profiler.parameters import OrderedParameter
from agent.profiler.session import TrainingStep
from agent.profiler.storage_tracker import StorageRecord, StorageTracker
from agent.profiler.tensors import iter_tensors, storage_key, unique_storage_bytes
from client.contract import AllocationCategory, AllocationTrace, Phase

log = logging.getLogger(__name__)


def track_memory(
    model: nn.Module,
    step: TrainingStep,
    opt: torch.optim.Optimizer,
    batch: Any,
    dev: torch.device,
    repeated: RepeatedBlocks,
    ordered: list[OrderedParameter],
    want_trace: bool,
) -> tuple[list[int], list[int], list[int], list[int], int, AllocationTrace | None]:
    """One iteration under a storage tracker: activations, inputs, transients, peak, allocation trace."""
    n_blocks = len(repeated) + 2
    clock = DeviceClock(dev)
    block_of_param = {id(o.param): o.block for o in ordered}
    opt.zero_grad(set_to_none=True)
    excluded: set[tuple[str, int]] = set()
    long_lived: list[tuple[torch.Tensor, AllocationCategory, int | None]] = []
    for p in model.parameters():
        long_lived.append((p, AllocationCategory.param, block_of_param.get(id(p))))
    for mod_path, module in model.named_modules():
        for b in module.buffers(recurse=False):
            inside = repeated.index_of_path(mod_path)
            long_lived.append((b, AllocationCategory.param, inside + 1 if inside is not None else None))
    in_model = {id(p) for p in model.parameters()}  # with max_blocks: only the profiled blocks' state
    for owner, v in state_tensors(opt):
        if id(owner) in in_model:
            long_lived.append((v, AllocationCategory.optimizer, block_of_param.get(id(owner))))
    batch_tensors = list(iter_tensors(batch))
    for t, _, _ in long_lived:
        excluded.add(storage_key(t))
    for t in batch_tensors:
        excluded.add(storage_key(t))

    cuda = dev.type == "cuda"
    tracker: StorageTracker | None = None
    history: CudaAllocatorHistory | None = None
    gauge: Gauge
    if cuda:
        gauge = CudaGauge(dev)
        history = CudaAllocatorHistory(dev)
        on_saved: Callable[[torch.Tensor], None] = history.mark_saved
    else:
        tracker = StorageTracker()
        for t, cat, blk in long_lived:
            tracker.register_existing(t, cat, blk)
        for t in batch_tensors:
            tracker.register_external(t)
        gauge = tracker
        on_saved = tracker.mark_saved
    block_tracker = BlockTracker(clock, gauge=gauge)
    if tracker is not None:
        tracker.block_tracker = block_tracker
    grad_keys: dict[tuple[str, int], int] = {}
    with (
        _gradient_landings(model, block_tracker),
        BlockHooks(
            model, repeated, block_tracker, saved_tensors=True, excluded_storages=excluded, on_saved=on_saved
        ) as hooks,
    ):
        with tracker if tracker is not None else (history if history is not None else nullcontext()):
            step.run(block_tracker)
            if tracker is not None:
                grad_sids = {
                    rec.sid
                    for p in model.parameters()
                    if p.grad is not None
                    for rec in [tracker.record_of(p.grad)]
                    if rec is not None
                }
                grad_blocks = {
                    rec.sid: block_of_param.get(id(p), rec.block)
                    for p in model.parameters()
                    if p.grad is not None
                    for rec in [tracker.record_of(p.grad)]
                    if rec is not None
                }
            else:
                for p in model.parameters():
                    if p.grad is not None:
                        grad_keys[(str(p.grad.device), p.grad.untyped_storage().data_ptr())] = (
                            block_of_param.get(id(p), 0)
                        )
        act, inp = list(hooks.activation_bytes), list(hooks.input_bytes)
    inp[0] = unique_storage_bytes(batch_tensors, set())
    segs = segments(block_tracker.marks)
    fwd_tr = transient_peaks(segs, n_blocks, Phase.forward)
    bwd_tr = transient_peaks(segs, n_blocks, Phase.backward)
    peak = max([s.peak for s in segs] + [0])

    alloc: AllocationTrace | None = None
    if want_trace:
        if tracker is not None:
            records, n_events = tracker.records, tracker.n_events
            source = "dispatch_tracker"
        else:
            assert history is not None and isinstance(gauge, CudaGauge)
            records, n_events, grad_sids, grad_blocks = _cuda_records(
                long_lived, history, gauge, block_tracker, grad_keys
            )
            source = "cuda_caching_allocator"
        try:
            alloc = build_allocation_trace(
                records, n_events, grad_sids=grad_sids, grad_blocks=grad_blocks, source=source
            )
        except AllocationTraceTooLarge as e:
            log.warning("%s; the trace is sent without one", e)
    return act, inp, fwd_tr, bwd_tr, peak, alloc


def _cuda_records(
    long_lived: list[tuple[torch.Tensor, AllocationCategory, int | None]],
    history: CudaAllocatorHistory,
    gauge: CudaGauge,
    block_tracker: BlockTracker,
    grad_keys: dict[tuple[str, int], int],
) -> tuple[list[StorageRecord], int, set[int], dict[int, int | None]]:
    """Pre-existing model state first, then the allocator's events of the window (see cuda_history)."""
    return history_records(
        state_records(long_lived),
        history.entries,
        {addr: blk for (_, addr), blk in grad_keys.items()},
        mark_counts=gauge.mark_counts,
        mark_blocks=[(m.block, m.phase) for m in block_tracker.marks],
        saved=history.saved,
    )


@contextmanager
def _gradient_landings(model: nn.Module, block_tracker: BlockTracker) -> Iterator[None]:
    """While open, each gradient that lands in a parameter's `.grad` is told to `block_tracker.land`: it leaves
    the blocks' transients from then on (the runtime moves it into its chunk's gradient area, which the planner
    counts as model state). The hooks are removed on exit."""

    def landed(p: torch.Tensor) -> None:
        if p.grad is not None:
            block_tracker.land(p.grad.numel() * p.grad.element_size())

    handles: list[RemovableHandle] = []
    try:
        handles.extend(
            p.register_post_accumulate_grad_hook(landed) for p in model.parameters() if p.requires_grad
        )
        yield
    finally:
        for h in handles:
            h.remove()
