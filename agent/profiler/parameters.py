"""Parameters in execution order, mapped to blocks; the model's architecture fingerprint.

The order is first use during a real forward (module forward pre-hooks, see `hooks.py`): a parameter
belongs to the block running when its owning module is first called. A tied parameter (GPT-2's `lm_head`
shares `transformer.wte.weight`) appears once, under the name `named_parameters()` gives it, with its
other names in `aliases`; it is placed where it is first used. Parameters no module call reaches in the forward
are mapped to the block that owns them by module path (outside every repeated block: the epilogue) and
listed at the end of that block's parameters, in registration order.

`use_blocks`: every block whose forward called a module holding the parameter (GPT-2's `wte.weight`: the
prologue through `transformer.wte` and the epilogue through `lm_head`), kept for a tied parameter and for one
used by more than one block; the planner counts the gradient autograd holds between the first and the last
use (`planner_service/solver/held_gradients.py`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass

from torch import nn

from agent.profiler.block_detection import RepeatedBlocks
from client.contract import ParameterInfo


@dataclass(frozen=True)
class OrderedParameter:
    param: nn.Parameter
    name: str
    module_path: str
    block: int
    aliases: tuple[str, ...]
    # blocks whose forward called a module holding it, ascending (first: `block`); empty unless it is tied
    # or used by more than one block
    use_blocks: tuple[int, ...] = ()


def dtype_name(dtype: object) -> str:
    return str(dtype).removeprefix("torch.")


def order_parameters(
    model: nn.Module,
    repeated: RepeatedBlocks,
    first_use: Sequence[tuple[nn.Parameter, str, int]],
    uses: Mapping[int, Set[int]] | None = None,
) -> list[OrderedParameter]:
    """All distinct parameters of `model` in execution order with their block (contract indices). `uses`:
    id(parameter) -> the blocks whose forward called a module holding it (`BlockHooks.param_uses`)."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    canonical = {id(p): name for name, p in model.named_parameters()}
    epilogue = len(repeated) + 1

    def block_of_path(path: str, used_block: int | None) -> int:
        if used_block is not None:
            return used_block  # the block that was running at first use
        inside = repeated.index_of_path(path)
        return inside + 1 if inside is not None else epilogue

    def use_blocks(p: nn.Parameter, aliases: tuple[str, ...]) -> tuple[int, ...]:
        used = sorted((uses or {}).get(id(p), ()))
        return tuple(used) if aliases or len(used) > 1 else ()

    out: list[OrderedParameter] = []
    seen: set[int] = set()
    for p, path, block in first_use:
        if id(p) in seen or id(p) not in canonical:
            continue
        seen.add(id(p))
        name = canonical[id(p)]
        aliases = tuple(n for n in names[id(p)] if n != name)
        out.append(
            OrderedParameter(p, name, path, block_of_path(path, block), aliases, use_blocks(p, aliases))
        )
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        path = name.rsplit(".", 1)[0] if "." in name else ""
        out.append(
            OrderedParameter(
                p, name, path, block_of_path(path, None), tuple(n for n in names[id(p)] if n != name)
            )
        )
    # A parameter that no module call reaches (read as a tensor by its block's code: Jamba's Mamba mixer
    # passes `conv1d.weight` and `dt_proj` to a kernel function) was appended above after the epilogue;
    # the stable sort moves it to the end of its block's run, keeping every block contiguous as the
    # contract asks. Already-ordered lists are unchanged (first use never goes back to an earlier block).
    out.sort(key=lambda o: o.block)
    return out


def parameter_infos(
    ordered: Sequence[OrderedParameter], held: Set[int] | None = None, outside: Set[int] = frozenset()
) -> list[ParameterInfo]:
    """The trace's parameter rows. `held`: ids of the parameters the job's optimizer holds (None: every
    parameter that requires a gradient is stepped); a parameter trains when it requires a gradient and the
    optimizer holds it, else it is frozen (no gradient, no optimizer state: the planner counts neither).
    `outside`: ids of the parameters an op used outside their owning module's forward (`outside_use.py`)."""
    return [
        ParameterInfo(
            name=o.name,
            block=o.block,
            shape=list(o.param.shape),
            dtype=dtype_name(o.param.dtype),
            numel=o.param.numel(),
            bytes=o.param.numel() * o.param.element_size(),
            aliases=list(o.aliases),
            use_blocks=list(o.use_blocks),
            trainable=o.param.requires_grad and (held is None or id(o.param) in held),
            used_outside_owner=id(o.param) in outside,
        )
        for o in ordered
    ]


def fingerprint(model: nn.Module) -> str:
    """SHA-256 of the architecture class and every parameter's name, shape and dtype (stable across machines)."""
    h = hashlib.sha256()
    cls = type(model)
    h.update(f"{cls.__module__}.{cls.__qualname__}\n".encode())
    for name, p in model.named_parameters():
        h.update(f"{name}:{tuple(p.shape)}:{dtype_name(p.dtype)}\n".encode())
    return h.hexdigest()
