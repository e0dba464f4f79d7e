"""Persistent-chunk probe: what the chunk runtime's device-side path costs, over the whole model's parameters.

A plain iteration's optimizer work is one `optimizer.step()` and a `zero_grad()` that drops the gradients;
backward hands each parameter its fresh gradient. Under the chunk runtime a persistent chunk's parameters
and gradients live in the chunk's flat buffers instead: a gradient hook per parameter copies the fresh
gradient into the chunk's gradient area, `optimizer.step()` runs one optimizer of the user's class per chunk
over flat runs, and `zero_grad()` walks the chunks. Those costs grow with the number of chunks and
parameters, so one block's figure does not extrapolate (its per-call costs dominate); they are measured here
over every parameter of the profiled model, through the runtime's own code: all parameters in persistent
chunks, one chunk per block (prologue, each repeated block, epilogue: about the chunking the solver picks):
`zero_grad()`, a backward whose gradient hooks are the runtime's (fresh gradients of ones; the hooks are
timed, not the backward's own work, a stand-in for the real one), `optimizer.step()` twice on those
gradients (the first makes the optimizer state; the second is timed), `zero_grad()` (timed). About one
optimizer step and a pass over the gradients more than the runtime's own calls.

Timed on the profiler's `DeviceClock` (wall time on CPU; on CUDA events on the compute stream and the
runtime's upload and offload streams, read after the device is synchronised at the end of the probe).

The profile charges it on a CPU device as the device optimizer's throughput (`optimizer.device_bytes_per_s`
= stepped parameter bytes / these seconds): the cost model charges every persistent chunk its used bytes
at that rate, exactly the chunks that pay these costs. Parameters (values and storages), gradients and the
user's optimizer are left as they were.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from agent.profiler.block_chunks import chunk_per_block, runtime_for_probe, supported_fresh_optimizer
from agent.profiler.device_clock import DeviceClock, SectionSpans
from agent.profiler.parameters import OrderedParameter
from agent.runtime.optimizer import ChunkedOptimizer, UnsupportedOptimizerError
from agent.runtime.timing import GRAD_HOOK, STEP, ZERO_GRAD
from client.contract import Placement


@dataclass(frozen=True)
class PersistentProbe:
    """Seconds per iteration in the chunk runtime's persistent-chunk entry points (whole model)."""

    grad_hooks_s: float  # gradient hooks: each fresh gradient copied into its chunk's gradient area
    step_s: float  # optimizer.step() over the persistent chunks
    zero_grad_s: float
    stepped_bytes: int  # parameter bytes the step updated
    chunks: int

    @property
    def total_s(self) -> float:
        return self.grad_hooks_s + self.step_s + self.zero_grad_s


def probe_persistent(
    model: nn.Module,
    ordered: Sequence[OrderedParameter],
    optimizer: torch.optim.Optimizer,
    device: torch.device,
) -> PersistentProbe | None:
    """Time the runtime's persistent path on every parameter of `model` (see the module docstring); None when
    the runtime cannot hold these parameters (mixed dtypes, another device, an optimizer it does not support)."""

    params = [o.param for o in ordered]
    trainable = [p for p in params if p.requires_grad]
    if not trainable or len({p.dtype for p in params}) != 1 or any(p.device != device for p in params):
        return None
    user = supported_fresh_optimizer(optimizer, trainable)
    if user is None:
        return None  # a class the runtime does not support, or cannot rebuild from its defaults: not probed
    layout = chunk_per_block(ordered, Placement.persistent, 0)
    chunks = layout.chunks
    try:
        with runtime_for_probe(model, layout, device) as (manager, context):
            # the runtime's timing hook: the gradient hooks, `step` and `zero_grad`, each where torch calls it,
            # on a clock over compute and the runtime's side streams
            clock = DeviceClock.with_side_streams(
                device, (context.upload_stream, context.offload_stream), cuda=context.is_cuda
            )
            spans = SectionSpans(clock, frozenset({GRAD_HOOK, STEP, ZERO_GRAD}))
            manager.timing.add_marks(clock, spans)
            chunked = ChunkedOptimizer(user, layout, manager)
            manager.attach_optimizer(chunked)
            chunked.zero_grad()  # as after a step: no gradients, backward's fresh ones are copied into the chunks
            with torch.enable_grad():
                torch.autograd.backward([p.sum() for p in trainable])
            chunked.step()  # warm-up: the optimizer state is made by the first step
            spans.clear(STEP)
            chunked.step()  # timed, on the same gradients
            chunked.zero_grad()
            clock.synchronize()  # the end of the measured window: the marks can be read
            hooks_s, step_s, zero_s = (spans.seconds(n) for n in (GRAD_HOOK, STEP, ZERO_GRAD))
    except UnsupportedOptimizerError:
        return None
    return PersistentProbe(
        grad_hooks_s=hooks_s,
        step_s=step_s,
        zero_grad_s=zero_s,
        stepped_bytes=sum(p.numel() * p.element_size() for p in trainable),
        chunks=len(chunks),
    )
