"""Training never needs a KV cache: turn it off for profiling, probing and training, and give it back.

Hugging Face models come with `use_cache=True` (config and generation config). In training that makes
every forward build a cache object; re-running a block on its captured inputs (the profiler's recompute
and runtime probes, activation checkpointing) then appends to that cache and fails, or keeps a graph
alive across backward passes. `KVCacheOff` sets `use_cache=False` on every config the model holds (the
model's and its submodules' `config`, their sub-configs such as `text_config`, and `generation_config`)
and `restore()` puts back exactly the values it found. Models without a config are left alone.

A checkpoint saved meanwhile keeps the user's values: while any `KVCacheOff` is active, Hugging Face's
`PreTrainedModel.save_pretrained` (what the user, the Trainer's checkpoints and `push_to_hub` call) runs with
every active one's values put back, and turns the cache off again after. Before (session 32), a checkpoint
saved mid-training wrote `use_cache: false` into config.json and generation_config.json, so a model loaded
from it generated without a KV cache. The method is wrapped once per process, on the class (an attribute on
the model object would not pickle with `torch.save(model)`), and only when transformers is already imported
(this module never imports it); it changes nothing while no `KVCacheOff` is active.
"""

from __future__ import annotations

import functools
import sys
import weakref
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
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


_ACTIVE: weakref.WeakSet[KVCacheOff] = weakref.WeakSet()
_SAVING_WRAPPED = "__memplan_kv_cache__"  # marks Hugging Face's save_pretrained once wrapped


class KVCacheOff:
    """`use_cache=False` on the model's configs until `restore()` (also a context manager)."""

    def __init__(self, model: nn.Module) -> None:
        self._saved: list[tuple[Any, Any]] = []
        for cfg in _configs(model):
            self._saved.append((cfg, cfg.use_cache))
            cfg.use_cache = False
        if self._saved:
            _ACTIVE.add(self)
            _wrap_saving()

    def restore(self) -> None:
        """Put back every `use_cache` value found at construction (idempotent)."""
        for cfg, value in reversed(self._saved):
            cfg.use_cache = value
        self._saved = []
        _ACTIVE.discard(self)

    @contextmanager
    def users_values(self) -> Iterator[None]:
        """The values found at construction while inside; the cache off again after."""
        for cfg, value in reversed(self._saved):
            cfg.use_cache = value
        try:
            yield
        finally:
            for cfg, _ in self._saved:
                cfg.use_cache = False

    def __enter__(self) -> KVCacheOff:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.restore()


def _wrap_saving() -> None:
    """Wrap `transformers.PreTrainedModel.save_pretrained` once (see the module docstring); nothing where
    transformers is not imported (a model without Hugging Face configs has nothing to save wrongly)."""
    modeling = sys.modules.get("transformers.modeling_utils")
    cls = getattr(modeling, "PreTrainedModel", None)
    original = getattr(cls, "save_pretrained", None)
    if cls is None or original is None or getattr(original, _SAVING_WRAPPED, False):
        return

    @functools.wraps(original)
    def save_pretrained(self: Any, *args: Any, **kwargs: Any) -> Any:
        with _users_values_while_saving():
            return original(self, *args, **kwargs)

    setattr(save_pretrained, _SAVING_WRAPPED, True)
    cls.save_pretrained = save_pretrained


@contextmanager
def _users_values_while_saving() -> Iterator[None]:
    """Every active `KVCacheOff`'s values put back (a save may be of any model whose configs one holds)."""
    with ExitStack() as stack:
        for off in list(_ACTIVE):
            stack.enter_context(off.users_values())
        yield
