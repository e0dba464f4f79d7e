"""The one-call path behind `agent.wrap`: get a plan, apply model-state and activation policies, measure, report.

    run = agent.wrap(model, optimizer, sample_batch=batch, device_memory=8 << 30)
    for batch in data:
        run.model(**batch).loss.backward()
        run.optimizer.step()
        run.optimizer.zero_grad()
    print(run.report())           # plan, predicted vs measured (after the feedback steps)
    model = agent.unwrap(run)

`manage` checks everything that can be checked before the model is touched (plan present and
feasible, activation modes against the model's modules, the optimizer and layout), then applies the
chunk runtime (`agent.wrap.wrap` with the plan), the activation manager, and a `StepMonitor` that posts
feedback after `feedback_steps` steps (to the service the plan came from, else to a local file).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from agent.feedback import DEFAULT_FEEDBACK_STEPS, DEFAULT_LOCAL_FEEDBACK, LocalSink, ServiceSink, StepMonitor
from agent.planning import PlanSource, obtain_plan

if TYPE_CHECKING:
    from agent.runtime.accounting import RuntimeReport
    from agent.runtime.activations import ActivationManager
    from agent.runtime.options import RuntimeOptions
    from agent.runtime.swap import SwapCounters
    from agent.wrap import Wrapped
    from client.contract import Feedback, Plan

log = logging.getLogger(__name__)


@dataclass
class ManagedReport:
    """Plan summary, predicted vs measured, and what the runtime did."""

    origin: str
    message: str
    solver: str
    solver_status: str
    mode_strip: str
    chunks: int
    offloaded_chunks: int
    n_buffers: int
    predicted_iteration_s: float | None
    predicted_peak_device_bytes: int | None
    predicted_peak_host_bytes: int | None
    measured: Feedback | None
    feedback_to: str | None
    runtime: RuntimeReport
    swap: SwapCounters | None = None
    notes: list[str] = field(default_factory=list)

    @staticmethod
    def _err(measured: float | None, predicted: float | None) -> str:
        if measured is None or not predicted:
            return "-"
        return f"{(measured / predicted - 1.0) * 100:+.1f}%"

    def rows(self) -> list[tuple[str, str, str, str]]:
        """(quantity, predicted, measured, error) rows for a table."""
        m = self.measured
        mib = 2**20

        def b(x: float | None) -> str:
            return "-" if x is None else f"{x / mib:.2f} MiB"

        def s(x: float | None) -> str:
            return "-" if x is None else f"{x * 1e3:.1f} ms"

        return [
            ("iteration time", s(self.predicted_iteration_s), s(m.iteration_s if m else None),
             self._err(m.iteration_s if m else None, self.predicted_iteration_s)),
            ("peak device memory", b(self.predicted_peak_device_bytes), b(m.peak_device_bytes if m else None),
             self._err(m.peak_device_bytes if m else None, self.predicted_peak_device_bytes)),
            ("peak host memory", b(self.predicted_peak_host_bytes), b(m.peak_host_bytes if m else None),
             self._err(m.peak_host_bytes if m else None, self.predicted_peak_host_bytes)),
        ]

    def __str__(self) -> str:
        lines = [
            f"plan: {self.message} [{self.origin}]; solver {self.solver} ({self.solver_status}); modes {self.mode_strip}; "
            f"{self.chunks} chunks, {self.offloaded_chunks} offloaded, {self.n_buffers} buffers",
        ]
        for q, p, mm, e in self.rows():
            lines.append(f"  {q:<20} predicted {p:>12}  measured {mm:>12}  {e:>8}")
        if self.feedback_to:
            lines.append(f"  feedback: {self.feedback_to}")
        if self.swap is not None:
            lines.append(f"  swap: {self.swap.swapped_out_bytes / 2**20:.1f} MiB out, {self.swap.prefetched_blocks} blocks "
                         f"prefetched, {self.swap.late_fetches} late, {self.swap.demand_fetches} on demand")
        lines.append(f"  runtime: {self.runtime}")
        return "\n".join(lines)


@dataclass
class ManagedRun:
    """What `agent.wrap` returns: the managed model and optimizer, the plan, and its report."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    plan: Plan
    source: PlanSource
    wrapped: Wrapped = field(repr=False)
    activations: ActivationManager = field(repr=False)
    monitor: StepMonitor | None = field(repr=False)
    unwrapped: bool = False

    def report(self) -> ManagedReport:
        policy = self.plan.policy
        assert policy is not None
        pred = self.plan.predictions
        rt = self.wrapped.report()
        m = self.monitor.measured if self.monitor is not None else None
        return ManagedReport(
            origin=self.source.origin, message=self.source.message or self.source.origin,
            solver=self.plan.solver.solver, solver_status=self.plan.solver.status.value,
            mode_strip=policy.mode_strip(), chunks=len(policy.chunks),
            offloaded_chunks=sum(c.placement.value == "offloaded" for c in policy.chunks), n_buffers=policy.n_buffers,
            predicted_iteration_s=pred.iteration_s if pred else None,
            predicted_peak_device_bytes=pred.peak_device_bytes if pred else None,
            predicted_peak_host_bytes=pred.peak_host_bytes if pred else None,
            measured=(m.sent or m.feedback()) if m is not None else None,
            feedback_to=m.sent_to if m is not None else None,
            runtime=rt, swap=self.activations.store.counters if self.activations.store is not None else None,
        )

    def feedback(self) -> Feedback | None:
        """Send the feedback now (before `feedback_steps` steps were reached); None if too few steps ran."""
        return self.monitor.flush() if self.monitor is not None else None

    # conveniences of the runtime
    def synchronize(self) -> None:
        self.wrapped.synchronize()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        return self.wrapped.clip_grad_norm_(max_norm, norm_type)


