"""Block layout of a model: the prologue, the repeated blocks and the epilogue, found by module structure.

Detection rule: the repeated blocks are the children of the longest `nn.ModuleList` (or `nn.Sequential`
of at least two children; a ModuleList wins a tie) whose children all have the same class (`GPT2Block` in
`transformer.h`, `LlamaDecoderLayer` in `model.layers`, or the modules of a plain model's `blocks` list).
When that list is not as long as the model's config says it has layers (`config.num_hidden_layers`, as every
Hugging Face model's), the `nn.ModuleList` of that many children wins, whatever their classes (of several,
the one holding the most parameters). Hybrid models mix layer classes in one list (Jamba's Mamba and
attention layers, OLMo-hybrid's linear and full attention): the same-class rule found no list there and
raised, or (Zamba2) picked two LoRA adapters inside one layer and left every decoder layer to the prologue
(session 20 probe). Every parameter outside those blocks belongs to the prologue
(used before the first block runs) or the epilogue (used after the last block; final norm, head, loss);
which of the two is settled by first use during a real forward (see `parameters.py`).

A module held at several places of the list (`nn.ModuleList([block] * n)`, weights shared across layers) is one
block that runs several times per forward, as ALBERT's one shared layer group is (its place in the list
names it).

Names: a repeated block's name is its module path (`transformer.h.3`), so the runtime can find it with
`model.get_submodule(name)`. The prologue and epilogue are not single modules; they are named
`prologue[<paths>]` and `epilogue[<paths>]`, listing the module paths that own their parameters (for
example `prologue[transformer.wte,transformer.wpe]`, `epilogue[transformer.ln_f]`), truncated to the
contract's name limit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from client.contract.common import MAX_NAME_CHARS


class BlockDetectionError(ValueError):
    """The model has no repeated blocks that the profiler can find by itself."""


@dataclass(frozen=True)
class RepeatedBlocks:
    """The repeated blocks of a model, in execution order, with their module paths."""

    names: tuple[str, ...]
    modules: tuple[nn.Module, ...]
    container_name: str | None  # path of the ModuleList holding them, when they share one

    def __len__(self) -> int:
        return len(self.modules)

    def index_of_path(self, module_path: str) -> int | None:
        """The block that contains the module at `module_path` (itself or a descendant), if any."""
        for i, name in enumerate(self.names):
            if module_path == name or module_path.startswith(name + "."):
                return i
        return None


def detect_blocks(model: nn.Module, blocks: Sequence[nn.Module] | None = None) -> RepeatedBlocks:
    """The repeated blocks of `model`: `blocks` if given (each must be a submodule), else detected."""
    path_of = {id(m): name for name, m in model.named_modules(remove_duplicate=False)}
    if blocks is not None:
        if len(blocks) == 0:
            raise BlockDetectionError(
                "blocks: is empty; pass the model's repeated blocks, e.g. list(model.layers)"
            )
        names: list[str] = []
        for i, b in enumerate(blocks):
            if not isinstance(b, nn.Module):
                raise BlockDetectionError(f"blocks[{i}]: is a {type(b).__name__}, not an nn.Module")
            name = path_of.get(id(b))
            if name is None or name == "":
                raise BlockDetectionError(
                    f"blocks[{i}]: a {type(b).__name__} that is not a submodule of the model (or is the model itself)"
                )
            names.append(name)
        if len(set(names)) != len(names):
            raise BlockDetectionError("blocks: lists the same module twice")
        for i, a in enumerate(names):
            for j, b2 in enumerate(names):
                if i != j and b2.startswith(a + "."):
                    raise BlockDetectionError(
                        f"blocks[{j}]: {b2!r} is inside blocks[{i}] {a!r}; blocks must not nest"
                    )
        parents = {n.rsplit(".", 1)[0] if "." in n else "" for n in names}
        container = parents.pop() if len(parents) == 1 else None
        return RepeatedBlocks(tuple(names), tuple(blocks), container)

    best: tuple[str, nn.ModuleList | nn.Sequential] | None = None
    stacks: list[tuple[int, str, nn.ModuleList]] = []  # ModuleLists of the configured number of layers
    layers = configured_layers(model)
    for name, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)) or len(module) < (
            1 if isinstance(module, nn.ModuleList) else 2
        ):
            continue
        if isinstance(module, nn.ModuleList) and len(module) == layers:
            stacks.append((sum(p.numel() for p in module.parameters()), name, module))
        classes = {type(child) for child in module}
        if len(classes) != 1:
            continue
        # the longest list wins; on a tie an nn.ModuleList (the usual home of transformer blocks)
        if best is None or (len(module), isinstance(module, nn.ModuleList)) > (
            len(best[1]),
            isinstance(best[1], nn.ModuleList),
        ):
            best = (name, module)
    if stacks and (best is None or len(best[1]) != layers):  # a hybrid stack: the configured layers win
        _, name, stack = max(stacks, key=lambda s: s[0])  # (of several, the one of most parameters)
        best = (name, stack)
    if best is None:
        raise BlockDetectionError(
            f"{type(model).__name__}: found no nn.ModuleList or nn.Sequential of same-class blocks. Pass the "
            "repeated blocks explicitly: agent.wrap(model, optimizer, ..., blocks=[...]) or "
            "agent.profile(model, batch, blocks=[...]) with the block modules in execution order "
            "(e.g. blocks=list(model.layers)), or keep them in an nn.ModuleList attribute such as `self.blocks`."
        )
    list_name, module_list = best
    prefix = f"{list_name}." if list_name else ""
    # one module held at several places of the list (`nn.ModuleList([block] * n)`: weights shared across layers)
    # is one block that runs several times, as ALBERT's shared layer group is: its first place names it (the
    # path `named_modules` and `get_submodule` know), the others are the same block again
    first: dict[int, int] = {}
    for i, child in enumerate(module_list):
        first.setdefault(id(child), i)
    places = list(first.values())  # in list order (a dict keeps its insertion order)
    return RepeatedBlocks(
        tuple(f"{prefix}{i}" for i in places), tuple(module_list[i] for i in places), list_name
    )


def configured_layers(model: nn.Module) -> int | None:
    """How many layers the model's config says it has (`config.num_hidden_layers`), if it says."""
    layers = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    return layers if isinstance(layers, int) and not isinstance(layers, bool) and layers > 0 else None


def edge_name(kind: str, module_paths: Sequence[str]) -> str:
    """`prologue[a,b]` / `epilogue[c]`: the descriptive name of a non-module block, within the name limit."""
    inner = ",".join(p if p else "<root>" for p in module_paths) or "-"
    name = f"{kind}[{inner}]"
    if len(name) > MAX_NAME_CHARS:
        name = name[: MAX_NAME_CHARS - 4] + "...]"
    return name
