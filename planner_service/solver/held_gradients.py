"""Gradients autograd holds across blocks' backward: a tied parameter's gradient from its later use.

A parameter used by two blocks (GPT-2's `lm_head` shares `transformer.wte.weight`) has one gradient
accumulator; autograd keeps the gradient of the later use (produced in that block's backward) until the
earlier use's backward has added its part, so from the backward of the block after the first use down to
the first use's block that gradient is live on the device beside everything the block's own backward holds.
The profiler measures a block's backward transient above the bytes live when its backward starts, so the
held gradient is in no block's transient; `held_gradient_bytes` gives it per block and the instance adds it
to the backward peaks (`PolicyInstance.bwd_peak_bytes`).
"""

from __future__ import annotations

from client.contract import BlockInfo, ParameterInfo
from planner_service.solver.chunk_grid import module_of


def block_modules(block: BlockInfo) -> tuple[str, ...]:
    """The module paths a block runs: its name, or the modules listed in a grouped block's brackets
    (`prologue[transformer.wte,transformer.wpe]`)."""
    name = block.name
    if name.endswith("]") and "[" in name:
        return tuple(m for m in name[name.index("[") + 1 : -1].split(",") if m)
    return (name,)


def block_of_module(blocks: list[BlockInfo], module: str) -> int:
    """The block that runs `module`: the one whose module path is it or contains it; a module outside every
    block runs after the last repeated block (as the profiler maps such parameters): the last block."""
    for b, block in enumerate(blocks):
        for path in block_modules(block):
            if module == path or module.startswith(path + "."):
                return b
    return len(blocks) - 1


def held_gradient_bytes(blocks: list[BlockInfo], parameters: list[ParameterInfo]) -> tuple[int, ...]:
    """Per block: bytes of tied parameters' gradients held by autograd during the block's backward.

    A trainable parameter first used by block `p` and, through an alias, by a later block `q` holds a
    gradient of its own bytes from `q`'s backward until `p`'s backward ends: blocks `p..q-1` (block `q`
    produces it inside its own measured transient)."""
    held = [0] * len(blocks)
    for param in parameters:
        if not param.aliases or not param.trainable:
            continue
        last = max(block_of_module(blocks, module_of(alias)) for alias in param.aliases)
        for b in range(param.block, last):
            held[b] += param.bytes
    return tuple(held)
