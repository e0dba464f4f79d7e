"""`agent.wrap`: apply a memory plan to a model and optimizer; `agent.unwrap`: give them back.

    wrapped = agent.wrap(model, optimizer, plan=plan)
    for batch in data:
        loss = wrapped.model(**batch).loss
        loss.backward()
        wrapped.optimizer.step()          # a scheduler built on wrapped.optimizer works as usual
        wrapped.optimizer.zero_grad()
    print(wrapped.report())
    model = agent.unwrap(wrapped)         # ordinary parameters again; the original optimizer gets the state

Only the `plan=` path exists today: profiling and solving inside `wrap` (no plan given) is issue 7.
Activation modes in the plan (keep/checkpoint/swap) are accepted and not yet applied (issue 7).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn

    from agent.runtime.accounting import RuntimeReport
    from agent.runtime.manager import ModelStateManager
    from agent.runtime.optimizer import ChunkedOptimizer
    from agent.runtime.options import RuntimeOptions
    from client.contract import Plan


@dataclass
class Wrapped:
    """What `wrap` returns: the managed model and optimizer, the plan applied, and the runtime."""

    model: nn.Module
    optimizer: ChunkedOptimizer
    plan: Plan
    runtime: ModelStateManager
    original_optimizer: torch.optim.Optimizer = field(repr=False)
    unwrapped: bool = False

    def report(self) -> RuntimeReport:
        """Bytes held on device and host by category, and what moved (uploads, hits, host steps)."""
        self._check()
        impls = {s.impl for s in self.runtime.steppers if s.state.offloaded and s.inner is not None}
        return self.runtime.report(host_optimizer="/".join(sorted(impls)) or "none")

    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        """Clip gradients by their global norm across persistent and offloaded chunks (torch semantics).

        Call after backward, before `optimizer.step()`. With offloaded chunks, wrap with
        `RuntimeOptions(overlap_host_step=False)`: host steps then run at `step()`, after clipping.
        """
        self._check()
        return self.runtime.clip_grad_norm_(
            max_norm, norm_type=norm_type, error_if_nonfinite=error_if_nonfinite
        )

    def synchronize(self) -> None:
        """Wait for host optimizer work in flight (before reading offloaded parameters directly)."""
        self._check()
        self.runtime.synchronize()

    def _check(self) -> None:
        if self.unwrapped:
            raise RuntimeError("this wrapped model was unwrapped; wrap it again to use the runtime")


def wrap(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    sample_batch: Any = None,
    server: str | None = None,
    device_memory: int | None = None,
    host_memory: int | None = None,
    plan: Plan | None = None,
    options: RuntimeOptions | None = None,
) -> Wrapped:
    """Apply `plan` to `model` and `optimizer` (model-state management: chunks, offload, host optimizer).

    The model's parameters become views into chunk buffers laid out as the plan says; use the returned
    `.model` and `.optimizer` from here on (the optimizer passed in is left untouched and goes stale).
    Offloaded parameters have no `.grad` (their gradients live on the host): clip with
    `wrapped.clip_grad_norm_`, not `torch.nn.utils.clip_grad_norm_(model.parameters())`.
    Raises PlanMismatchError (naming the parameter) when the plan's layout does not match the model.
    """
    if plan is None:
        raise NotImplementedError(
            "agent.wrap without plan=: profiling and solving inside wrap is issue 7 ('Runtime II') and is NOT "
            "implemented yet. Pass plan= (e.g. from planner_service.solver.solve(agent.profile(...), ...) "
            "or agent.runtime.manual_plan(model, ...))."
        )
    import torch

    from agent.runtime.device import DeviceContext
    from agent.runtime.layout import ChunkLayout
    from agent.runtime.manager import ModelStateManager
    from agent.runtime.optimizer import ChunkedOptimizer, check_parameters, check_supported
    from agent.runtime.options import RuntimeOptions

    if plan.policy is None:
        raise ValueError(f"plan.policy: absent (solver status {plan.solver.status.value}); nothing to apply")
    if getattr(model, "_memplan_wrapped", False):
        raise RuntimeError("model: is already wrapped; unwrap it first")
    check_supported(optimizer)
    opts = options or RuntimeOptions()
    params = list(model.parameters())
    if not params:
        raise ValueError("model: has no parameters")
    model_dtype = params[0].dtype
    compute_dtype = opts.compute_dtype or model_dtype
    if opts.device is not None:
        device = torch.device(opts.device)
    elif params[0].device.type != "cpu":
        device = params[0].device
    else:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    layout = ChunkLayout.from_policy(plan.policy, model, compute_dtype)
    check_parameters(optimizer, layout)  # every check before the model is touched
    user_state = optimizer.state_dict() if optimizer.state else None
    manager = ModelStateManager(model, layout, DeviceContext(device), opts)
    wrapped_opt = ChunkedOptimizer(optimizer, layout, manager)
    manager.attach_optimizer(wrapped_opt)
    if user_state is not None:
        wrapped_opt.load_state_dict(user_state)  # wrapping mid-training keeps the optimizer's state
    model._memplan_wrapped = True  # type: ignore[assignment]
    return Wrapped(
        model=model, optimizer=wrapped_opt, plan=plan, runtime=manager, original_optimizer=optimizer
    )


def unwrap(wrapped: Wrapped) -> nn.Module:
    """Turn the parameters back into ordinary tensors holding their trained values, on their original
    device and dtype, remove every hook, and load the trained optimizer state into the original
    optimizer (so plain PyTorch training continues exactly). Returns the model."""
    wrapped._check()
    state = wrapped.optimizer.state_dict()
    wrapped.runtime.detach()
    model = wrapped.model
    model._memplan_wrapped = False  # type: ignore[assignment]
    for g_orig, g_new in zip(
        wrapped.original_optimizer.param_groups, wrapped.optimizer.param_groups, strict=True
    ):
        g_orig.update({k: v for k, v in g_new.items() if k != "params"})
    if state["state"]:
        state = {
            **state,
            "state": {
                k: {n: v for n, v in s.items() if n != "master_param"} for k, s in state["state"].items()
            },
        }
        wrapped.original_optimizer.load_state_dict(state)
    wrapped.unwrapped = True
    return model
