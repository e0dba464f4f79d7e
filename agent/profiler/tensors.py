"""Small helpers over nested tensors and storages: find the tensors in outputs, size their storages."""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import torch


def iter_tensors(value: Any, _depth: int = 0) -> Iterator[torch.Tensor]:
    """Every tensor inside `value` (tensors, tuples, lists, dicts and Hugging Face ModelOutputs)."""
    if _depth > 8:
        return
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, Mapping):
        for v in value.values():
            yield from iter_tensors(v, _depth + 1)
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from iter_tensors(v, _depth + 1)


def storage_key(t: torch.Tensor) -> tuple[str, int]:
    """Identity of a tensor's storage while it is alive: (device, data pointer)."""
    return (str(t.device), t.untyped_storage().data_ptr())


def storage_bytes(t: torch.Tensor) -> int:
    return int(t.untyped_storage().nbytes())


def unique_storage_bytes(
    tensors: Iterator[torch.Tensor] | list[torch.Tensor], exclude: set[tuple[str, int]]
) -> int:
    """Sum of the storage sizes of `tensors`, each storage counted once, skipping keys in `exclude`."""
    seen: set[tuple[str, int]] = set()
    total = 0
    for t in tensors:
        if t.is_meta or t.layout != torch.strided:
            continue
        key = storage_key(t)
        if key in seen or key in exclude:
            continue
        seen.add(key)
        total += storage_bytes(t)
    return total


class LiveStorageKeys:
    """The keys (`storage_key`) of storages seen and still alive: a storage's key leaves when it is freed.
    Allocators hand a freed block's address to the next request of its size at once (CPU malloc, the CUDA
    caching allocator), so a key kept after its storage died made a later tensor at that address look
    already counted (a block's input of 0 bytes). The what-if's fake run keeps a twin
    (`planner_service.whatif.fake_iteration._LiveKeys`: the service may not import the agent)."""

    def __init__(self) -> None:
        self.keys: set[tuple[str, int]] = set()
        self._finalizers: list[weakref.finalize] = []

    def add(self, t: torch.Tensor) -> None:
        key = storage_key(t)
        if key not in self.keys:
            self.keys.add(key)
            self._finalizers.append(weakref.finalize(t.untyped_storage(), self.keys.discard, key))

    def __contains__(self, key: object) -> bool:
        return key in self.keys

    def clear(self) -> None:
        for f in self._finalizers:
            f.detach()
        self._finalizers.clear()
        self.keys.clear()
