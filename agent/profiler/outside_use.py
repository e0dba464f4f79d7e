"""Parameters used outside the forward of the module that owns them (`ParameterInfo.used_outside_owner`).

A device-sharded persistent chunk (`agent/runtime/device_shards.py`) is gathered by the forward pre-hook of a
module owning its parameters and released after; a parameter that an op uses while none of its owning modules
is in its forward (a parent's `hidden @ self.embed.weight.T`, a mixer passing `conv1d.weight` to a kernel)
would read the released placeholder (NaN). While `OutsideUse` is open (the profiler's warm-up iteration),
forward pre/post hooks on every module keep count of the parameters owned by the modules now in their forward,
and a `TorchFunctionMode` checks every op run while the root module is in its forward: a parameter among its
arguments that no module in forward owns is recorded, when the op returns a tensor (metadata reads such as
`.dtype`, `.shape` or `.numel()` gather nothing: not recorded). Ops outside the root's forward (backward, the
optimizer step, the loss) are not checked. Ops another thread runs (CUDA's backward recompute) are not seen.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

from agent.profiler.tensors import iter_tensors


class OutsideUse(TorchFunctionMode):
    """Context manager: `outside` holds the ids of `model`'s parameters used outside their owners' forward."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.params = {id(p) for p in model.parameters()}
        self.outside: set[int] = set()
        self._owned: Counter[int] = Counter()  # parameter id -> modules owning it now in their forward
        self._root_depth = 0
        self._handles: list[RemovableHandle] = []

    def __enter__(self) -> OutsideUse:
        for module in self.model.modules():
            own = [id(p) for p in module.parameters(recurse=False)]
            if own or module is self.model:
                self._handles.append(module.register_forward_pre_hook(self._enter(module, own)))
                self._handles.append(module.register_forward_hook(self._leave(module, own)))
        super().__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _enter(self, module: nn.Module, own: list[int]) -> Callable[..., None]:
        def hook(mod: nn.Module, args: Any) -> None:
            self._root_depth += module is self.model
            self._owned.update(own)

        return hook

    def _leave(self, module: nn.Module, own: list[int]) -> Callable[..., None]:
        def hook(mod: nn.Module, args: Any, output: Any) -> None:
            self._root_depth -= module is self.model
            self._owned.subtract(own)

        return hook

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self._root_depth > 0 and any(True for _ in iter_tensors(out)):
            for t in iter_tensors((args, kwargs)):
                if id(t) in self.params and self._owned[id(t)] <= 0:
                    self.outside.add(id(t))
        return out
