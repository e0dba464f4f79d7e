"""Host steps of offloaded chunks: queued on the host worker, speculative during backward, validated at step.

With `overlap_host_step` a chunk is stepped as soon as its gradients are on the host, during backward, with
the unclipped gradient; with `undo_host_steps` its master and optimizer state are backed up first.
`optimizer.step()` validates each speculative step (same `.grad`, same stepped parameters, same
hyper-parameters) and restores and redoes the ones that fail (SuperOffload's speculation-then-validation,
with a backup instead of an arithmetic rollback: see docs/architecture/runtime.md).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

from agent.runtime.accounting import Counters
from agent.runtime.chunks import ChunkState
from agent.runtime.device import DeviceContext, Event
from agent.runtime.host_worker import HostWorker
from agent.runtime.options import RuntimeOptions
from agent.runtime.residency import ChunkResidency

if TYPE_CHECKING:
    from agent.runtime.optimizer import ChunkedOptimizer


class HostSteps:
    """Queues, speculates, validates, undoes and redoes the host optimizer steps of offloaded chunks."""

    def __init__(
        self,
        ctx: DeviceContext,
        options: RuntimeOptions,
        counters: Counters,
        worker: HostWorker,
        residency: ChunkResidency,
        compute_dtype: torch.dtype,
    ) -> None:
        self.ctx = ctx
        self.options = options
        self.counters = counters
        self.worker = worker
        self.residency = residency
        self.compute_dtype = compute_dtype
        self.optimizer: ChunkedOptimizer | None = None
        # gradient accumulation: backward passes since the last optimizer.step(), and how many the last step
        # had; host steps are speculated only in the backward expected to be the last before a step
        self.backwards = 0
        self.accumulation = 1

    def speculating(self) -> bool:
        """Step offloaded chunks during this backward: overlapping, and (with gradient accumulation) this is
        the backward the last optimizer step was taken after (earlier micro-batches' steps would be undone)."""
        return self.options.overlap_host_step and self.backwards + 1 >= self.accumulation

    def submit(self, st: ChunkState, *, speculative: bool = False, redo: bool = False) -> None:
        """Queue the chunk's host step. Speculative (during backward): first the gradient `.grad` will show
        is filled, and (undo_host_steps) the master and optimizer state are kept. Redo: the speculative
        step is undone first."""
        assert self.optimizer is not None
        hypers = self.optimizer.hyper_snapshot()
        events = st.pending_events
        st.pending_events = []
        backup = speculative and self.options.undo_host_steps
        touched = set(st.touched)
        st.host_work = self.worker.submit(
            self._host_step, st, hypers, touched, events, speculative, backup, redo
        )
        st.stepped = speculative
        st.spec_backup = backup
        st.spec_hypers = hypers if speculative else None
        st.spec_touched = frozenset(touched)
        if speculative:
            st.user_grad_filled = True
            self.counters.speculative_steps += 1

    def _host_step(
        self,
        st: ChunkState,
        hypers: list[dict[str, Any]],
        touched: set[int],
        events: list[Event],
        speculative: bool,
        backup: bool,
        redo: bool,
    ) -> None:
        """Host worker: the chunk's optimizer step on its fp32 master, then refresh the upload source.

        The step reads only `host_grad`, never the `.grad` the user sees (`user_grad`), so user code may
        scale `.grad` while host steps run."""
        assert self.optimizer is not None
        for ev in events:
            self.ctx.host_wait(ev)
        t0 = time.perf_counter()
        assert st.host_grad is not None and st.host_params is not None and st.master is not None
        if redo:
            self._restore(st)
        if speculative:
            self.fill_user_grad(st)
            if backup:
                if st.backup_master is None:
                    st.backup_master = torch.empty_like(st.master)
                st.backup_master.copy_(st.master)
                self.optimizer.steppers[st.index].snapshot()
        self.optimizer.steppers[st.index].step(hypers, st.host_grad, touched)
        if st.mixed:
            st.host_params.copy_(st.master)
        self.counters.host_step_s += time.perf_counter() - t0
        self.counters.host_steps += 1

    def fill_user_grad(self, st: ChunkState, events: list[Event] | None = None) -> None:
        """Host worker: the gradient `.grad` shows, from the host gradient (cast to the compute dtype)."""
        for ev in events or []:
            self.ctx.host_wait(ev)
        assert st.host_grad is not None
        if st.user_grad is None:
            st.user_grad = torch.empty(st.numel, dtype=self.compute_dtype, device=st.host_grad.device)
        st.user_grad.copy_(st.host_grad)

    def _restore(self, st: ChunkState) -> None:
        """Host worker: undo the chunk's speculative step (master, compute copy, optimizer state)."""
        assert self.optimizer is not None
        assert st.master is not None and st.backup_master is not None and st.host_params is not None
        st.master.copy_(st.backup_master)
        self.optimizer.steppers[st.index].restore()
        if st.mixed:
            st.host_params.copy_(st.master)

    def undo(self, st: ChunkState, *, why: str) -> None:
        """Undo a speculative step now (another backward adds to the gradient, or no step follows)."""
        if not st.stepped:
            return
        if not st.spec_backup:
            raise RuntimeError(
                f"chunk runtime: {why}, and RuntimeOptions(undo_host_steps=False) keeps nothing to undo it with. "
                "Use undo_host_steps=True (the default) or overlap_host_step=False."
            )
        self.residency.evict_chunk(st)  # its buffer may hold the stepped values: upload the restored ones
        st.wait_host()
        st.host_work = self.worker.submit(self._restore, st)
        st.stepped = False
        st.spec_hypers = None
        st.user_grad_filled = False
        self.counters.host_step_undos += 1

    def settle(self, st: ChunkState, hypers: list[dict[str, Any]], *, grad_changed: bool) -> None:
        """At `optimizer.step()`: keep the chunk's speculative step if it is still valid, else restore and
        redo it; a chunk not stepped yet (with gradients) is queued now."""
        if st.stepped:
            if (
                grad_changed
                or st.spec_touched != frozenset(st.touched)
                or not same_hypers(st.spec_hypers, hypers)
            ):
                # validation failed: the gradient (e.g. clipped), the parameters with a gradient or the
                # hyper-parameters differ from what the speculative step used: restore and step again
                if not st.spec_backup:
                    raise RuntimeError(
                        f"optimizer.step(): the gradients of offloaded chunk {st.index} changed after its "
                        "overlapped host step (e.g. clipping that scaled them), and "
                        "RuntimeOptions(undo_host_steps=False) keeps nothing to undo it with. Use "
                        "undo_host_steps=True (the default) or overlap_host_step=False."
                    )
                self.residency.evict_chunk(st)
                self.submit(st, redo=True)
                self.counters.host_step_redos += 1
        elif st.touched:
            self.residency.evict_chunk(st)
            self.submit(st)
        st.stepped = False
        st.spec_hypers = None


def same_hypers(a: list[dict[str, Any]] | None, b: list[dict[str, Any]]) -> bool:
    """Equal hyper-parameter snapshots (values may be tensors, e.g. a tensor learning rate)."""
    if a is None or len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        if x.keys() != y.keys():
            return False
        for k, v in x.items():
            w = y[k]
            if isinstance(v, torch.Tensor) or isinstance(w, torch.Tensor):
                if not (isinstance(v, torch.Tensor) and isinstance(w, torch.Tensor) and torch.equal(v, w)):
                    return False
            elif v != w:
                return False
    return True
