"""A Hugging Face config -> the model built on fake tensors (no weights, no memory), and its repeated blocks.

`load_config` reads a `config.json` (a file or a directory holding one); `config_from_flags` builds one from
a family (`model_type`) and sizes. `fake_model` builds `AutoModelForCausalLM.from_config(config)` inside a
`FakeTensorMode`: the module tree, parameter names, shapes and dtypes are the library's, with the library's
defaults (attention implementation, use_cache, tied embeddings), and no parameter holds data. A 7B model is
built in about a second.

Why fake tensors and not the `meta` device: both allocate nothing, but a meta tensor's device is `meta`,
and PyTorch then picks other kernels than on a real device (SDPA falls back to its math path, which saves
b*h*s^2 attention weights for backward where a real device's fused kernel saves b*h*s log-sum-exps), so
memory would be modelled for a run nobody does. A fake tensor says it is on `cpu` and gets the CPU's
kernel choices: the same as the profiler's runs on this machine (and for attention, the same saved tensors
as a GPU's fused kernels).

`repeated_blocks` is the profiler's block detection (agent/profiler/block_detection.py), reimplemented because the
planner service must not import the agent: the children of the longest `nn.ModuleList` whose children all
have one class. tests/planner_service/whatif check that both find the same blocks on the same models.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers import PretrainedConfig

DTYPES = ("fp32", "bf16", "fp16")


class ArchitectureError(ValueError):
    """The config cannot be read or built, or the model has no repeated blocks."""


def torch_dtype(name: str) -> torch.dtype:
    # local import: torch loads when a model is built, not with `memplan whatif`'s module (`memplan --help`)
    import torch

    table = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    if name not in table:
        raise ArchitectureError(f"dtype: {name!r} is not one of {', '.join(DTYPES)}")
    return table[name]


def load_config(path: str | Path) -> PretrainedConfig:
    """The config in `path` (a config.json, or a directory holding one); `model_type` picks the class."""

    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    try:
        data = json.loads(p.read_text())
    except OSError as exc:
        raise ArchitectureError(f"config {p}: cannot read ({exc.strerror or exc})") from None
    except json.JSONDecodeError as exc:
        raise ArchitectureError(f"config {p}: not JSON ({exc.msg} at line {exc.lineno})") from None
    return config_from_dict(data, f"config {p}")


def config_from_dict(data: object, where: str = "config") -> PretrainedConfig:
    """The config of a config.json object (`model_type` picks the class); errors start with `where`."""
    # local import: transformers is optional (the `models` extra)
    import transformers

    if not isinstance(data, dict):
        raise ArchitectureError(f"{where}: must be a JSON object")
    data = dict(data)
    model_type = data.pop("model_type", None)
    if not isinstance(model_type, str):
        raise ArchitectureError(f'{where}: model_type: missing (e.g. "llama")')
    try:
        return transformers.AutoConfig.for_model(model_type, **data)
    except Exception as exc:  # noqa: BLE001 - a config class validates as it likes: huggingface_hub's strict
        # dataclass errors, ZeroDivisionError for 0 heads (session 19 probe: a 500); each is the config's fault
        raise ArchitectureError(f"{where}: model_type {model_type!r}: {type(exc).__name__}: {exc}") from None


def config_from_flags(
    family: str,
    *,
    layers: int,
    hidden: int,
    heads: int | None = None,
    kv_heads: int | None = None,
    intermediate: int | None = None,
    vocab: int = 32000,
    max_positions: int = 4096,
) -> PretrainedConfig:
    """A config of `family` (a Hugging Face `model_type`) with these sizes; everything else the library's."""
    # local import: transformers is optional (the `models` extra)
    import transformers

    for name, value in (
        ("layers", layers),
        ("hidden", hidden),
        ("vocab", vocab),
        ("max_positions", max_positions),
    ):
        if value < 1:
            raise ArchitectureError(f"{name}: must be at least 1, got {value}")
    n_heads = heads if heads is not None else max(1, hidden // 128)
    if hidden % n_heads:
        raise ArchitectureError(f"heads: {n_heads} does not divide hidden={hidden}")
    kwargs: dict[str, Any] = {
        "num_hidden_layers": layers,
        "hidden_size": hidden,
        "num_attention_heads": n_heads,
        "vocab_size": vocab,
        "max_position_embeddings": max_positions,
    }
    if kv_heads is not None:
        kwargs["num_key_value_heads"] = kv_heads
    if intermediate is not None:
        kwargs["intermediate_size"] = intermediate
    try:
        return transformers.AutoConfig.for_model(family, **kwargs)
    except (ValueError, TypeError, KeyError) as exc:
        raise ArchitectureError(f"family: {family!r}: {exc}") from None


FAKE_RUNS = threading.RLock()
"""Held while a fake model is built (`fake_model`) and while its iteration runs (`modelled_trace`): the
library's default-dtype switch while it builds is process-wide, and ops that take the default dtype read it."""


def fake_model(config: PretrainedConfig, dtype: str = "fp32") -> tuple[nn.Module, FakeTensorMode]:
    """`AutoModelForCausalLM.from_config(config)` on fake tensors, in `dtype`, in training mode."""
    # local import: transformers is optional (the `models` extra); torch loads when a model is built
    import transformers
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=False)
    try:
        # one build at a time (`FAKE_RUNS`): `from_config(dtype=)` sets torch's process-wide default dtype while
        # it builds and puts it back after, so a build in another thread (two what-if requests or sweeps at
        # once) made some of this model's tensors in the other's dtype (session 20: 642 of 1,280 parameters in
        # 16 concurrent builds; two identical sweeps at once got two traces of one point)
        with FAKE_RUNS, mode:
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch_dtype(dtype))
    except ArchitectureError:
        raise
    except Exception as exc:
        raise ArchitectureError(
            f"config: {type(config).__name__} cannot be built as a causal LM: {exc}"
        ) from None
    model.train()
    # training never uses the KV cache: memplan trains with it off (agent/kv_cache.py), so the modelled
    # iteration does too (with it on, some families keep cache tensors alive: gpt_neox +14% block activations)
    for module in model.modules():
        cfg = getattr(module, "config", None)
        if cfg is not None and hasattr(cfg, "use_cache"):
            cfg.use_cache = False
    generation = getattr(model, "generation_config", None)
    if generation is not None and hasattr(generation, "use_cache"):
        generation.use_cache = False
    return model, mode


