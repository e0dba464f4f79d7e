"""`max_blocks`: profile the first k repeated blocks of a model larger than the device (`truncated`,
`blocks_that_fit`) and copy the last profiled block's figures to the other, identical blocks (`extrapolate`)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from agent.profiler.block_detection import BlockDetectionError, RepeatedBlocks
from agent.profiler.parameters import OrderedParameter
from client.contract import BlockMeasurement

log = logging.getLogger(__name__)


@contextmanager
def truncated(model: nn.Module, repeated: RepeatedBlocks, k: int) -> Iterator[RepeatedBlocks]:
    """While open, the model's block list holds only its first `k` blocks (for extrapolation)."""
    if k >= len(repeated):
        yield repeated
        return
    if repeated.container_name is None:
        raise BlockDetectionError(
            "max_blocks: extrapolation needs the repeated blocks in one nn.ModuleList; the given blocks are not"
        )
    container = model.get_submodule(repeated.container_name)
    parent_path, _, attr = repeated.container_name.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    if not isinstance(container, (nn.ModuleList, nn.Sequential)) or not attr:
        raise BlockDetectionError(
            f"max_blocks: {repeated.container_name or 'the model'!r} is not an nn.ModuleList or nn.Sequential "
            "inside the model"
        )
    kept = list(container)[:k]
    setattr(
        parent, attr, nn.Sequential(*kept) if isinstance(container, nn.Sequential) else nn.ModuleList(kept)
    )
    try:
        yield RepeatedBlocks(repeated.names[:k], repeated.modules[:k], repeated.container_name)
    finally:
        setattr(parent, attr, container)


def extrapolate(
    repeated: RepeatedBlocks,
    k: int,
    ordered: list[OrderedParameter],
    blocks: list[BlockMeasurement],
    iteration_s: float,
    peak: int,
    named: dict[str, nn.Parameter],
    model_state_bytes_per_byte: float,
) -> tuple[list[OrderedParameter], list[BlockMeasurement], float, int]:
    """Copy the last profiled block's figures (and its parameter order) to the unprofiled identical blocks."""
    n = len(repeated)
    rep = k  # contract index of the last profiled repeated block
    rep_prefix = repeated.names[k - 1] + "."
    rep_params = [o for o in ordered if o.block == rep]
    epilogue_old = k + 1
    head = [o for o in ordered if o.block <= k]
    tail = [
        OrderedParameter(o.param, o.name, o.module_path, n + 1, o.aliases)
        for o in ordered
        if o.block == epilogue_old
    ]
    middle: list[OrderedParameter] = []
    for j in range(k, n):
        prefix = repeated.names[j] + "."
        for o in rep_params:
            if not o.name.startswith(rep_prefix):
                raise BlockDetectionError(
                    f"max_blocks: parameter {o.name!r} of block {rep} is outside its module"
                )
            pname = prefix + o.name[len(rep_prefix) :]
            if pname not in named:
                raise BlockDetectionError(
                    f"max_blocks: block {repeated.names[j]!r} has no {pname!r}; blocks differ"
                )
            middle.append(
                OrderedParameter(named[pname], pname, prefix + o.module_path[len(rep_prefix) :], j + 1, ())
            )
    rb = blocks[rep]
    new_blocks = blocks[: k + 1]
    for j in range(k + 1, n + 1):
        new_blocks.append(rb.model_copy(update={"block": j}))
    new_blocks.append(blocks[epilogue_old].model_copy(update={"block": n + 1}))
    extra = n - k
    # a frozen parameter holds its values only; a trained one its gradient and optimizer state too
    trained = sum(o.param.numel() * o.param.element_size() for o in rep_params if o.param.requires_grad)
    frozen = sum(o.param.numel() * o.param.element_size() for o in rep_params if not o.param.requires_grad)
    iteration_s += extra * (rb.forward_s + rb.backward_s)
    peak += extra * (rb.activation_bytes + frozen + int(trained * model_state_bytes_per_byte))
    return head + middle + tail, new_blocks, iteration_s, peak


def blocks_that_fit(
    model: nn.Module, repeated: RepeatedBlocks, dev: torch.device, limit: int | None
) -> int | None:
    """How many repeated blocks to profile when the whole model would not fit the device, else None.

    Capacity: `device_memory_limit` if given, and on CUDA the free device memory when the model is not on
    the device yet. Model states are estimated at parameter + gradient + two fp32 Adam moments per element
    of a trainable parameter (`requires_grad`), the parameter alone for a frozen one, and must stay within
    half the capacity (the other half is left for activations); as many blocks as
    fit that budget are profiled (at least one) and the rest extrapolated.
    """
    capacity = limit
    params = list(model.parameters())
    if dev.type == "cuda" and any(p.device != dev for p in params):
        free, _ = torch.cuda.mem_get_info(dev)
        capacity = free if capacity is None else min(capacity, free)
    if capacity is None:
        return None

    def state_bytes(ps: Iterator[nn.Parameter] | list[nn.Parameter]) -> int:
        return sum(
            p.numel() * ((2 * p.element_size() + 8) if p.requires_grad else p.element_size()) for p in ps
        )

    total = state_bytes(params)
    budget = capacity // 2
    if total <= budget:
        return None
    per_block = max(1, state_bytes(list(repeated.modules[0].parameters())))
    others = max(0, total - per_block * len(repeated))
    fit = max(1, min(len(repeated) - 1, (budget - others) // per_block))
    log.warning(
        "model states (~%d MiB) exceed half of the device's %d MiB: profiling %d of %d blocks and "
        "extrapolating the rest",
        total >> 20,
        capacity >> 20,
        fit,
        len(repeated),
    )
    return int(fit)
