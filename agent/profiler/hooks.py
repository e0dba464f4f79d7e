"""Module and tensor hooks that follow one iteration block by block; always removed on exit.

`BlockHooks` is a context manager. While it is open:
- forward pre/post hooks on each repeated block move the `BlockTracker` (prologue -> block i -> epilogue);
- gradient hooks on each block's output tensors mark the start of its backward, and on its input tensors
  the end, so backward time and memory are attributed block by block;
- optionally (`first_use=True`) forward pre-hooks on every module record the order in which parameters
  are first used, and the block active at that moment, and every block that calls a module holding each
  parameter (`param_uses`: a tied parameter's uses under all its names);
- optionally (`saved_tensors=True`) `torch.autograd.graph.saved_tensors_hooks` count the bytes each block
  saves for backward, and the forward pre-hooks count each block's input bytes. A storage counts once per
  iteration, in the first block that saves it (or takes it as input): tensors every block uses, such as
  rotary cos/sin or the attention mask, land in the first block, so sums over blocks are exact.
On exit (normal or exception) every handle is removed and the saved-tensor hooks are popped, so the model
is left exactly as it was; `tests/agent/profiler` checks that no hook survives.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from agent.profiler.block_detection import RepeatedBlocks
from agent.profiler.block_marks import BlockTracker
from agent.profiler.tensors import (
    LiveStorageKeys,
    iter_tensors,
    storage_bytes,
    storage_key,
    unique_storage_bytes,
)
from client.contract import Phase


class BlockHooks:
    """Hooks on `model` that drive `block_tracker` through the blocks of one iteration."""

    def __init__(
        self,
        model: nn.Module,
        repeated: RepeatedBlocks,
        block_tracker: BlockTracker,
        *,
        first_use: bool = False,
        saved_tensors: bool = False,
        excluded_storages: set[tuple[str, int]] | None = None,
        on_saved: Callable[[torch.Tensor], None] | None = None,
    ) -> None:
        self.model = model
        self.repeated = repeated
        self.block_tracker = block_tracker
        self.n_blocks = len(repeated) + 2  # prologue + repeated + epilogue
        self._first_use = first_use
        self._saved_tensors = saved_tensors
        self._excluded = excluded_storages if excluded_storages is not None else set()
        self._on_saved = on_saved
        self._handles: list[RemovableHandle] = []
        self._stack = ExitStack()
        # results
        self.param_order: list[
            tuple[nn.Parameter, str, int]
        ] = []  # (parameter, module path, block at first use)
        self.param_uses: dict[
            int, set[int]
        ] = {}  # id(parameter) -> blocks whose forward called a module holding it
        self.activation_bytes = [0] * self.n_blocks
        self.input_bytes = [0] * self.n_blocks
        self.block_inputs: dict[int, tuple[tuple[Any, ...], dict[str, Any]]] = {}
        self.keep_inputs = False
        self._seen_params: set[int] = set()
        self._saved_keys = LiveStorageKeys()
        self._input_keys = LiveStorageKeys()
        self._bwd_started: set[int] = set()

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> BlockHooks:
        try:
            self._install()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._stack.close()
        self.block_inputs.clear()
        self._saved_keys.clear()
        self._input_keys.clear()

    def new_iteration(self) -> None:
        """Forget the per-iteration state (backward marks, saved storages) before another iteration."""
        self._bwd_started.clear()
        self._saved_keys.clear()
        self._input_keys.clear()
        self.activation_bytes = [0] * self.n_blocks
        self.input_bytes = [0] * self.n_blocks

    def _install(self) -> None:
        for i, block in enumerate(self.repeated.modules):
            idx = i + 1
            self._handles.append(block.register_forward_pre_hook(self._pre_hook(idx), with_kwargs=True))
            self._handles.append(block.register_forward_hook(self._post_hook(idx), with_kwargs=True))
        if self._first_use:
            for path, module in self.model.named_modules():
                if any(True for _ in module.parameters(recurse=False)):
                    self._handles.append(module.register_forward_pre_hook(self._use_hook(path, module)))
        if self._saved_tensors:
            self._stack.enter_context(torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack))

    # ------------------------------------------------------------------ forward
    def _pre_hook(self, idx: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            self.block_tracker.move(idx, Phase.forward)
            if self._saved_tensors:
                # Inputs shared by every block (attention mask, rotary cos/sin) count once, in the first block.
                tensors = list(iter_tensors((args, kwargs)))
                self.input_bytes[idx] = unique_storage_bytes(tensors, self._excluded | self._input_keys.keys)
                for t in tensors:
                    if t.layout == torch.strided:
                        self._input_keys.add(t)
            if self.keep_inputs:
                self.block_inputs[idx] = (
                    tuple(_detached(a) for a in args),
                    {k: _detached(v) for k, v in kwargs.items()},
                )
            if torch.is_grad_enabled():
                for t in iter_tensors((args, kwargs)):
                    if t.requires_grad:
                        self._handles.append(t.register_hook(self._input_grad_hook(idx)))

        return hook

    def _post_hook(self, idx: int) -> Callable[..., None]:
        last = len(self.repeated)

        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
            if idx == last:
                self.block_tracker.move(idx + 1, Phase.forward)  # the epilogue runs from here on
                if self._saved_tensors:  # the epilogue's input is the last block's output
                    self.input_bytes[idx + 1] = unique_storage_bytes(
                        list(iter_tensors(output)), self._excluded
                    )
            if torch.is_grad_enabled():
                for t in iter_tensors(output):
                    if t.requires_grad:
                        self._handles.append(t.register_hook(self._output_grad_hook(idx)))

        return hook

    def _use_hook(self, path: str, module: nn.Module) -> Callable[..., None]:
        def hook(mod: nn.Module, args: Any) -> None:
            block = self.block_tracker.block if self.block_tracker.block is not None else 0
            for p in module.parameters(recurse=False):
                self.param_uses.setdefault(id(p), set()).add(block)
                if id(p) not in self._seen_params:
                    self._seen_params.add(id(p))
                    self.param_order.append((p, path, block))

        return hook

    # ------------------------------------------------------------------ backward
    def _output_grad_hook(self, idx: int) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            if idx not in self._bwd_started:
                self._bwd_started.add(idx)
                self.block_tracker.move(idx, Phase.backward)

        return hook

    def _input_grad_hook(self, idx: int) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            # Only the end of this block's own backward counts: a shared input (e.g. position embeddings
            # that require grad) gets its gradient later, when other blocks are running.
            if self.block_tracker.block == idx and self.block_tracker.phase == Phase.backward:
                self.block_tracker.move(idx - 1, Phase.backward)

        return hook

    # ------------------------------------------------------------------ saved tensors
    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        block = self.block_tracker.block
        if (
            block is None
            or self.block_tracker.phase != Phase.forward
            or t.is_meta
            or t.layout != torch.strided
        ):
            return t
        key = storage_key(t)
        if key not in self._excluded and key not in self._saved_keys:
            self._saved_keys.add(t)
            self.activation_bytes[block] += storage_bytes(t)
            if self._on_saved is not None:
                self._on_saved(t)
        return t


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


def _detached(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        # Like torch.utils.checkpoint: a detached input that still requires grad when the original did.
        return value.detach().requires_grad_(value.requires_grad)
    if isinstance(value, tuple):
        return tuple(_detached(v) for v in value)
    if isinstance(value, list):
        return [_detached(v) for v in value]
    return value
