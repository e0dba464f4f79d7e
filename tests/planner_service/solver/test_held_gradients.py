"""Tied parameters' gradients held by autograd between their uses, per block (`held_gradients.py`)."""

from __future__ import annotations

from client.contract import BlockInfo, BlockKind, ParameterInfo
from planner_service.solver.held_gradients import block_of_module, held_gradient_bytes


def _block(index: int, name: str, kind: BlockKind) -> BlockInfo:
    return BlockInfo(index=index, name=name, kind=kind, module_class="M", parameter_bytes=0)


def _param(name: str, block: int, numel: int, aliases: list[str], trainable: bool = True) -> ParameterInfo:
    return ParameterInfo(
        name=name,
        block=block,
        shape=[numel],
        dtype="float32",
        numel=numel,
        bytes=4 * numel,
        aliases=aliases,
        trainable=trainable,
    )


BLOCKS = [
    _block(0, "prologue[transformer.wte,transformer.wpe]", BlockKind.prologue),
    _block(1, "transformer.h.0", BlockKind.block),
    _block(2, "transformer.h.1", BlockKind.block),
    _block(3, "epilogue[transformer.ln_f]", BlockKind.epilogue),
]


def test_a_module_maps_to_the_block_running_it_and_one_outside_every_block_to_the_last() -> None:
    assert block_of_module(BLOCKS, "transformer.wpe") == 0
    assert block_of_module(BLOCKS, "transformer.h.1.attn.c_attn") == 2
    assert block_of_module(BLOCKS, "transformer.h.10") == 3  # not transformer.h.1's
    assert block_of_module(BLOCKS, "lm_head") == 3


def test_the_tied_lm_head_gradient_is_held_from_the_block_before_the_head_down_to_the_embedding() -> None:
    params = [
        _param("transformer.wte.weight", 0, 1000, ["lm_head.weight"]),
        _param("transformer.wpe.weight", 0, 10, []),
        _param("transformer.h.0.w", 1, 10, []),
    ]
    assert held_gradient_bytes(BLOCKS, params) == (4000, 4000, 4000, 0)


def test_untied_or_frozen_parameters_hold_nothing() -> None:
    params = [
        _param("transformer.wte.weight", 0, 1000, ["lm_head.weight"], trainable=False),
        _param("transformer.h.0.w", 1, 10, []),
    ]
    assert held_gradient_bytes(BLOCKS, params) == (0, 0, 0, 0)
