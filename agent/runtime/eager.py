"""Hooks that stay eager under torch.compile.

The runtime's hooks (module forward pre/post hooks, tensor gradient hooks, post-accumulate-grad hooks,
saved-tensor pack/unpack hooks, which autograd calls from ops run eagerly inside a frame being compiled)
move parameters between device buffers and the host: they rebind `param.data`, push saved-tensor hooks,
wait on streams and keep Python bookkeeping. None of that may be traced into a compiled graph (inductor
rejects `set_` on a graph input; dynamo would guard on the bookkeeping and recompile every call). Every
hook callable the runtime registers goes through `eager`: dynamo then graph-breaks around the call and
runs it as plain Python, so a parameter is rebound between compiled regions, never inside one, and the
compiled code reads it after its hook made it resident.

What this buys and costs (docs/architecture/wrap.md, "torch.compile"): `block.compile()` for each block
(the FSDP2 habit), `torch.compile(wrapped.model)` and `wrapped.model.compile()` all train as the
uncompiled wrapped model; each module that owns offloaded parameters is a graph break, so a block is
compiled in pieces between its parameter-owning modules.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

F = TypeVar("F", bound=Callable[..., object])

# what dynamo prints for the graph break (and, with fullgraph=True, in the error it raises)
REASON = (
    "memplan's runtime hook: it moves parameters between the host and the device buffers and runs "
    "eagerly, a graph break; compile a wrapped model or its blocks without fullgraph=True"
)


def eager(hook: F) -> F:
    """`hook`, never traced by torch.compile: dynamo graph-breaks around it and runs it eagerly.

    `recursive=True`: whatever the hook calls runs eagerly as well (uploads, `param.data` rebinding)."""
    return torch.compiler.disable(hook, recursive=True, reason=REASON)


def eager_frame(wrapper: F) -> F:
    """`wrapper` itself runs eagerly under torch.compile, but what it calls is compiled as its own frame.

    For the activation modes' replacement `forward` of a block (swap, checkpoint): the mode's scaffolding
    (saved-tensor hooks, `torch.utils.checkpoint`) runs as plain Python, and the block's original forward,
    which it calls, is still compiled when the user compiled the block or the model."""
    return torch.compiler.disable(wrapper, recursive=False, reason=REASON)
