"""The optimizer given to `wrap`, an alias of the wrapped one until `unwrap`.

Code often keeps the optimizer object it built: a learning-rate scheduler made before `wrap`
(`get_linear_schedule_with_warmup(optimizer, ...)`, then `agent.wrap(model, optimizer)`), `accelerator.prepare`
called on it first, a loop that goes on calling `optimizer.step()` by the name it had. Before session 23 such a
scheduler drove nothing (the wrapped optimizer's `param_groups` were copies: the learning rate stayed at its
first value, silently), and the original's `step()` stepped the parameters with a second, plain optimizer state.

Now the wrapped optimizer's `param_groups` are the original's own list (`ChunkedOptimizer`), and `OptimizerAlias`
points the original's `step`, `zero_grad`, `state_dict`, `load_state_dict`, `add_param_group` and `state` at the
wrapped optimizer, and turns off its fused kernel's claim to do a GradScaler's inf check in its own step (instance
attributes, so its class and every other instance stay untouched); `remove` puts back what the instance had (a
scheduler's step wrapper included), and `unwrap` then loads the trained state into it.

The alias's `step` runs the step hooks registered on the original (`register_step_pre_hook`/`_post_hook`, before
or after `wrap`) around the wrapped step. Copying or pickling the original while it is an alias raises
`AliasedOptimizerCopyError` naming `state_dict()` (its state lives in the runtime); after `unwrap` it copies as any
optimizer.

The alias's `step` carries torch's scheduler marker (`_wrapped_by_lr_sched`), and the wrapped step sets the
original's `_opt_called` (`ChunkedOptimizer.step`), as the wrapper a scheduler puts on `optimizer.step` does: a
scheduler built on the original, before or after `wrap`, neither warns that its step ran first nor that the
optimizer's step was replaced.
"""

from __future__ import annotations

from typing import Any

import torch

# `_step_supports_amp_scaling`: a fused optimizer says it reads a GradScaler's inf flag in its own step, so the
# scaler hands the step to it instead of skipping it on inf; the alias's step (the runtime's) does not read it,
# so while installed the original says False and the scaler skips as it does for the wrapped optimizer
ALIASED = (
    "step",
    "zero_grad",
    "state_dict",
    "load_state_dict",
    "add_param_group",
    "state",
    "_step_supports_amp_scaling",
    "__deepcopy__",
    "__reduce_ex__",
)


class AliasedOptimizerCopyError(RuntimeError):
    """`copy.deepcopy`, `pickle` or `torch.save` of the optimizer given to `wrap` while it is an alias."""


def _refuse_copy(*_: object) -> Any:
    raise AliasedOptimizerCopyError(
        "optimizer: the optimizer given to agent.wrap is an alias of wrapped.optimizer until agent.unwrap (its "
        "state lives in the runtime's chunks), so it cannot be copied or pickled; save optimizer.state_dict() (the "
        "plain-PyTorch format) instead, or unwrap first"
    )


class OptimizerAlias:
    """While installed, `user` does what `wrapped` does (see the module docstring)."""

    def __init__(self, user: torch.optim.Optimizer, wrapped: torch.optim.Optimizer) -> None:
        self.user = user
        # what the instance itself held (a scheduler's step wrapper, torch's `state`), put back by `remove`
        self._saved = {name: user.__dict__[name] for name in ALIASED if name in user.__dict__}

        def step(*args: Any, **kwargs: Any) -> Any:
            """The wrapped optimizer's step, inside the hooks registered on this optimizer (`register_step_pre_hook`,
            `register_step_post_hook`; torch's global ones and the wrapped optimizer's own run in its step)."""
            for pre in list(user._optimizer_step_pre_hooks.values()):
                changed = pre(user, args, kwargs)
                if changed is not None:
                    args, kwargs = changed
            out = wrapped.step(*args, **kwargs)
            for post in list(user._optimizer_step_post_hooks.values()):
                post(user, args, kwargs)
            return out

        step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
        aliases: dict[str, Any] = {
            "step": step,
            "zero_grad": wrapped.zero_grad,
            "state_dict": wrapped.state_dict,
            "load_state_dict": wrapped.load_state_dict,
            "add_param_group": wrapped.add_param_group,
            "state": wrapped.state,
            "_step_supports_amp_scaling": False,
            "__deepcopy__": _refuse_copy,
            "__reduce_ex__": _refuse_copy,
        }
        user.__dict__.update(aliases)
        self.installed = True

    def remove(self) -> None:
        """The original optimizer's own methods and state again (idempotent)."""
        if not self.installed:
            return
        for name in ALIASED:
            self.user.__dict__.pop(name, None)
        self.user.__dict__.update(self._saved)
        self.installed = False
