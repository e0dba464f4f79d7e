"""Training never needs a KV cache: turn it off for profiling, probing and training, and give it back.

Hugging Face models come with `use_cache=True` (config and generation config). In training that makes
every forward build a cache object; re-running a block on its captured inputs (the profiler's recompute
and runtime probes, activation checkpointing) then appends to that cache and fails, or keeps a graph
alive across backward passes. `KVCacheOff` sets `use_cache=False` on every config the model holds (the
model's and its submodules' `config`, their sub-configs such as `text_config`, and `generation_config`)
and `restore()` puts back exactly the values it found. Models without a config are left alone.
"""

from __future__ import annotations

from types import TracebackType
from typing import Any

from torch import nn

_SUB_CONFIGS = ("text_config", "decoder", "language_config", "llm_config")


def _configs(model: nn.Module) -> list[Any]:
    """Every distinct config object (with a `use_cache` attribute) reachable from the model's modules."""
    found: dict[int, Any] = {}
    stack: list[Any] = []
    for module in model.modules():
        stack.extend(getattr(module, name, None) for name in ("config", "generation_config"))
    while stack:
        cfg = stack.pop()
        if cfg is None or id(cfg) in found or isinstance(cfg, (str, int, float, bool, dict, list)):
            continue
        if hasattr(cfg, "use_cache"):
            found[id(cfg)] = cfg
        stack.extend(getattr(cfg, name, None) for name in _SUB_CONFIGS)
    return list(found.values())


class KVCacheOff:
    """`use_cache=False` on the model's configs until `restore()` (also a context manager)."""

    def __init__(self, model: nn.Module) -> None:
        self._saved: list[tuple[Any, Any]] = []
        for cfg in _configs(model):
            self._saved.append((cfg, cfg.use_cache))
            cfg.use_cache = False

    def restore(self) -> None:
        """Put back every `use_cache` value found at construction (idempotent)."""
        for cfg, value in reversed(self._saved):
            cfg.use_cache = value
        self._saved = []

    def __enter__(self) -> KVCacheOff:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.restore()