@dataclass(frozen=True)
class RepeatedBlocks:
    """The repeated blocks of a model, in execution order, with their module paths."""

    names: tuple[str, ...]
    modules: tuple[nn.Module, ...]
    container_name: str

    def __len__(self) -> int:
        return len(self.modules)

    def index_of_path(self, module_path: str) -> int | None:
        for i, name in enumerate(self.names):
            if module_path == name or module_path.startswith(name + "."):
                return i
        return None


def repeated_blocks(model: nn.Module) -> RepeatedBlocks:
    """The profiler's rule (`agent/profiler/block_detection.py`, which the service cannot import): the longest
    `nn.ModuleList` whose children share one class, unless it is not `config.num_hidden_layers` long and a list
    of that many children is there (a hybrid model's layers, of several classes; of several, the one of most
    parameters)."""
    # local import: torch loads when a model is built, not with `memplan whatif`'s module (`memplan --help`)
    from torch import nn

    layers = num_layers(getattr(model, "config", None))
    best: tuple[str, nn.ModuleList] | None = None
    stacks: list[tuple[int, str, nn.ModuleList]] = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) == 0:
            continue
        if len(module) == layers:
            stacks.append((sum(p.numel() for p in module.parameters()), name, module))
        if len({type(child) for child in module}) != 1:
            continue
        if best is None or len(module) > len(best[1]):
            best = (name, module)
    if stacks and (best is None or len(best[1]) != layers):
        _, name, stack = max(stacks, key=lambda s: s[0])
        best = (name, stack)
    if best is None:
        raise ArchitectureError(f"{type(model).__name__}: found no nn.ModuleList of same-class blocks")
    list_name, modules = best
    prefix = f"{list_name}." if list_name else ""
    return RepeatedBlocks(tuple(f"{prefix}{i}" for i in range(len(modules))), tuple(modules), list_name)


def num_layers(config: object) -> int | None:
    """The layers a config says its model has (`num_hidden_layers`), if it says."""
    n = getattr(config, "num_hidden_layers", None)
    return n if isinstance(n, int) and n > 0 else None


def describe(config: PretrainedConfig) -> str:
    """A short human name: family, layers, width (e.g. 'llama-32L-4096H')."""
    layers = getattr(config, "num_hidden_layers", None)
    hidden = getattr(config, "hidden_size", None)
    return f"{config.model_type}" + (f"-{layers}L" if layers else "") + (f"-{hidden}H" if hidden else "")