def manage(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    sample_batch: Any = None,
    server: str | None = None,
    device_memory: int | None = None,
    host_memory: int | None = None,
    plan: Plan | None = None,
    options: RuntimeOptions | None = None,
    loss_fn: Any = None,
    feedback_steps: int | None = DEFAULT_FEEDBACK_STEPS,
    feedback_path: Path | None = None,
    wait_s: float = 120.0,
) -> ManagedRun:
    """Profile + plan (unless `plan` is given) + apply + measure. See the module docstring."""
    from agent.runtime.activations import apply_activation_policy, block_targets
    from agent.wrap import wrap as apply_model_state

    if getattr(model, "_memplan_wrapped", False):
        raise RuntimeError("model: is already wrapped; unwrap it first")
    if plan is not None:
        source = PlanSource(plan, "given", message="plan given to wrap")
    else:
        source = obtain_plan(model, optimizer, sample_batch, server=server, device_memory=device_memory,
                             host_memory=host_memory, loss_fn=loss_fn, wait_s=wait_s)
        log.info("memplan: %s", source.message)
    plan = source.plan
    if plan.policy is None:
        raise ValueError(f"plan.policy: absent (solver status {plan.solver.status.value}); nothing to apply")
    block_targets(model, plan.policy)  # activation checks before the model is touched
    wrapped = apply_model_state(model, optimizer, plan=plan, options=options)
    try:
        activations = apply_activation_policy(model, plan.policy, wrapped.runtime.ctx.device, wrapped.runtime)
    except BaseException:
        from agent.wrap import unwrap as undo

        undo(wrapped)
        raise
    monitor: StepMonitor | None = None
    if feedback_steps:
        local = LocalSink(feedback_path or DEFAULT_LOCAL_FEEDBACK, plan_id=source.plan_id, trace_hash=plan.trace_hash)
        sink = ServiceSink(source.server, source.plan_id, fallback=local) if (
            source.server and source.plan_id) else local
        monitor = StepMonitor(model, wrapped.optimizer, wrapped.runtime.ctx.device, manager=wrapped.runtime,
                              activations=activations, sink=sink, steps=feedback_steps,
                              notes=lambda: f"memplan agent; plan origin {source.origin}; modes {plan.policy.mode_strip()}"
                              if plan.policy else "")
    return ManagedRun(model=wrapped.model, optimizer=wrapped.optimizer, plan=plan, source=source, wrapped=wrapped,
                      activations=activations, monitor=monitor)


def release(run: ManagedRun) -> nn.Module:
    """Undo `manage`: monitor, activation modes, then the chunk runtime (parameters back, optimizer state back)."""
    from agent.wrap import unwrap as undo

    if run.unwrapped:
        raise RuntimeError("this run was already unwrapped")
    if run.monitor is not None:
        run.monitor.close()
    run.activations.remove()
    model = undo(run.wrapped)
    run.unwrapped = True
    return model
