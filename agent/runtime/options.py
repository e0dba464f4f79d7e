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
        host, overlapped with the rest of backward (default). Set False to defer the host steps to
        `optimizer.step()`: needed for `clip_grad_norm_` and for gradient accumulation over several
        backward passes, since both need every gradient before any parameter changes (and to skip a
        step, e.g. after an inf/NaN check: overlapped steps cannot be undone).
    async_step: let `optimizer.step()` return before the host optimizer steps finish (default False).
        Each chunk's next upload waits for its own step, so deferred host steps overlap the next
        forward; but until `wrapped.synchronize()` (or a state dict, clip, report) offloaded
        parameters read directly may be mid-update.
    measure_uploads: on CUDA, time every upload with events (for the benchmark's hidden-upload figure).
    """

    device: torch.device | str | None = None
    compute_dtype: torch.dtype | None = None
    overlap_host_step: bool = True
    async_step: bool = False
    measure_uploads: bool = False
