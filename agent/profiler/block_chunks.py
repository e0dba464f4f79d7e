"""The chunk runtime's layout and optimizer as the profiler's whole-model probes build them
(`persistent_probe.py`, `offload_probe.py`): one chunk per block (prologue, each repeated block, epilogue: about
the chunking the solver picks), a fresh optimizer of the user's class (the user's state is not touched), and
the runtime installed over them for the probe's time only."""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn

from agent.profiler.parameters import OrderedParameter
from agent.runtime.device import DeviceContext
from agent.runtime.layout import ChunkLayout, ChunkSpec, ParamEntry
from agent.runtime.manager import ModelStateManager
from agent.runtime.optimizer import UnsupportedOptimizerError, check_supported
from agent.runtime.options import RuntimeOptions
from client.contract import Placement


def chunk_per_block(ordered: Sequence[OrderedParameter], placement: Placement, n_buffers: int) -> ChunkLayout:
    """Every parameter of `ordered` (non-empty, one dtype) in a chunk of its block, in order, all placed alike;
    `n_buffers` device buffers (0 for persistent chunks), at most one per chunk."""
    chunks: list[ChunkSpec] = []
    by_param: dict[int, ParamEntry] = {}
    block = None
    offset = 0
    for o in ordered:
        if o.block != block:
            block, offset = o.block, 0
            chunks.append(ChunkSpec(index=len(chunks), placement=placement))
        e = ParamEntry(
            name=o.name,
            param=o.param,
            chunk=len(chunks) - 1,
            offset=offset,
            numel=o.param.numel(),
            shape=o.param.shape,
        )
        chunks[-1].entries.append(e)
        by_param[id(o.param)] = e
        offset += e.numel
    return ChunkLayout(
        chunk_numel=max(c.used_numel for c in chunks),
        compute_dtype=ordered[0].param.dtype,
        chunks=chunks,
        n_buffers=min(n_buffers, len(chunks)),
        by_param=by_param,
    )


def supported_fresh_optimizer(
    optimizer: torch.optim.Optimizer, params: Sequence[torch.nn.Parameter]
) -> torch.optim.Optimizer | None:
    """`fresh_optimizer`, None also where the chunk runtime does not support `optimizer`'s class."""
    try:
        check_supported(optimizer)
    except UnsupportedOptimizerError:
        return None
    return fresh_optimizer(optimizer, params)


def fresh_optimizer(
    optimizer: torch.optim.Optimizer, params: Sequence[torch.nn.Parameter]
) -> torch.optim.Optimizer | None:
    """An optimizer of `optimizer`'s class with its first group's hyper-parameters over `params`; None when the
    class cannot be rebuilt from those (a constructor that takes other arguments)."""
    group = optimizer.param_groups[0]
    accepted = inspect.signature(type(optimizer).__init__).parameters
    hyper = {k: group[k] for k in optimizer.defaults if k in group and k in accepted and k != "params"}
    try:
        return type(optimizer)(list(params), **hyper)
    except (TypeError, ValueError):
        return None


@contextmanager
def runtime_for_probe(
    model: nn.Module, layout: ChunkLayout, device: torch.device
) -> Iterator[tuple[ModelStateManager, DeviceContext]]:
    """The chunk runtime over `layout`'s parameters while open; then its hooks removed and every parameter given
    its own storage and gradient back (the runtime copies the values into its chunks and never writes the
    parameters' storages: no copy back is needed, whatever the probe stepped)."""
    params = [e.param for c in layout.chunks for e in c.entries]
    data = [p.data for p in params]
    grads = [p.grad for p in params]
    manager: ModelStateManager | None = None
    try:
        context = DeviceContext(device)
        manager = ModelStateManager(model, layout, context, RuntimeOptions(device=device))
        yield manager, context
    finally:
        if manager is not None:
            manager.remove_hooks()
        for p, d, g in zip(params, data, grads, strict=True):
            p.data = d
            p.grad = g
