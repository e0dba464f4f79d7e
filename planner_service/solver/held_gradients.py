"""Gradients autograd holds across blocks' backward: a tied parameter's gradient from its later use.

A parameter used by two blocks (GPT-2's `lm_head` shares `transformer.wte.weight`) has one gradient
accumulator; autograd keeps the gradient of the later use (produced in that block's backward) until the
earlier use's backward has added its part, so from the backward of the block after the first use down to
the first use's block that gradient is live on the device beside everything the block's own backward holds.
The profiler measures a block's backward transient above the bytes live when its backward starts, so the
held gradient is in no block's transient; `held_gradient_bytes` gives it per block and the instance adds it
to the backward peaks (`PolicyInstance.bwd_peak_bytes`).

Which blocks use a parameter: `ParameterInfo.use_blocks`, recorded by the profiler from the modules it hooks
(every block whose forward called a module holding it, under any name). A trace without it (made before the
field existed, or by a producer that does not fill it) falls back to the aliases' module paths looked up in
the block names (`block_of_module`); a grouped block's name may be cut to the name limit, and a path it no
longer lists maps to the last block, which counts the gradient in more blocks, never fewer.
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


def last_use(blocks: list[BlockInfo], param: ParameterInfo) -> int:
    """The last block whose forward uses `param`: its recorded `use_blocks`, else (an older trace) the block
    of its aliases' modules, else its own block."""
    if param.use_blocks:
        return param.use_blocks[-1]
    if param.aliases:
        return max(param.block, *(block_of_module(blocks, module_of(alias)) for alias in param.aliases))
    return param.block


def held_gradient_bytes(blocks: list[BlockInfo], parameters: list[ParameterInfo]) -> tuple[int, ...]:
    """Per block: bytes of tied or shared parameters' gradients held by autograd during the block's backward.

    A trainable parameter first used by block `p` and again by a later block `q` (through an alias, or the
    same module called again) holds a gradient of its own bytes from `q`'s backward until `p`'s backward
    ends: blocks `p..q-1` (block `q` produces it inside its own measured transient)."""
    held = [0] * len(blocks)
    for param in parameters:
        if not param.trainable:
            continue
        for b in range(param.block, last_use(blocks, param)):
            held[b] += param.bytes
    return tuple(held)
