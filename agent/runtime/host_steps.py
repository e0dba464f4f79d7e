"""Host steps of offloaded chunks: queued on the host worker, speculative during backward, validated at step.

With `overlap_host_step` a chunk is stepped as soon as its gradients are on the host, during backward, with
the unclipped gradient; with `undo_host_steps` its master and optimizer state are backed up first.
`optimizer.step()` validates each speculative step (same `.grad`, same stepped parameters, same
hyper-parameters) and restores and redoes the ones that fail (SuperOffload's speculation-then-validation,
with a backup instead of an arithmetic rollback: see docs/architecture/runtime.md).

A sharded chunk (issue 20) steps this rank's shard; filling its `.grad` all-gathers the shards' host gradients,
and after `optimizer.step()` settled every chunk, every rank's stepped shard reaches every rank
(`publish_shards`), whatever each rank decided for its own shard: private compute copies are all-gathered, in
chunk order on every rank; a node-shared compute copy (`node_shared.py`) already holds every rank's shard once
each rank wrote its own, so one barrier on the host worker (after every step task) is all it takes, and every
sharded chunk's next upload waits for it. Undoing a speculative step of a node-shared chunk rewrites this
rank's shard, so it too ends with a barrier.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import torch

from agent.runtime.accounting import Counters
from agent.runtime.chunks import ChunkState
from agent.runtime.device import DeviceContext, Event
from agent.runtime.host_worker import HostWorker
from agent.runtime.local_grads import whole_user_grad
from agent.runtime.options import RuntimeOptions
from agent.runtime.process_group import RankGroup
from agent.runtime.residency import ChunkResidency

if TYPE_CHECKING:
    from agent.runtime.optimizer import ChunkedOptimizer


log = logging.getLogger(__name__)


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
        self._warned_evaluation = False
        self.accumulation = 1
        self.group: RankGroup | None = None  # the job's process group: sharded chunks' collectives
        self.shared = False  # the sharded chunks' compute copies are node-shared (`node_shared.py`)

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
        assert st.host_grad is not None and st.host_params is not None and st.master is not None
        if speculative:  # (a redo is never speculative: its `.grad` is what the user left)
            self.fill_user_grad(st)
        t0 = time.perf_counter()
        if redo:
            self._restore(st)
        if speculative:
            if backup:
                if st.backup_master is None:
                    st.backup_master = torch.empty_like(st.master)
                st.backup_master.copy_(st.master)
                self.optimizer.steppers[st.index].snapshot()
        self.optimizer.steppers[st.index].step(hypers, st.host_grad, touched)
        self._refresh_compute(st)
        self.counters.host_step_s += time.perf_counter() - t0
        self.counters.host_steps += 1

    def _refresh_compute(self, st: ChunkState) -> None:
        """The compute copy (upload source) from the stepped master: in mixed precision a cast copy; in a sharded
        chunk this rank's shard only (`publish_shards` brings the other ranks' shards after `optimizer.step()`; in a
        node-shared copy other ranks read the shard only after the barrier that follows)."""
        assert st.host_params is not None and st.master is not None
        if not st.mixed:
            return  # the master is the compute copy (or its shard)
        if st.shard is None:
            st.host_params.copy_(st.master)
        else:
            st.host_params[st.shard.start : st.shard.end].copy_(st.master)

    def fill_user_grad(self, st: ChunkState, events: list[Event] | None = None) -> None:
        """Host worker: the gradient `.grad` shows, from the host gradient (cast to the compute dtype). A
        sharded chunk: the all-gather of every rank's shard (a collective: issued in the same order on every rank,
        chunk completion order during backward, chunk order at its end)."""
        for ev in events or []:
            self.ctx.host_wait(ev)
        assert st.host_grad is not None
        user_grad = whole_user_grad(st, self.ctx, self.compute_dtype)
        if st.shard is None:
            user_grad.copy_(st.host_grad)
        else:
            assert self.group is not None
            t0 = time.perf_counter()
            self.group.all_gather(user_grad, st.host_grad.to(self.compute_dtype, copy=True))
            self.counters.grad_fill_s += time.perf_counter() - t0
            self.counters.grad_gathers += 1

    def publish_shards(self, states: list[ChunkState]) -> None:
        """At `optimizer.step()`, after every chunk's step was queued: make every rank's stepped shard of each
        sharded chunk the optimizer steps visible to this rank's next upload of it, the same collectives on every
        rank whatever each decided for its own shard. Private copies: one all-gather per chunk, in chunk order
        (`_gather_params`). Node-shared: ONE barrier after every step task of this rank (the host worker runs
        them in order), so once it returns every rank finished writing its shards; every sharded chunk's next
        upload waits for it (`ChunkResidency.upload` waits on the chunk's host work)."""
        assert self.optimizer is not None
        stepped = [
            st
            for st in states
            if st.offloaded and st.shard is not None and self.optimizer.steppers[st.index].steps_chunk
        ]
        if not stepped:
            return
        if not self.shared:
            for st in stepped:
                st.host_work = self.worker.submit(self._gather_params, st)
                self.counters.param_gathers += 1
            return
        for st in stepped:
            # a buffer filled before the step holds the old values of other ranks' shards (settle evicts the
            # chunks it steps; this also covers a chunk this rank did not step and another did)
            self.residency.evict_chunk(st)
        self._queue_barrier(stepped)

    def _queue_barrier(self, states: list[ChunkState]) -> None:
        """Queue a barrier on the host worker after the host work queued so far; the chunks' next uploads wait
        for it (and it re-raises an error of their earlier host work)."""
        before = [st.host_work for st in states]
        done = self.worker.submit(self._barrier, before)
        for st in states:
            st.host_work = done
        self.counters.compute_barriers += 1

    def _barrier(self, before: list[Future[None] | None]) -> None:
        """Host worker: every rank's host work queued before this point has finished (the node-shared copy is
        written); then the errors of the host work it replaces as the chunks' last task."""
        assert self.group is not None
        t0 = time.perf_counter()
        self.group.barrier()
        self.counters.compute_barrier_s += time.perf_counter() - t0
        for f in before:
            if f is not None:
                f.result()  # done: the worker ran it before this task

    def _gather_params(self, st: ChunkState) -> None:
        """Host worker: every rank's shard of the private compute copy into the whole compute copy."""
        assert st.shard is not None and st.host_params is not None and self.group is not None
        t0 = time.perf_counter()
        own = st.host_params[st.shard.start : st.shard.end].clone()
        self.group.all_gather(st.host_params, own)
        self.counters.param_gather_s += time.perf_counter() - t0

    def _restore(self, st: ChunkState, read: Event = None) -> None:
        """Host worker: undo the chunk's speculative step (master, compute copy, optimizer state), once the
        chunk's last upload (`read`) has read the compute copy."""
        assert self.optimizer is not None
        assert st.master is not None and st.backup_master is not None and st.host_params is not None
        if read is not None:
            self.ctx.host_wait(read)
        st.master.copy_(st.backup_master)
        self.optimizer.steppers[st.index].restore()
        self._refresh_compute(st)

    def undo(self, st: ChunkState, *, why: str) -> None:
        """Undo a speculative step now (another backward adds to the gradient, or no step follows)."""
        if not st.stepped:
            return
        if not st.spec_backup:
            raise RuntimeError(
                f"chunk runtime: {why}, and RuntimeOptions(undo_host_steps=False) keeps nothing to undo it with. "
                "Use undo_host_steps=True (the default) or overlap_host_step=False."
            )
        # an upload of the stepped values may still be reading the compute copy the restore rewrites (a prefetch
        # in backward, before the recomputation that undoes the step: the stream checker's finding, session 26)
        read = st.ready if st.slot is not None else None
        self.residency.evict_chunk(st)  # its buffer may hold the stepped values: upload the restored ones
        st.written = False  # the restore copies the backup, the user's writes there included
        st.wait_host()
        st.host_work = self.worker.submit(self._restore, st, read)
        if st.node_shared:
            # this rank rewrote its shard of the node's copy: no rank may upload it before that finished (every
            # rank undoes the same chunks: the same graph, the same speculation decisions)
            self._queue_barrier([st])
        st.stepped = False
        st.spec_hypers = None
        st.user_grad_filled = False
        self.counters.host_step_undos += 1

    def rejoin(self, st: ChunkState, *, changed: bool) -> None:
        """End of a synchronising backward (`GradientFlow.agree`; every rank calls it for the same chunks): the
        ranks held different entries of the chunk's averaged gradient. A speculative step is undone where this
        rank's gradient `changed` (its entries grew to the union; `step()` takes the chunk again), and for a
        sharded chunk on every rank: the ranks' speculative state
        then stays the same, so later undos (the next forward's, of an accumulation) issue the same barriers
        everywhere (review, session 26: undone on one rank, the next forward's undo waited in a barrier the other
        never reached). A node-shared chunk gets the one barrier an undo queues, undone here or not. Without undo
        backups (`RuntimeOptions(undo_host_steps=False)`) `agree` raises on every rank before this is called."""
        if st.stepped and (changed or st.shard is not None):
            self.undo(st, why="the ranks' backwards gave gradients to different entries of the chunk")
        elif st.node_shared:
            self._queue_barrier([st])

    def undo_for_evaluation(self, states: list[ChunkState]) -> None:
        """A forward under no_grad between backward and `optimizer.step()` (an evaluation, a metric) sees the
        parameters before the step, as in plain PyTorch: the speculative steps no `step()` confirmed are undone
        (`step()` then takes them, as it does a chunk not stepped yet; the overlap is lost for this iteration). A
        chunk sharded across the ranks (its undo leads to collectives: an all-gather of `.grad`, a node-shared
        copy's barrier; an evaluation may run on one rank only) and `undo_host_steps=False` (nothing to undo with)
        keep their stepped values, said once."""
        for st in states:
            if not (st.offloaded and st.stepped):
                continue
            # a sharded chunk's `.grad` is refilled by an all-gather after an undo, and a node-shared one's undo is a
            # barrier: collectives an evaluation on one rank alone would leave the others waiting for
            local = st.shard is None and not st.node_shared
            if st.spec_backup and local:
                self.undo(st, why="a forward under no_grad before optimizer.step()")
            elif not self._warned_evaluation:
                self._warned_evaluation = True
                log.warning(
                    "memplan: a forward under no_grad between backward and optimizer.step() sees the parameters "
                    "of offloaded chunk %d already stepped (%s); call optimizer.step() first, or use "
                    "RuntimeOptions(overlap_host_step=False)",
                    st.index,
                    "sharded across the ranks" if not local else "undo_host_steps=False",
                )

    def settle(self, st: ChunkState, hypers: list[dict[str, Any]], *, grad_changed: bool) -> None:
        """At `optimizer.step()`: keep the chunk's speculative step if it is still valid, else restore and
        redo it; a chunk not stepped yet (with gradients) is queued now."""
        written = self.residency.written_before_step(st)
        # the parameters showed the values before the step: the host copy again
        if st.shown_backup is not None:
            self.residency.show_host(st)
        st.written = False
        if st.stepped:
            if (
                grad_changed
                or written  # the user wrote a parameter (the values before the step) after backward
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
