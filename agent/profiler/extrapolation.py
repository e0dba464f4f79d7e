"""Profiling a model larger than the device: profile the prologue, the first k repeated blocks and the
epilogue (`truncated`, `blocks_that_fit`), and give each unprofiled block the figures of a profiled block
of its own kind (`extrapolate`).

Blocks need not be alike. A block's kind (`block_kinds`) is its parameter signature: its class and, for
every parameter, the name relative to the block, the shape, the dtype and whether it trains. Hybrid
stacks (Jamba: Mamba and attention layers in one list) and stacks whose first block differs (RWKV's
`pre_ln`, T5's `relative_attention_bias`) have several kinds.

Chosen rule: the profiled part stays a prefix of the block list, extended until it holds the first block
of every kind (`covering_prefix`); every later block copies the last profiled block of its kind. Why a
prefix, not "the first block of each kind wherever it is": the model runs its truncated list in order, so
a prefix runs exactly the code the full model runs for those blocks (RWKV and T5 key behaviour on the
block's position or the first block's outputs), while a gapped selection would feed block 5 the output of
block 0 and measure something the real model never does. Why per kind and not "profile everything when
blocks differ": a periodic hybrid (Mamba, Mamba, attention, ...) needs only one period profiled, and the
copy of a block of the same signature is the same assumption identical blocks already rest on. For a
model whose blocks are all alike there is one kind, the covering prefix is one block, and the result is
exactly what it was before kinds existed (same k, same copies of the last profiled block, same sums).

The covering prefix may exceed the usual budget (model states within half the capacity, the other half
left for activations), and even the `device_memory` limit itself: that limit is the plan's target, not
what the profile physically has (a CPU run, or a device with more memory than the limit). Only when the
prefix's states exceed the device memory physically free (CUDA, model not on the device yet) can no
exact profile be taken; the error then names what the user controls (free device memory, `blocks=`;
`device_memory=` cannot add any), never an internal argument.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from agent.profiler.block_detection import BlockDetectionError, RepeatedBlocks
from agent.profiler.parameters import OrderedParameter
from client.contract import BlockMeasurement

log = logging.getLogger(__name__)

BlockKind = tuple[str, tuple[tuple[str, tuple[int, ...], str, bool], ...]]


def block_kind(module: nn.Module) -> BlockKind:
    """The parameter signature of one block: class, and (relative name, shape, dtype, trains) per parameter."""
    return (
        type(module).__qualname__,
        tuple((name, tuple(p.shape), str(p.dtype), p.requires_grad) for name, p in module.named_parameters()),
    )


def block_kinds(repeated: RepeatedBlocks) -> list[int]:
    """Per block, the index of its kind (0 for the first block's kind, 1 for the next new one, ...)."""
    seen: dict[BlockKind, int] = {}
    return [seen.setdefault(block_kind(m), len(seen)) for m in repeated.modules]


def covering_prefix(kinds: list[int]) -> int:
    """The length of the shortest prefix of the block list that holds a block of every kind."""
    first: dict[int, int] = {}
    for i, kind in enumerate(kinds):
        first.setdefault(kind, i)
    return max(first.values()) + 1


def _user_blocks_hint(repeated: RepeatedBlocks) -> str:
    return f"the repeated blocks ({len(repeated)}, from {repeated.names[0]!r} to {repeated.names[-1]!r})"


@contextmanager
def truncated(model: nn.Module, repeated: RepeatedBlocks, k: int) -> Iterator[RepeatedBlocks]:
    """While open, the model's block list holds only its first `k` blocks (for extrapolation)."""
    if k >= len(repeated):
        yield repeated
        return
    if repeated.container_name is None:
        raise BlockDetectionError(
            f"blocks: the model is too large to profile whole on this device, so only the first {k} of "
            f"{_user_blocks_hint(repeated)} can be profiled and the rest extrapolated, which needs the blocks "
            "in one nn.ModuleList; the blocks given are not. Pass blocks= from one nn.ModuleList, or raise "
            "the device memory (device_memory=) so the whole model is profiled"
        )
    container = model.get_submodule(repeated.container_name)
    parent_path, _, attr = repeated.container_name.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    if not isinstance(container, (nn.ModuleList, nn.Sequential)) or not attr:
        raise BlockDetectionError(
            f"blocks: the model is too large to profile whole on this device, so only the first {k} of "
            f"{_user_blocks_hint(repeated)} can be profiled, which needs them in an nn.ModuleList or "
            f"nn.Sequential inside the model; {repeated.container_name or 'the model'!r} is not. Pass "
            "blocks= from one nn.ModuleList, or raise the device memory (device_memory=)"
        )
    if len({id(m) for m in container}) != len(container):
        raise BlockDetectionError(
            f"blocks: the model is too large to profile whole on this device, so only the first {k} of "
            f"{_user_blocks_hint(repeated)} would be profiled and the rest extrapolated; but "
            f"{repeated.container_name!r} holds one module at several places (weights shared across layers), "
            "whose calls a shorter list would not make. Raise the device memory (device_memory=) so the whole "
            "model is profiled"
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
    """Give each unprofiled block j >= k the figures (and parameter order) of the last profiled block of
    its kind. `k` covers every kind (`covering_prefix`)."""
    n = len(repeated)
    kinds = block_kinds(repeated)
    last_of_kind = {kind: i for i, kind in enumerate(kinds[:k])}  # later index wins: the last profiled
    if covering_prefix(kinds) > k:  # `profile` checks an explicit max_blocks first; this is the contract
        raise BlockDetectionError(
            f"blocks: the first {k} blocks miss a kind of block; {covering_prefix(kinds)} are needed"
        )
    canonical = {id(p): name for name, p in named.items()}
    epilogue_old = k + 1
    head = [o for o in ordered if o.block <= k]
    placed = {id(o.param) for o in head}
    tail = [
        OrderedParameter(o.param, o.name, o.module_path, n + 1, o.aliases, o.use_blocks)
        for o in ordered
        if o.block == epilogue_old
    ]
    placed.update(id(o.param) for o in tail)
    middle: list[OrderedParameter] = []
    copies: dict[int, list[int]] = {}  # representative block -> the blocks that copy it
    for j in range(k, n):
        r = last_of_kind[kinds[j]]
        copies.setdefault(r, []).append(j)
        rep_prefix = repeated.names[r] + "."
        prefix = repeated.names[j] + "."
        module = repeated.modules[j]
        own = dict(module.named_parameters())
        # the representative's own parameters in its execution order; one it merely used (owned
        # elsewhere, e.g. shared) is already placed where it was first used
        order = [
            o.name[len(rep_prefix) :] for o in ordered if o.block == r + 1 and o.name.startswith(rep_prefix)
        ]
        order += [rel for rel in own if rel not in order]
        for rel in order:
            p = own.get(rel)
            if p is None or id(p) in placed:
                continue
            placed.add(id(p))
            pname = canonical.get(id(p), prefix + rel)
            module_path = pname.rpartition(".")[0]
            middle.append(OrderedParameter(p, pname, module_path, j + 1, ()))
    new_blocks = blocks[: k + 1]
    for j in range(k, n):
        new_blocks.append(blocks[last_of_kind[kinds[j]] + 1].model_copy(update={"block": j + 1}))
    new_blocks.append(blocks[epilogue_old].model_copy(update={"block": n + 1}))
    for r, copied in sorted(copies.items()):
        rb = blocks[r + 1]
        rep_params = [o.param for o in ordered if o.block == r + 1]
        # a frozen parameter holds its values only; a trained one its gradient and optimizer state too
        trained = sum(p.numel() * p.element_size() for p in rep_params if p.requires_grad)
        frozen = sum(p.numel() * p.element_size() for p in rep_params if not p.requires_grad)
        extra = len(copied)
        iteration_s += extra * (rb.forward_s + rb.backward_s)
        peak += extra * (rb.activation_bytes + frozen + int(trained * model_state_bytes_per_byte))

    def uses_in_full_model(used: tuple[int, ...]) -> tuple[int, ...]:
        # a use in a representative block is a use in every block copying it; the epilogue moves to the end
        full: set[int] = set()
        for u in used:
            full.add(n + 1 if u == epilogue_old else u)
            full.update(j + 1 for j in copies.get(u - 1, ()) if 1 <= u <= k)
        return tuple(sorted(full))

    placed_params = [
        dataclasses.replace(o, use_blocks=uses_in_full_model(o.use_blocks)) if o.use_blocks else o
        for o in head + middle + tail
    ]
    return placed_params, new_blocks, iteration_s, peak


def _state_bytes(ps: Iterable[nn.Parameter]) -> int:
    """Parameter + gradient + two fp32 Adam moments per element of a trainable parameter; the parameter alone
    for a frozen one."""
    return sum(p.numel() * ((2 * p.element_size() + 8) if p.requires_grad else p.element_size()) for p in ps)


def blocks_that_fit(
    model: nn.Module, repeated: RepeatedBlocks, dev: torch.device, limit: int | None
) -> int | None:
    """How many repeated blocks to profile when the whole model would not fit the device, else None.

    Capacity: `device_memory_limit` if given, and on CUDA the free device memory when the model is not on
    the device yet. Model states are estimated at parameter + gradient + two fp32 Adam moments per element
    of a trainable parameter (`requires_grad`), the parameter alone for a frozen one, and must stay within
    half the capacity (the other half is left for activations); as many blocks as fit that budget are
    profiled (at least one, and at least the covering prefix when blocks are of several kinds:
    `profiled_prefix`) and the rest extrapolated.
    """
    capacity = limit
    free: int | None = None
    params = list(model.parameters())
    if dev.type == "cuda" and any(p.device != dev for p in params):
        free, _ = torch.cuda.mem_get_info(dev)
        capacity = free if capacity is None else min(capacity, free)
    if capacity is None:
        return None
    total = _state_bytes(params)
    if total <= capacity // 2:
        return None
    return profiled_prefix(repeated, total, capacity, free)


def profiled_prefix(repeated: RepeatedBlocks, total: int, capacity: int, free: int | None) -> int | None:
    """The blocks to profile of a model whose states (`total` bytes) exceed half of `capacity`; None: all.

    `free`: the device memory physically free for the profile (CUDA, model not on the device yet), else
    None (a CPU run, or a limit below what the device has: the limit is the plan's target, the profile may
    exceed it). Raises BlockDetectionError when the blocks of every kind cannot be profiled in `free`.
    """
    budget = capacity // 2
    kinds = block_kinds(repeated)
    n = len(repeated)
    if len(set(kinds)) == 1:
        per_block = max(1, _state_bytes(list(repeated.modules[0].parameters())))
        others = max(0, total - per_block * n)
        fit = int(max(1, min(n - 1, (budget - others) // per_block)))
    else:
        sizes = [_state_bytes(m.parameters()) for m in repeated.modules]
        others = max(0, total - sum(sizes))
        fit = 1
        while fit < n - 1 and others + sum(sizes[: fit + 1]) <= budget:
            fit += 1
        need = covering_prefix(kinds)
        if need > fit:
            states = others + sum(sizes[:need])
            if free is not None and states > free:
                raise BlockDetectionError(
                    f"blocks: the model's repeated blocks are of {len(set(kinds))} kinds (parameter names, "
                    f"shapes, dtypes); each kind must be profiled, and the first block of the last kind is "
                    f"{repeated.names[need - 1]!r} (block {need - 1} of {n}): profiling blocks up to it "
                    f"needs ~{states >> 20} MiB of model states, more than the {free >> 20} MiB free on the "
                    "device. Free device memory (the device_memory= limit cannot add any), or pass blocks= "
                    "listing only repeated blocks that are alike"
                )
            fit = need
        if fit >= n:
            log.warning(
                "model states (~%d MiB) exceed half of the device's %d MiB, but the repeated blocks are of "
                "%d kinds and the last kind first appears in block %d of %d: profiling every block",
                total >> 20,
                capacity >> 20,
                len(set(kinds)),
                need - 1,
                n,
            )
            return None
    log.warning(
        "model states (~%d MiB) exceed half of the device's %d MiB: profiling %d of %d blocks and "
        "extrapolating the rest",
        total >> 20,
        capacity >> 20,
        fit,
        n,
    )
    return fit
