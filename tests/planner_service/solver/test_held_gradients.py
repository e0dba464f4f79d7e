"""Tied parameters' gradients held by autograd between their uses, per block (`held_gradients.py`)."""

from __future__ import annotations

from client.contract import BlockInfo, BlockKind, ParameterInfo
from planner_service.solver.held_gradients import block_of_module, held_gradient_bytes


def _block(index: int, name: str, kind: BlockKind) -> BlockInfo:
    return BlockInfo(index=index, name=name, kind=kind, module_class="M", parameter_bytes=0)


def _param(
    name: str,
    block: int,
    numel: int,
    aliases: list[str],
    trainable: bool = True,
    use_blocks: list[int] | None = None,
) -> ParameterInfo:
    return ParameterInfo(
        name=name,
        block=block,
        shape=[numel],
        dtype="float32",
        numel=numel,
        bytes=4 * numel,
        aliases=aliases,
        trainable=trainable,
        use_blocks=use_blocks or [],
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


def test_recorded_use_blocks_decide_over_a_cut_grouped_name() -> None:
    """The defect: a grouped block's name is cut to the name limit, so a tied module run by the prologue but
    past the cut maps to the last block and its gradient counted through every block; the profiler's
    recorded uses (`ParameterInfo.use_blocks`) say the prologue alone runs both names: nothing is held."""
    cut = [
        _block(0, "prologue[" + ",".join(f"stem.m{i}" for i in range(80))[:499] + "...]", BlockKind.prologue)
    ]
    blocks = cut + BLOCKS[1:]
    assert len(blocks[0].name) == 512
    old = _param("stem.m0.weight", 0, 1000, ["stem.m79.weight"])
    assert held_gradient_bytes(blocks, [old]) == (4000, 4000, 4000, 0)  # the fallback: counts more
    assert held_gradient_bytes(
        blocks, [_param("stem.m0.weight", 0, 1000, ["stem.m79.weight"], use_blocks=[0])]
    ) == (
        0,
        0,
        0,
        0,
    )


def test_a_parameter_whose_one_module_runs_in_two_blocks_holds_its_gradient_without_aliases() -> None:
    """A module called again by a later block (no second name: no alias) holds its gradient the same way."""
    shared = _param("transformer.wpe.weight", 0, 100, [], use_blocks=[0, 2])
    assert held_gradient_bytes(BLOCKS, [shared]) == (400, 400, 0, 0)
    assert held_gradient_bytes(BLOCKS, [shared.model_copy(update={"use_blocks": []})]) == (0, 0, 0, 0)


def test_recorded_uses_of_a_tied_head_give_what_the_module_paths_gave() -> None:
    params = [_param("transformer.wte.weight", 0, 1000, ["lm_head.weight"], use_blocks=[0, 3])]
    assert held_gradient_bytes(BLOCKS, params) == (4000, 4000, 4000, 0)
