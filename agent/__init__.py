"""memplan agent: runs inside the training job (profile -> plan -> apply -> measure -> report).

`agent.profile(...)` measures a training iteration and returns a wire-contract Trace;
`agent.wrap(...)` applies a plan to a model and optimizer, `agent.unwrap(...)` gives them back;
`agent.plan_with_allocation(...)` saves a plan with its managed allocation and `agent.install_allocator(...)`
installs the planned CUDA allocator from it (first thing in a training script); `agent.checkpoint` saves
and loads sharded checkpoints of a wrapped model.
The functions live in `agent.profiler` and `agent.wrapping` (no submodule shares a name with a function,
so `agent.wrap` is the function whatever was imported before). They load on first use, so importing
`agent` stays cheap (no torch import).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agent.allocator.install import install_allocator, plan_with_allocation
    from agent.profiler import profile
    from agent.runtime import RuntimeOptions
    from agent.wrapping import unwrap, wrap

__all__ = ["profile", "wrap", "unwrap", "install_allocator", "plan_with_allocation", "RuntimeOptions"]

_LAZY = {
    "profile": "agent.profiler",
    "wrap": "agent.wrapping",
    "unwrap": "agent.wrapping",
    "install_allocator": "agent.allocator.install",
    "plan_with_allocation": "agent.allocator.install",
    "RuntimeOptions": "agent.runtime",  # `wrap(..., options=agent.RuntimeOptions(...))`, as the README writes it
}


_SUBMODULES = {"checkpoint"}  # `agent.checkpoint.save_sharded(...)` after a bare `import agent`


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"agent.{name}")  # the import binds it in globals() too
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'agent' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
