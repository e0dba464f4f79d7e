"""Runtime options: the typed knobs of applying a plan (everything else comes from the plan itself)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RuntimeOptions:
    """How to apply a plan.

    device: where persistent chunks and buffers live; default: the model's device if it is not the CPU,
        else CUDA when available, else the CPU.
    compute_dtype: dtype of the training copy (parameters, gradients); default: the model's dtype. When
        it is not fp32 the runtime keeps an fp32 master copy (mixed precision). An fp32 model wrapped
        with compute_dtype=torch.bfloat16 keeps its exact fp32 values as master.
    overlap_host_step: run each offloaded chunk's host optimizer step as soon as its gradients reach the
        host, overlapped with the rest of backward (default). These steps are speculative: after backward
        every offloaded parameter exposes `.grad` (a host tensor), and `optimizer.step()` checks whether
        that gradient was changed since (clipping, unscaling, any user edit), whether the hyper-parameters
        changed, or whether another backward came first (gradient accumulation); only the chunks whose
        speculative step was wrong are restored from their backup and stepped again. `zero_grad()`
        without `step()` undoes them. Set False to run every host step at `optimizer.step()` (no backup
        memory, no overlap).
    undo_host_steps: keep, per offloaded chunk, what undoing a speculative step needs (a copy of the fp32
        master and of the optimizer state, on the host) (default True). False saves that host memory;
        then a gradient changed after an overlapped step (e.g. clipping that actually scales) raises an
        error instead of being honoured. Ignored when overlap_host_step is False.
    async_step: let `optimizer.step()` return before the host optimizer steps finish (default False).
        Each chunk's next upload waits for its own step, so deferred host steps overlap the next
        forward; but until `wrapped.synchronize()` (or a state dict, clip, report) offloaded
        parameters read directly may be mid-update.
    measure_uploads: on CUDA, time every upload with events (for the benchmark's hidden-upload figure).
    """

    device: torch.device | str | None = None
    compute_dtype: torch.dtype | None = None
    overlap_host_step: bool = True
    undo_host_steps: bool = True
    async_step: bool = False
    measure_uploads: bool = False
