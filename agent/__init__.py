"""memplan agent: runs inside the training job (profile -> plan -> apply -> measure -> report).

`agent.profile(...)` measures a training iteration and returns a wire-contract Trace;
`agent.wrap(...)` applies a plan to a model and optimizer. Submodules load on first use, so importing
`agent` is cheap.
"""

from __future__ import annotations

from typing import Any

__all__ = ["profile", "wrap", "unwrap"]


def __getattr__(name: str) -> Any:
    if name == "profile":
        from agent.profiler import profile

        return profile
    if name in ("wrap", "unwrap"):
        from agent import wrap as _wrap_module

        return getattr(_wrap_module, name)
    raise AttributeError(f"module 'agent' has no attribute {name!r}")
