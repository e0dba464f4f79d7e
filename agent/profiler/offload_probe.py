"""Offloaded whole-model probe (CPU device): what the chunk runtime costs over every parameter, every chunk
offloaded, as the scale of the one-block runtime probe's chunk costs.

The runtime probe (`runtime_probe.py`) times one repeated block's parameters in one offloaded chunk, and
`runtime_costs.py` spreads its figures over every parameter tensor of the model. Saved runs of the issue-20
benchmark read back with `benchmarks/reread_results.py phase-errors` (docs/BENCHMARKS.md, session 30) show
the whole model's managed overhead above that spread on every VM type: by ~22% (Intel Xeon) and ~26% (AMD
EPYC) on 2 gloo ranks, in every run on the Xeon. What one block misses: the hooks of the root and of the edge
blocks (embedding, head, loss), the per-iteration entry points (`end_backward`, `optimizer.step()`'s settling
of every chunk), and one block's fastest-of-3 against a whole iteration's.

So on a CPU device the profile also runs the whole (profiled) model through the runtime's own code: one
offloaded chunk per block (prologue, each repeated block, epilogue: about the chunking the solver picks), two
device buffers, a fresh optimizer of the user's class over the same parameters, and a few full iterations
(forward, backward, `optimizer.step()`, `zero_grad()`) after a warm-up; the median one's time in the runtime's
entry points, timed directly as the runtime probe's `offload_s` is (both out of the noise of the compute around
them). The profile turns it into a factor on the spread chunk costs (`runtime_costs.whole_model_scale`): the
whole model's entry-point time less the copies and host steps the cost model charges apart, against the same
time spread from the one block. On CUDA the copies overlap compute and the cost model reads these costs on a
CPU device only (not run there). Parameters (values and storages), gradients and the user's optimizer are left
as they were.

**On by default in CPU profiles of a job of several ranks only** (session 30). The issue-20 benchmark on 2
gloo ranks, Intel Xeon VM, alternated in one sitting: 6, 6 and 8 of 8 configurations within 10% by the median
of 3 with it, 3, 4 and 2 of 8 without (docs/BENCHMARKS.md, session 30). Off in single-process profiles: it
costs 5-9 plain iterations of profile time on a CPU (4 managed iterations with every chunk offloaded, ~1.9
plain ones each: gpt2 and llama 4L/12L at hidden 256, one thread), which would take the profile call from
~9.5 to 14-19 iterations, over issue 3's 10, where the single-process predictions meet 10% without it (4 of 4
on the same VM). `MEMPLAN_WHOLE_MODEL_PROBE=1` runs it in every CPU profile, `=0` in none. A cheaper form (the
edges and one or two repeated blocks, fewer runs, in place of the one-block probe's offloaded runs) is the way
to turn it on everywhere; not built.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from agent.profiler.block_chunks import chunk_per_block, runtime_for_probe, supported_fresh_optimizer
from agent.profiler.device_clock import DeviceClock, SectionSpans
from agent.profiler.parameters import OrderedParameter
from agent.profiler.session import TrainingStep
from agent.runtime.optimizer import ChunkedOptimizer, UnsupportedOptimizerError
from agent.runtime.timing import ENTRY_POINTS
from client.contract import Placement

ENV = "MEMPLAN_WHOLE_MODEL_PROBE"  # "1": in every CPU profile, "0": in none (default: jobs of several ranks)
OFFLOADED_RUNS = 3  # timed iterations after the warm-up (the median is kept)
BUFFERS = 2  # device buffers: a chunk in use and the next one prefetched, as the solver's plans mostly have


@dataclass(frozen=True)
class OffloadProbe:
    """One managed iteration of the whole model with every chunk offloaded."""

    entry_points_s: float  # in the runtime's entry points: forward, backward, step(), zero_grad() (median)
    chunk_bytes: tuple[int, ...]  # each chunk's parameter bytes (one chunk per block, in order)
    chunk_params: tuple[int, ...]  # each chunk's parameter tensors
    uploads: float  # chunk uploads per iteration (the runtime's counter)


def enabled(world_size: int) -> bool:
    """Whether a CPU profile of a job of `world_size` ranks runs this probe: `MEMPLAN_WHOLE_MODEL_PROBE` "1" or
    "0" where set, else in jobs of several ranks (see the module docstring)."""
    switch = os.environ.get(ENV, "").strip()
    if switch in ("0", "1"):
        return switch == "1"
    if switch:
        raise ValueError(f"{ENV}: must be 0 or 1, got {switch!r}")
    return world_size > 1


def probe_offloaded(
    model: nn.Module,
    ordered: Sequence[OrderedParameter],
    step: TrainingStep,
    optimizer: torch.optim.Optimizer,
    device: torch.device,
) -> OffloadProbe | None:
    """Time the whole model under the chunk runtime, every chunk offloaded (see the module docstring); None
    where the runtime cannot hold these parameters (mixed dtypes, another device, frozen ones, an optimizer it
    does not support or cannot rebuild). `step`: the profile's training step (its batch and loss)."""
    params = [o.param for o in ordered]
    if (
        not params
        or not all(p.requires_grad for p in params)
        or len({p.dtype for p in params}) != 1
        or any(p.device != device for p in params)
    ):
        return None
    user = supported_fresh_optimizer(optimizer, params)
    if user is None:
        return None  # a class the runtime does not support, or cannot rebuild from its defaults: not probed
    layout = chunk_per_block(ordered, Placement.offloaded, BUFFERS)
    chunks = layout.chunks
    try:
        with runtime_for_probe(model, layout, device) as (manager, context):
            chunked = ChunkedOptimizer(user, layout, manager)
            manager.attach_optimizer(chunked)
            managed = TrainingStep(step.model, step.batch, step.loss_fn, chunked, len(chunks))
            # the runtime's timing hook, as the runtime probe's: the entry points torch and the loop call
            clock = DeviceClock.with_side_streams(
                device, (context.upload_stream, context.offload_stream), cuda=context.is_cuda
            )
            spans = SectionSpans(clock, ENTRY_POINTS)
            manager.timing.add_marks(clock, spans)
            managed.timed(clock)  # warm-up: host buffers, the optimizer state, the allocator's free lists
            before = manager.counters.uploads
            entries = []
            for _ in range(OFFLOADED_RUNS):
                spans.clear()
                managed.timed(clock)
                clock.synchronize()  # the end of the timed window: its marks can be read
                entries.append(spans.seconds())
            uploads = (manager.counters.uploads - before) / OFFLOADED_RUNS
    except UnsupportedOptimizerError:
        return None
    return OffloadProbe(
        entry_points_s=statistics.median(entries),
        chunk_bytes=tuple(c.used_numel * params[0].element_size() for c in chunks),
        chunk_params=tuple(len(c.entries) for c in chunks),
        uploads=uploads,
    )
