"""Gradient flow: from autograd into the chunks, to the host, and back out as the `.grad` users see.

Persistent chunks: each fresh gradient is copied into the chunk's gradient area and `.grad` points there.
Offloaded chunks: each gradient is gathered into the buffer's gradient area; when every parameter of the
chunk used in forward has its gradient the area goes to the host on the offload stream (`flush`), the
chunk leaves its buffer and, when speculating, its host step is queued. At the end of backward every
offloaded parameter gets `.grad`, a host view of its chunk's `user_grad` (`expose`); the user's edits are
folded back into the host gradient at `optimizer.step()` (`reconcile`) or before the next training forward
(`retract`).

A sharded offloaded chunk (issue 20) is reduce-scattered at every flush of a synchronising backward: this rank
receives the mean of its own shard only, which goes to the host; its `.grad` is the all-gather of the shards'
host gradients (`HostSteps.fill_user_grad`), so every rank sees DDP's whole averaged gradient. Inside
`no_sync()` it issues no collective, as DDP: its flushes add the whole local gradient into `user_grad` on the
host (`.grad` then shows the local accumulated gradient, as DDP's), and the first flush of the next
synchronising backward adds that into the device gradient area before its one reduce-scatter (`local_grads.py`;
the CUDA path of this is written but has not run on a GPU).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future

import torch

from agent.runtime import local_grads
from agent.runtime.accounting import Counters
from agent.runtime.buffers import Slot
from agent.runtime.chunks import ChunkState, ViewCache, stage_for
from agent.runtime.chunks import grad_views as chunk_grad_views
from agent.runtime.device import DeviceContext, Event, element_size
from agent.runtime.host_steps import HostSteps
from agent.runtime.host_worker import HostWorker
from agent.runtime.process_group import RankGroup
from agent.runtime.residency import ChunkResidency
from agent.runtime.timing import FLUSH, RuntimeTiming, section

log = logging.getLogger(__name__)


class AssignedGradientError(RuntimeError):
    """A gradient assigned by hand that the runtime cannot step (a job of several ranks)."""


def assigned_in_a_group(name: str) -> str:
    return (
        f"optimizer.step(): parameter {name!r} has a gradient assigned by hand (`p.grad = ...`, e.g. from "
        "torch.autograd.grad) that no backward pass produced; in a job of several ranks memplan averages gradients "
        "in backward's hooks and each rank steps its shard of them, so such a gradient cannot be stepped. Compute "
        "gradients with loss.backward()."
    )


class GradientFlow:
    """Gradient hooks' work, gradient areas, flushes to the host, and the `.grad` the user sees."""

    def __init__(
        self,
        states: list[ChunkState],
        positions: dict[int, tuple[int, int]],
        ctx: DeviceContext,
        compute_dtype: torch.dtype,
        counters: Counters,
        views: ViewCache,
        timing: RuntimeTiming,
        residency: ChunkResidency | None,
        host_steps: HostSteps | None,
        worker: HostWorker | None,
    ) -> None:
        self.states = states
        self.positions = positions  # id(param) -> (chunk, position in the chunk's entries)
        self.ctx = ctx
        self.compute_dtype = compute_dtype
        self.counters = counters
        self.views = views
        self._grad_views: dict[int, tuple[torch.Tensor | None, list[torch.Tensor | None]]] = {}
        self.timing = timing
        self.residency = residency
        self.host_steps = host_steps
        self.worker = worker
        self._esize = element_size(compute_dtype)
        # the job's process group (issue 20) and whether this backward averages gradients across it
        self.group: RankGroup | None = None
        self.reduce = False
        # this synchronising backward's reductions wait for its end (`check_same_use`: the ranks' forwards used
        # different offloaded chunks); the chunks every rank then reduces, in chunk order
        self.deferred = False
        self._deferred_chunks: list[int] = []
        # this synchronising backward averages each persistent chunk as its gradients complete (the ranks'
        # forwards used the same persistent parameters: `check_same_use`), overlapping backward where copies
        # overlap compute (CUDA), as DDP's buckets do; else every persistent chunk is averaged at its end
        self.overlap_persistent = False
        # whether a synchronising backward may (`RuntimeOptions.persistent_reductions_in_backward`; default: on
        # CUDA only, where it overlaps backward)
        self.persistent_in_backward = ctx.is_cuda
        # a synchronising backward's one issue order (`check_same_use`), the same on every rank: the offloaded
        # chunks the forward used and, with `overlap_persistent`, the persistent ones, by descending index
        # (backward's usual order); how many were issued, those complete on this rank
        self._order: list[int] = []
        self._issued = 0
        self._ready: set[int] = set()
        # the chunk whose completion is flushing it (`complete`): a sharded one at the head of the order
        # reduce-scatters in that flush; any other flush of an ordered sharded chunk stays on this rank
        self._completing: int | None = None
        # the offloaded chunks this backward averages (ordered, or deferred), whose entries with a gradient
        # the ranks agree on at its end (`agree`); the persistent chunks averaged then
        self._agreed: list[int] = []
        self._now: list[ChunkState] = []
        self._agreements = 0  # end-of-backward agreements so far (`agree`)
        # a parameter whose hand-assigned gradient a backward under a process group could not keep (`expose`):
        # refused at the next `optimizer.step()`
        self._assigned_lost: str | None = None

    @property
    def local(self) -> bool:
        """This backward keeps gradients local: a job of several ranks, inside `no_sync()`."""
        return self.group is not None and not self.reduce

    # ======================================================================== arriving gradients
    def receive(self, param: torch.Tensor) -> None:
        """A parameter's gradient was accumulated (post-accumulate-grad hook): move it into its chunk."""
        if param.grad is None:
            return
        c, j = self.positions[id(param)]
        st = self.states[c]
        e = st.spec.entries[j]
        if not st.offloaded:
            if st.early:
                self._late(st, j, param.grad)
                return
            self._into_area(st, j, param.grad)
            if self.overlap_persistent:
                st.received.add(j)
                if st.expected and st.expected <= st.received:
                    self._ready.add(c)
                    self._issue_ready()
            return
        assert self.residency is not None and self.host_steps is not None
        if st.stepped:
            # a parameter used again after its chunk's speculative step (e.g. outside its module's forward)
            self.reuse(st, why=f"parameter {e.name!r} got a gradient after its chunk's speculative host step")
        if st.slot is None:
            self.residency.acquire(c)  # waits for the upload it starts
        else:
            # resident because it was prefetched: its upload (which zeroes the gradient area on the upload
            # stream) may still be in flight; the compute stream's write below must come after it (issue 19,
            # defect 2: GPT-2's tied wte, alone in a chunk, gets its gradient last)
            self.ctx.wait(st.ready)
        assert st.slot is not None
        dst = self.residency.pool.slots[st.slot].grad[e.offset : e.end]
        if j in st.in_slot:
            dst.add_(param.grad.reshape(-1))
        else:
            dst.copy_(param.grad.reshape(-1))
        param.grad = None
        st.in_slot.add(j)
        st.received.add(j)
        if st.expected and st.expected <= st.received:
            self.complete(st)

    def reuse(self, st: ChunkState, *, why: str) -> None:
        """Backward uses an offloaded chunk again after its speculative step: the step is undone, and the chunk
        is not stepped during backward again (`ChunkState.reused`; optimizer.step() steps it), so a block run
        several times does not step and undo once per pass."""
        assert self.host_steps is not None
        self.host_steps.undo(st, why=why)
        st.reused = True

    def _slot(self, st: ChunkState, j: int) -> torch.Tensor:
        """Persistent chunk: entry j's view of the gradient area, the area widened first where it has no slot
        for it (a parameter frozen when the runtime was applied)."""
        view = self.grad_views(st)[j] if st.grad is not None else None
        if view is None:
            self._widen(st)
            view = self.grad_views(st)[j]
            assert view is not None
        return view

    def _into_area(self, st: ChunkState, j: int, grad: torch.Tensor) -> None:
        """Persistent chunk: parameter j's gradient goes into the chunk's gradient area, which its `.grad` views."""
        view = self._slot(st, j)
        if grad.data_ptr() != view.data_ptr():  # a fresh gradient (after zero_grad), or the user's
            view.copy_(grad)
            st.spec.entries[j].param.grad = view
        st.touched.add(j)

    # ================================================================ the issue order, several ranks
    def _issue_ready(self) -> None:
        """Issue the averages of the complete chunks at the head of the order (`_order`): a chunk complete before
        those ahead of it waits for them, so every rank issues the same collectives in the same order whatever
        order its backward completes the chunks in (two ranks running two modules in opposite orders paired one's
        chunk with the other's: found by review for persistent chunks in session 25, for offloaded ones in
        session 26)."""
        while self._issued < len(self._order) and self._order[self._issued] in self._ready:
            st = self.states[self._order[self._issued]]
            self._issued += 1
            if st.offloaded:
                self._turn(st)
            else:
                self.average_early(st)

    def _turn(self, st: ChunkState) -> None:
        """An offloaded chunk's turn in the order: a sharded chunk whose gradient was flushed on this rank before
        it (`_holds`), or that joins with zeros (`issue_rest`), is reduce-scattered from its host copy (its flush at
        completion did it otherwise); a replicated chunk's host gradient is averaged; then its speculative step."""
        if st.shard is not None and st.local:
            self._submit_local_reduce_scatter(st)
        self._reduced(st)

    def _submit_local_reduce_scatter(self, st: ChunkState) -> None:
        """Queue a sharded chunk's reduce-scatter of its local sum on the host (`_reduce_scatter_local`)."""
        assert self.worker is not None
        st.wait_host()
        st.local = False
        st.flushes = 1
        st.host_work = self.worker.submit(self._reduce_scatter_local, st)
        self.counters.grad_reductions += 1
        self.counters.reduce_scatters += 1

    def issue_rest(self) -> None:
        """End of a synchronising backward: the chunks of the order this rank has not issued, in order, whether
        complete here or not. A chunk this rank's backward gave no gradient (its forward used it, its output did
        not reach this rank's loss) joins with zeros (`_join_zero`), so every rank issues the whole order (before
        session 26 an offloaded chunk complete on one rank only paired different collectives: gloo aborted, NCCL
        would hang)."""
        for c in self._order[self._issued :]:
            st = self.states[c]
            if st.offloaded and c not in self._ready:
                self._join_zero(st)
        self._ready.update(self._order)
        self._issue_ready()

    def _join_zero(self, st: ChunkState) -> None:
        """An offloaded chunk this rank holds no gradient of joins an average with zeros (a replicated chunk's host
        gradient, a sharded chunk's local sum; an averaged gradient being accumulated into stays, as averaging it
        again is exact); its entries some rank's forward used count as touched here too."""
        st.wait_host()
        st.touched |= st.joined
        if st.shard is not None:
            if not st.local:
                user = local_grads.whole_user_grad(st, self.ctx, self.compute_dtype)
                if st.flushes == 0:
                    user.zero_()
                st.local = True
                st.flushes = 0
        elif not st.unaveraged:
            assert st.host_grad is not None
            if st.flushes == 0:
                st.host_grad.zero_()
                st.flushes = 1
            st.unaveraged = True

    def average_early(self, st: ChunkState) -> None:
        """A persistent chunk's every expected gradient arrived in a synchronising backward whose ranks used the
        same persistent parameters (`overlap_persistent`), and every chunk ahead of it in the order is issued
        (`_issue_ready`; the rest at the end of backward, `reduce_persistent`): its gradient area is averaged across the
        ranks now instead of after backward. On CUDA the host worker (the runtime's one issuer of collectives
        while backward runs, FIFO) issues the all-reduce on the offload stream after the compute so far, so it
        overlaps the rest of backward as DDP's buckets do; without a host worker (no offloaded chunk) the training thread issues it,
        the only issuer then. On a CPU device (only when `RuntimeOptions.persistent_reductions_in_backward` says
        so: it overlaps nothing there) it runs now, on the training thread.

        Before it is issued: an entry without a gradient since zero_grad is zeroed in the area (the area keeps
        stale values of earlier steps: its `.grad` is None until backward points it there), so the ranks
        average zero for it (`find_unused_parameters=True`); and the chunk's parameters' `.grad` go to None until
        the end of backward, so a gradient arriving later (a parameter used after the chunk completed, or each
        pass of a block run several times under re-entrant checkpointing) is a fresh tensor added in once the
        average is done (`_late`), never autograd's in-place accumulation into the area while the all-reduce
        reads it."""
        assert self.group is not None
        st.early = True
        views = self.grad_views(st) if st.grad is not None else None
        if views is None or any(views[j] is None for j in st.expected):
            # no slot for a parameter unfrozen after wrap that got no gradient here (another rank may have one):
            # the whole area, as every rank then averages (`_widen`)
            self._widen(st)
            views = self.grad_views(st)
        self._adopt_user_grads(st)
        for j, (e, view) in enumerate(zip(st.spec.entries, views, strict=True)):
            if view is None:
                continue
            if j not in st.touched:
                view.zero_()
            e.param.grad = None
        self.counters.overlapped_reductions += 1
        if not self.ctx.is_cuda:
            self._average_area(st)
            return
        computed = self.ctx.record()
        st.averaged = torch.cuda.Event()
        if self.worker is not None:
            st.averaging = self.worker.submit(self._average_on_device, st, computed, st.averaged)
        else:
            self._average_on_device(st, computed, st.averaged)

    def _adopt_user_grads(self, st: ChunkState) -> None:
        """Before a persistent chunk's average: a gradient the user set to None outside `zero_grad` (a torch.compile
        wrapper's `nn.Module.zero_grad`, which the Trainer calls) leaves the chunk's gradients, as `sync_persistent`
        drops it at the step (before, an early-averaged chunk pointed `.grad` back at the averaged stale value at
        the end of backward, and the step used it; found by review); one replaced by another tensor is copied in."""
        views = self.grad_views(st)
        for j in sorted(st.touched):
            g, view = st.spec.entries[j].param.grad, views[j]
            if view is None or g is view:
                continue
            if g is None:
                st.touched.discard(j)
                view.zero_()
            else:
                view.copy_(g)
                st.spec.entries[j].param.grad = view

    def _average_area(self, st: ChunkState) -> None:
        """All-reduce (mean) a persistent chunk's gradient area (its parameters' `.grad` view it)."""
        assert st.grad is not None and self.group is not None
        t0 = time.perf_counter()
        self.group.average_(st.grad)
        self.counters.grad_reduction_s += time.perf_counter() - t0
        self.counters.grad_reductions += 1

    def _average_on_device(self, st: ChunkState, computed: Event, done: torch.cuda.Event) -> None:
        """CUDA (the host worker, or the training thread without one): the average on the offload stream after
        the compute the chunk's gradients came from, then `done` recorded there (written, not run on a GPU yet;
        ordered under the stream checker)."""
        stream = self.ctx.offload_stream
        with self.ctx.on(stream):
            self.ctx.wait(computed, stream)
            self._average_area(st)
            assert done is not None
            done.record(stream)

    def _settle_average(self, st: ChunkState) -> None:
        """The chunk's early average is issued and the current (compute) stream waits for it."""
        if st.averaging is not None:
            st.averaging.result()
            st.averaging = None
        if st.averaged is not None:
            self.ctx.wait(st.averaged)
            st.averaged = None

    def _late(self, st: ChunkState, j: int, grad: torch.Tensor) -> None:
        """A gradient of an early-averaged chunk (a parameter used again after its chunk completed, a
        re-entrant checkpoint's second pass): added into the area once the average is done; the chunk is
        averaged again at the end of backward (`reduce_persistent`), which is exact. The parameter's `.grad`
        stays None until then, so its next gradient in this backward is a fresh tensor too (with `.grad` the
        area, autograd would add into it before this hook, which would then add it twice)."""
        self._settle_average(st)
        view = self._slot(st, j)
        view.add_(grad.reshape(view.shape))
        st.spec.entries[j].param.grad = None
        st.touched.add(j)
        st.late = True

    def complete(self, st: ChunkState) -> None:
        """Every expected gradient of the chunk has arrived: send them to the host, step if overlapping."""
        assert self.residency is not None and self.host_steps is not None
        if st.slot is not None:
            slot = self.residency.pool.slots[st.slot]
            slot.pins = max(0, slot.pins - st.recompute_pins)
            st.recompute_pins = 0
            self._completing = st.index
            try:
                if slot.pins == 0:
                    self.residency.evict(slot)
                elif st.in_slot:
                    self.flush(st, slot, keep=True)
            finally:
                self._completing = None
        st.complete = True
        st.touched |= st.joined  # (zero where no gradient arrived here: the area is zeroed at upload)
        if self._waiting(st):
            self._ready.add(st.index)
            self._issue_ready()
            return
        if st.index in self._order:
            # complete again after its turn (a gradient after it): averaged again at the end of backward, on
            # every rank where any rank's chunk is (`agree`), not now: a rank that held the chunk for its turn
            # took this gradient into that average, so the ranks' collectives would pair differently (review).
            # A sharded chunk's later gradients wait in `user_grad` (its flush, `late`). Not stepped during backward
            # from now on (`reused`, agreed at its end): a step at the turn would be undone again, and a node-shared
            # copy's undos queue barriers that ranks completing chunks in other orders pair wrongly (a rank then
            # uploaded a chunk before the other restored its shard: 0.003 off, session 27)
            st.again = st.reused = True
            return
        self._reduced(st)

    def _reduced(self, st: ChunkState) -> None:
        """A complete offloaded chunk's turn in a synchronising backward, or any completion otherwise: its host
        gradient's average (a replicated chunk's; a sharded chunk's shard arrived averaged), then its speculative
        host step."""
        assert self.host_steps is not None
        if st.slot is not None and st.ready is not None:
            # uploaded again while it waited for its turn (a prefetch): its host step must not write the host copy
            # before that upload has read it (the stream checker's finding)
            st.pending_events.append(st.ready)
        if self.reduce and st.unaveraged:
            self._submit_average(st)
        if (
            self.host_steps.speculating()
            # a sharded chunk's speculative step all-gathers its `.grad` (a collective): taken at its turn on every
            # rank, with a gradient here or not (a rank its backward gave none steps no entry)
            and (st.touched or (st.shard is not None and self.reduce))
            and not st.stepped
            and not st.reused  # backward used it again after a speculative step (`reuse`)
            # a node-shared sharded chunk speculates from the second synchronising backward on, once the ranks
            # agreed on which chunks their backwards reuse: an undo's barrier where one rank reused the chunk and
            # another (holding it for its turn) had not stepped it would pair with nothing
            and not (st.node_shared and self._agreements == 0)
            and not st.local  # a sharded chunk's local sum inside no_sync(): nothing may step on it
            and not self.deferred  # its gradient is averaged at the end of this backward
            and self.host_steps.optimizer is not None
        ):
            self.host_steps.submit(st, speculative=True)

    @section(FLUSH)
    def flush(self, st: ChunkState, slot: Slot, *, keep: bool = False) -> None:
        """Copy the chunk's gradient area to the host (overwrite after zero_grad, else add). A sharded chunk:
        its reduce-scatter (adding its local sum of earlier no_sync backwards first), or inside `no_sync()` its
        whole area into `user_grad` (`_flush_local`)."""
        if st.shard is not None and (self.local or self._holds(st)):
            self._flush_local(st, slot, keep=keep)
            return
        if st.shard is not None and self._after_turn(st):
            self._flush_local(st, slot, keep=keep, late=True)
            return
        assert st.host_grad is not None and self.worker is not None
        st.wait_host()  # host work may still read host_grad or the staging buffer
        n = st.numel
        # user_grad holds part of the gradient since zero_grad, added into the area once, here: the local sum of
        # no_sync backwards or of flushes held before its turn (`local`), or, at a sharded chunk's turn in a
        # backward accumulating into an averaged gradient (flushes > 0: no zero_grad since a synchronising
        # backward), that average as `.grad` showed it. Then the reduce-scatter carries the whole gradient and
        # overwrites the host shard, the same meaning as the contribution of a rank reduce-scattering its held
        # sum or joining with nothing (`_turn`, `_join_zero`); before (review, session 26) this rank sent its
        # increment and added the result, the others their total, and the shard came out wrong
        local = st.local or (st.shard is not None and st.flushes > 0 and self._waiting(st))
        st.local = False
        if local:
            st.flushes = 0
        first = st.flushes == 0  # (0 for a chunk with a local sum: the reduce-scatter moves all of it)
        direct = first and not st.mixed
        target = st.host_grad if direct else stage_for(st, self.ctx, self.compute_dtype)
        computed = self.ctx.record()
        stream = self.ctx.offload_stream
        issued: Future[None] | None = None
        copied: Event
        with self.ctx.on(stream):
            self.ctx.wait(computed, stream)
            if st.shard is not None and self.ctx.is_cuda:
                # issued by the host worker, the one thread that issues the runtime's collectives while
                # backward runs (its FIFO order is the same on every rank; two issuing threads could interleave
                # collectives differently on different ranks)
                copied = torch.cuda.Event()
                issued = self.worker.submit(
                    self._reduce_scatter_on_device, st, slot.grad, target, stream, copied, local
                )
                slot.issued.append(issued)
                st.host_work = issued
            elif st.shard is not None:
                if local:
                    assert st.user_grad is not None
                    local_grads.add_to_area(st.user_grad, slot.grad)
                self._reduce_scatter(st, slot.grad, target)
                copied = self.ctx.record(stream)
            else:
                target[:n].copy_(slot.grad[:n], non_blocking=True)
                copied = self.ctx.record(stream)
        slot.free_after.append(copied)
        if keep:
            if issued is not None:
                issued.result()  # `copied` is recorded once the worker issued the reduce-scatter
            self.ctx.wait(copied)
            slot.grad[:n].zero_()
        st.flushes += 1
        st.unaveraged = st.shard is None  # a shard arrives averaged
        st.touched |= st.in_slot
        st.in_slot.clear()
        events = [*st.pending_events, copied]
        st.pending_events = []
        if direct:
            st.pending_events = events
        else:
            st.host_work = self.worker.submit(self._absorb, st, events, first)
        self.counters.grad_flushes += 1
        self.counters.grad_flush_bytes += (st.shard.size if st.shard is not None else n) * self._esize

    def _waiting(self, st: ChunkState) -> bool:
        """The chunk is in this backward's issue order and its turn has not come yet."""
        return st.index in self._order[self._issued :]

    def _after_turn(self, st: ChunkState) -> bool:
        """The chunk is in this backward's issue order and its turn has come (a gradient now is a later one)."""
        return st.index in self._order[: self._issued]

    def _holds(self, st: ChunkState) -> bool:
        """An ordered chunk's flush before its turn (its completion with chunks ahead of it not issued, or a flush
        before its completion, e.g. its buffer taken for another chunk): no collective now (`_flush_local`); its
        reduce-scatter runs at its turn (`_turn`)."""
        if not self._waiting(st):
            return False
        return not (self._completing == st.index and self._order[self._issued] == st.index)

    def _flush_local(self, st: ChunkState, slot: Slot, *, keep: bool, late: bool = False) -> None:
        """A sharded chunk's flush inside `no_sync()`, or before its turn in a synchronising backward's order
        (`_holds`; reduce-scattered from `user_grad` at its turn, `_turn`): no collective. Its whole gradient area
        (this rank's own, un-averaged) goes into `user_grad`: overwritten after zero_grad, else added (`user_grad`
        then holds the chunk's whole gradient since zero_grad: the averaged one the last exposure showed, or the
        local sum).
        The host gradient is stale until the next synchronising flush overwrites it (`flushes` = 0).

        `late`: a flush after the chunk's turn (a block run again under re-entrant checkpointing): `user_grad`
        gathers this rank's gradients since the turn (overwritten by the first), and every rank adds their
        average to the shard at the end of backward (`_add_late`); the host gradient keeps the turn's average.
        Before session 27 such a flush was reduce-scattered at once, which paired only where every rank's backward
        got its later gradients in the same order: ranks running two blocks in opposite orders averaged one's
        chunk with the other's (0.12 off, silently), an output in the loss on one rank only aborted gloo."""
        assert st.shard is not None and self.worker is not None
        st.wait_host()  # host work may still read user_grad or the staging buffer (a speculative step's fill)
        if late:
            fresh = not st.late_sum
            st.late_sum = st.again = st.reused = True  # (`reused`: see `complete`)
        else:
            fresh = not st.local and st.flushes == 0
            st.local = True
            st.flushes = 0
        user = local_grads.whole_user_grad(st, self.ctx, self.compute_dtype)
        computed = self.ctx.record()
        stream = self.ctx.offload_stream
        issued: Future[None] | None = None
        copied: Event = None
        with self.ctx.on(stream):
            self.ctx.wait(computed, stream)
            if self.ctx.is_cuda:
                # on the host worker: piecewise through the pinned stage (see local_grads; not run on a GPU yet)
                copied = torch.cuda.Event()
                issued = self.worker.submit(
                    local_grads.accumulate_on_device, st, slot.grad, user, stream, copied, fresh
                )
                slot.issued.append(issued)
                st.host_work = issued
            else:
                local_grads.accumulate(user, slot.grad, fresh=fresh)
        slot.free_after.append(copied)
        if keep:
            if issued is not None:
                issued.result()
            self.ctx.wait(copied)
            slot.grad[: st.numel].zero_()
        st.touched |= st.in_slot
        st.in_slot.clear()
        self.counters.grad_flushes += 1
        self.counters.grad_flush_bytes += st.shard.total * self._esize

    def _reduce_scatter(self, st: ChunkState, area: torch.Tensor, target: torch.Tensor) -> None:
        """A sharded chunk's flush: the mean over the ranks of this rank's shard of the buffer's gradient `area`
        (zero padded to world_size shards by the upload) into `target` on the host. On a CPU device the area is
        host memory: reduce-scattered straight into `target`. On CUDA (NCCL; written, not run on a GPU yet) it
        is reduce-scattered into a device copy of the shard, then only the shard goes to the host."""
        assert st.shard is not None and self.group is not None
        sh = st.shard
        full = area[: sh.total]
        t0 = time.perf_counter()
        if not self.ctx.is_cuda:
            self.group.reduce_scatter_mean(target[: sh.size], full)
        else:
            shard = torch.empty(sh.size, dtype=full.dtype, device=full.device)
            self.group.reduce_scatter_mean(shard, full)
            target[: sh.size].copy_(shard, non_blocking=True)  # `shard` was made on this (offload) stream
        self.counters.grad_reduction_s += time.perf_counter() - t0
        self.counters.grad_reductions += 1
        self.counters.reduce_scatters += 1

    def _reduce_scatter_on_device(
        self,
        st: ChunkState,
        area: torch.Tensor,
        target: torch.Tensor,
        stream: torch.cuda.Stream | None,
        copied: torch.cuda.Event,
        local: bool,
    ) -> None:
        """Host worker (CUDA): the reduce-scatter and the shard's copy to the host on the offload stream (after
        the compute the flush waited for), then `copied` recorded there. `local`: the local sum of earlier
        no_sync backwards is added into the area first (written, not run on a GPU yet)."""
        with self.ctx.on(stream):
            if local:
                local_grads.add_to_area_on_device(st, area, stream)
            self._reduce_scatter(st, area, target)
            copied.record(stream)

    def _absorb(self, st: ChunkState, events: list[Event], first: bool) -> None:
        """Host worker: fold the staged gradient copy into the fp32 host gradient."""
        for ev in events:
            self.ctx.host_wait(ev)
        assert st.host_grad is not None and st.stage is not None
        if first:
            st.host_grad.copy_(st.stage)
        else:
            st.host_grad.add_(st.stage)

    def _submit_average(self, st: ChunkState) -> None:
        """Queue the average of the chunk's host gradient across the ranks, after its flushes and before
        its host step (the worker runs tasks in order). Averaging again after a later flush is still
        exact: the averaged part is the same on every rank."""
        assert self.worker is not None and self.group is not None
        st.unaveraged = False
        events = st.pending_events
        st.pending_events = []
        st.host_work = self.worker.submit(self._average_host, st, events)
        self.counters.grad_reductions += 1

    def _average_host(self, st: ChunkState, events: list[Event]) -> None:
        """Host worker: all-reduce (mean) the chunk's fp32 host gradient."""
        for ev in events:
            self.ctx.host_wait(ev)
        assert st.host_grad is not None and self.group is not None
        t0 = time.perf_counter()
        self.group.average_(st.host_grad[: st.numel])
        self.counters.grad_reduction_s += time.perf_counter() - t0

    def average_stragglers(self) -> None:
        """End of a synchronising backward, before `expose`: offloaded chunks holding gradients of earlier
        `no_sync` backwards that this backward did not complete (unused in it) are averaged too, in chunk
        order, so every rank steps the same gradient (a sharded chunk: its local sum reduce-scattered)."""
        if not self.reduce:
            return
        for st in self.states:
            if st.offloaded and st.unaveraged and not st.again:  # (`again`: averaged after `agree`)
                self._submit_average(st)
            elif st.local:
                self._submit_local_reduce_scatter(st)

    def _reduce_scatter_local(self, st: ChunkState) -> None:
        """Host worker: a sharded chunk's local sum (`user_grad`, host) reduce-scattered into its host gradient
        (through the staging buffer in mixed precision: the collective keeps the compute dtype)."""
        assert st.shard is not None and st.user_grad is not None and st.host_grad is not None
        assert self.group is not None
        target = (
            st.host_grad
            if st.host_grad.dtype == st.user_grad.dtype
            else stage_for(st, self.ctx, self.compute_dtype)
        )
        t0 = time.perf_counter()
        self.group.reduce_scatter_mean(target[: st.shard.size], st.user_grad)
        self.counters.grad_reduction_s += time.perf_counter() - t0
        if target is not st.host_grad:
            st.host_grad.copy_(target[: st.shard.size])

    def check_synchronised(self) -> None:
        """`optimizer.step()`: refuse to step a sharded chunk whose gradient is still this rank's local sum."""
        held = [st.index for st in self.states if st.local]
        if held:
            raise RuntimeError(
                f"optimizer.step(): sharded chunks {held} hold gradients of no_sync() backwards that no "
                "synchronising backward has reduced yet (each rank owns one shard, so it cannot step its own "
                "local gradient as DistributedDataParallel would); run the last micro-step's backward outside "
                "no_sync()"
            )

    def reduce_persistent(self) -> None:
        """End of a synchronising backward, after `agree` and `expose`: average across the ranks, in chunk order,
        the persistent chunks `agree` named (not averaged as backward completed them, or given a gradient after
        that on some rank); the early ones' parameters get their `.grad` views back."""
        if not self.reduce:
            return
        for st in self._now:
            self._average_area(st)
        self._end_early()

    def settle_persistent(self) -> None:
        """A backward that raised: the persistent chunks' early averages in flight are waited for (nothing else
        averaged; the job's ranks have parted ways), and their parameters get their `.grad` views back."""
        for st in self.states:
            self._settle_average(st)
        self._end_early()

    def _end_early(self) -> None:
        for st in self.states:
            if st.again:  # (a backward that raised: its later gradients are dropped, `user_grad` refilled)
                st.again = st.late_sum = False
                st.user_grad_filled = False
        self.overlap_persistent = False
        self._order, self._issued, self._ready = [], 0, set()
        self._agreed, self._now = [], []
        for st in self.states:
            if not st.early:
                continue
            views = self.grad_views(st)
            for j in st.touched:
                view = views[j]
                assert view is not None
                st.spec.entries[j].param.grad = view
            st.early = st.late = False

    def agree(self) -> None:
        """End of a synchronising backward, after every average of the order and the stragglers' were issued and
        before `expose`: the ranks agree, in one all-reduce of a mask, on which entries have a gradient.

        Persistent chunks: the union of the parameters with a gradient on any rank; one without a gradient here
        joins as zero, as under `DistributedDataParallel(find_unused_parameters=True)` (data-dependent unused
        parameters: an expert that got no token on this rank). Without it a chunk unused on one rank was left out
        of that rank's averages, so the ranks' all-reduces paired different chunks, and an unused parameter of a
        chunk used elsewhere sent its stale gradient of an earlier step. The same mask carries, per chunk, whether
        it is to be averaged now (not averaged early, or a gradient arrived after that): those chunks, the same on
        every rank, are averaged by `reduce_persistent`. An early-averaged chunk's entries without a gradient here
        were zeroed before its average (`average_early`): they hold the average now, and only get their `.grad`.

        Offloaded chunks averaged in this backward (`_agreed`): an entry with a gradient on some ranks only (its
        forward ran everywhere, its output reached the loss on some ranks: `joined` covers only what the forwards
        used) counts as touched on every rank (before session 26 the ranks stepped different entries of an averaged
        gradient and drifted apart); where the ranks' entries differed, the chunk's speculative step is undone on
        every rank (`HostSteps.rejoin`; `step()` takes it with the union) and `.grad` is filled again."""
        self._now = []
        if not self.reduce:
            return
        assert self.group is not None
        for st in self.states:
            st.wait_host()  # no collective of the host worker in flight: one issuer at a time
            self._settle_average(st)
        persistent = [st for st in self.states if not st.offloaded and st.grad is not None]
        offloaded = [self.states[c] for c in sorted(self._agreed)]
        if not persistent and not offloaded:
            return
        for st in persistent:
            # (an early one's `.grad` are None until `_end_early`: adopted before its average)
            if not st.early:
                self._adopt_user_grads(st)
        # per persistent chunk: "average now", then its entries with a gradient; per offloaded chunk: its entries,
        # then "a gradient after its turn" (`again`), "reused after a speculative step" (`reused`) and "stepped
        # without an undo backup" (`RuntimeOptions(undo_host_steps=False)`)
        rows = [
            [
                bool(st.touched) and (not st.early or st.late),
                *(j in st.touched for j in range(len(st.spec.entries))),
            ]
            for st in persistent
        ] + [
            [
                *(j in st.touched for j in range(len(st.spec.entries))),
                st.again,
                st.reused,
                st.stepped and not st.spec_backup,
            ]
            for st in offloaded
        ]
        mask = torch.tensor([b for row in rows for b in row], dtype=torch.int32)
        t0 = time.perf_counter()
        self.group.count_(mask)
        self.counters.control_s += time.perf_counter() - t0
        self.counters.control_checks += 1
        self._agreements += 1
        counts = mask.tolist()
        at = 0
        for st in persistent:
            n = len(st.spec.entries)
            if counts[at]:
                self._now.append(st)
            wanted = {j for j in range(n) if counts[at + 1 + j]} - st.touched
            at += n + 1
            for j in sorted(wanted):
                view = self._slot(st, j)  # (no slot: frozen here when wrapped, unfrozen on another rank)
                if not st.early:
                    view.zero_()
                st.spec.entries[j].param.grad = view
                st.touched.add(j)
        for st in offloaded:
            n = len(st.spec.entries)
            held = counts[at : at + n]
            again, reused, blind = counts[at + n : at + n + 3]
            at += n + 3
            st.reused = st.reused or reused > 0  # (the same on every rank: speculation decisions stay alike)
            partial = not all(k in (0, self.group.world_size) for k in held)
            if partial and blind:
                # a rank stepped with fewer entries than the union and cannot undo it: every rank says so here (the
                # rank that needed the undo alone raised before, and the others waited in their next collective;
                # raised too where no rank needed one: a rank that did not step, the others stepping the union)
                raise RuntimeError(
                    f"chunk runtime: the ranks' backwards gave gradients to different parameters of offloaded chunk "
                    f"{st.index} (an output that reaches the loss on some ranks only), so its overlapped host step "
                    "must be taken again with every rank's parameters, and RuntimeOptions(undo_host_steps=False) "
                    "keeps nothing to undo it with. Use undo_host_steps=True (the default) or "
                    "overlap_host_step=False."
                )
            if partial:
                # a speculative step taken before the union of entries: undone (`step()` takes the chunk again)
                assert self.host_steps is not None
                union = {j for j in range(n) if held[j]}
                self.host_steps.rejoin(st, changed=not union <= st.touched)
                st.touched |= union
            if again:
                # a step taken at the turn is undone on every rank (the steps taken there are alike; a rank whose
                # backward reused the chunk undid its step then)
                assert self.host_steps is not None
                if st.stepped:
                    self.host_steps.undo(st, why="another rank's chunk got a gradient after its turn")
                st.wait_host()
                if st.shard is None:
                    self._average_again(st)
                else:
                    self._add_late(st)
            if partial or again:
                # `.grad` filled again at `expose` on every rank (a sharded chunk's fill is an all-gather: a rank
                # that undid its step refills, so every rank does)
                st.user_grad_filled = False

    def _average_again(self, st: ChunkState) -> None:
        """End of backward, every rank (`agree`, after undoing a step): the replicated chunk got a gradient after
        its turn on some rank; its host gradient (averaged, plus this rank's later gradients) is averaged again,
        which is exact."""
        st.again = False
        st.unaveraged = True
        self._submit_average(st)

    def _add_late(self, st: ChunkState) -> None:
        """End of backward, every rank (`agree`, after undoing a step): the sharded chunk got gradients after its
        turn on some rank; each rank's since then (`late_sum`, zero where none) are reduce-scattered and their
        average added to the shard, which held the turn's average: exact."""
        assert self.worker is not None
        user = local_grads.whole_user_grad(st, self.ctx, self.compute_dtype)
        if not st.late_sum:
            user.zero_()
        st.again = st.late_sum = False
        events = st.pending_events
        st.pending_events = []
        st.host_work = self.worker.submit(self._reduce_scatter_late, st, events)
        self.counters.grad_reductions += 1
        self.counters.reduce_scatters += 1

    def _reduce_scatter_late(self, st: ChunkState, events: list[Event]) -> None:
        """Host worker: the average of the ranks' later gradients (`user_grad`) added to the chunk's shard of the
        host gradient, through the staging buffer (the collective keeps the compute dtype)."""
        for ev in events:
            self.ctx.host_wait(ev)
        assert st.shard is not None and st.user_grad is not None and st.host_grad is not None
        assert self.group is not None
        stage = stage_for(st, self.ctx, self.compute_dtype)
        t0 = time.perf_counter()
        self.group.reduce_scatter_mean(stage[: st.shard.size], st.user_grad)
        self.counters.grad_reduction_s += time.perf_counter() - t0
        st.host_grad[: st.shard.size].add_(stage[: st.shard.size])

    def check_same_use(self) -> None:
        """Start of a synchronising backward, before it issues any collective: the ranks compare, per
        offloaded chunk, whether the forward used it (its average runs as backward completes it)
        or it holds gradients of earlier `no_sync()` backwards only (averaged at the end). Where they differ
        (data-dependent unused parameters: layer drop, an expert alone in its chunk without tokens) the ranks'
        backwards would issue different collectives, which gloo aborts on and NCCL hangs in: this backward is
        deferred instead (the same verdict on every rank from the same gathered rows): no collective and no
        speculative step until its end, where every rank reduces, in chunk order, every chunk any rank holds a
        gradient of, a missing one as zero (`join_deferred`), as `DistributedDataParallel(
        find_unused_parameters=True)` averages a locally unused parameter. (Until session 11 every rank raised
        `UnusedParametersError`.) The same rows carry which entries of each chunk have a gradient to contribute
        (used by this forward or holding one since zero_grad): an entry with one on some ranks only (an expert
        that got no token here, in a chunk every rank used) is counted touched on every rank when its chunk
        completes (`ChunkState.joined`), so every rank steps it with the averaged gradient and shows it as
        `.grad`. (Before session 11 a rank stepped only the entries it got gradients for: the ranks' parameters
        drifted apart silently.) They also carry which persistent parameters the forward used: where every rank
        used the same ones, each persistent chunk is averaged as backward completes it (`average_early`; the
        ranks complete them in the same order), else all of them at the end (`reduce_persistent`). Issued on the
        host worker, the runtime's one issuer of collectives while its queued work (e.g. `async_step`'s) may
        still run (on the training thread without one)."""
        assert self.group is not None
        offloaded = [st for st in self.states if st.offloaded]
        persistent = [st for st in self.states if not st.offloaded and self.persistent_in_backward]
        if not offloaded and not persistent:
            return
        codes = [1 if st.expected else 2 if st.unaveraged or st.local else 0 for st in offloaded]
        # per entry: a gradient to contribute (used by this forward, or held since zero_grad: earlier no_sync
        # backwards' local gradient, or an averaged one being accumulated into)
        entries = [
            int(j in st.expected or j in st.touched) for st in offloaded for j in range(len(st.spec.entries))
        ]
        used = [int(j in st.expected) for st in persistent for j in range(len(st.spec.entries))]
        row = torch.tensor(codes + entries + used, dtype=torch.int32)
        gathered: list[torch.Tensor] = []
        t0 = time.perf_counter()
        if self.worker is not None:
            self.worker.submit(lambda: gathered.append(self.group.gather_rows(row))).result()  # type: ignore[union-attr]
        else:
            gathered.append(self.group.gather_rows(row))
        self.counters.control_s += time.perf_counter() - t0
        self.counters.control_checks += 1
        rows = gathered[0]
        head = len(codes) + len(entries)
        differ = [i for i in range(len(offloaded)) if len(set(rows[:, i].tolist())) > 1]
        self.overlap_persistent = (
            self.persistent_in_backward
            and bool(used)
            and not differ
            and bool((rows[:, head:] == rows[0, head:]).all())
        )
        # (the same on every rank: the rows say every rank's forward used the same persistent entries, and the
        # same offloaded chunks)
        used_chunks = [st.index for st in persistent if st.expected] if self.overlap_persistent else []
        used_offloaded = [st.index for st in offloaded if st.expected] if not differ else []
        self._order = sorted(used_chunks + used_offloaded, reverse=True)
        self._issued, self._ready = 0, set()
        self._agreed = used_offloaded
        # ranks holding a gradient of each entry
        by_entry = rows[:, len(offloaded) : head].sum(dim=0).tolist()
        at = 0
        for st in offloaded:
            n = len(st.spec.entries)
            st.joined = {j for j in range(n) if 0 < by_entry[at + j] < self.group.world_size}
            at += n
        if not differ:
            return
        # Some ranks' forwards skipped a whole offloaded chunk (layer drop, an expert alone in its chunk): this
        # backward's reductions would pair differently on the ranks. It runs as inside no_sync() (no collective
        # until its end, no speculative step), then every rank reduces, in chunk order, every chunk any rank holds
        # a gradient of, a missing one as zero (`join_deferred`, `average_stragglers`).
        self.deferred = True
        self.reduce = False
        self._deferred_chunks = [st.index for i, st in enumerate(offloaded) if rows[:, i].any()]
        self._agreed = list(self._deferred_chunks)
        self.counters.deferred_backwards += 1
        log.debug(
            "memplan: the ranks' forwards used different offloaded chunks (%s): this backward's reductions wait "
            "for its end",
            ", ".join(str(offloaded[i].index) for i in differ),
        )

    def join_deferred(self) -> None:
        """End of a deferred backward (`check_same_use`), before `average_stragglers`: a chunk some other rank
        holds a gradient of and this one does not joins with zeros (a replicated chunk's host gradient, a sharded
        chunk's local sum; an averaged gradient being accumulated into stays, as averaging it again is exact), and
        every chunk's entries held on some ranks count as touched; then this backward reduces again."""
        if not self.deferred:
            return
        self.deferred = False
        self.reduce = True
        for c in self._deferred_chunks:
            self._join_zero(self.states[c])
        self._deferred_chunks = []

    def grad_views(self, st: ChunkState) -> list[torch.Tensor | None]:
        """The persistent chunk's per-parameter gradient views, None outside its gradient area (frozen
        parameters; see `chunks.gradient_span`). Made once per gradient area (it moves only when widened)."""
        cached = self._grad_views.get(st.index)
        if cached is None or cached[0] is not st.grad:
            cached = self._grad_views[st.index] = (st.grad, chunk_grad_views(st))
        return cached[1]

    def _widen(self, st: ChunkState) -> None:
        """A gradient arrived for a parameter without a slot in the chunk's gradient area (frozen when the
        runtime was applied): the area becomes the whole chunk's, beyond what the plan counted."""
        old_views = self.grad_views(st) if st.grad is not None else [None] * len(st.spec.entries)
        # a device-sharded chunk's area is zero padded to N*s (the all-reduce and its shard's slice read it whole)
        size = st.shard.total if st.own is not None and st.shard is not None else st.numel
        st.grad = self.ctx.device_empty(size, self.compute_dtype).zero_()
        st.grad_offsets = [e.offset for e in st.spec.entries]
        for e, was, now in zip(st.spec.entries, old_views, self.grad_views(st), strict=True):
            if was is not None and now is not None:
                now.copy_(was)
                if e.param.grad is was:
                    e.param.grad = now

    # ==================================================================== gradients the user sees
    def expose(self) -> None:
        """End of backward: every offloaded parameter with a gradient gets `.grad`, a view of its chunk's
        `user_grad` (host, compute dtype), so code that reads or scales `.grad` (torch's clip_grad_norm_,
        Accelerate, the Trainer) sees every gradient. In-flight host steps are settled first, so the
        user never reads a gradient the worker is writing."""
        assert self.worker is not None and self.residency is not None and self.host_steps is not None
        for st in self.states:
            if st.offloaded and st.touched and not st.user_grad_filled:
                if st.shard is not None and self.local:
                    # no collective inside no_sync(): user_grad holds the local sum, or (not used in this
                    # backward) what the last exposure showed
                    continue
                events = st.pending_events
                st.pending_events = []
                st.host_work = self.worker.submit(self.host_steps.fill_user_grad, st, events)
                st.user_grad_filled = True
        for st in self.states:
            if not st.offloaded or not st.touched:
                continue
            st.wait_host()
            assert st.user_grad is not None
            # `.grad` must be on the parameter's device (the host copy), and the buffer is stale once the
            # chunk is stepped (a chunk still pinned when it completed, e.g. by a recomputation, stayed)
            self.residency.evict_chunk(st)
            if st.stepped and st.spec_backup and not st.mixed and st.shard is None and not st.node_shared:
                self.residency.show_before_step(st)  # parameters change in step(), as in plain PyTorch
            # a gradient assigned by hand before this backward to a parameter it gave none (`p.grad = g`, then
            # `loss.backward(inputs=...)`): kept, as torch keeps it (before session 23 it was dropped here)
            assigned = self._assigned(st)
            if assigned and self.group is None:
                self._adopt_offloaded(st, assigned, filled=True)
            elif assigned:
                self._assigned_lost = self._assigned_lost or st.spec.entries[assigned[0]].name
            gv = self._user_grad_views(st)
            for j, e in enumerate(st.spec.entries):
                e.param.grad = gv[j] if j in st.touched else None
            st.exposed = True
            st.user_grad_filled = False

    def _user_grad_views(self, st: ChunkState) -> list[torch.Tensor]:
        return self.views.get(ViewCache.USER_GRAD, st, st.user_grad)

    def reconcile(self, st: ChunkState) -> bool:
        """Make the host gradient what the user's `.grad` now says; True when it changed since exposure.

        A `.grad` replaced by another tensor is copied in, one set to None drops the parameter from the
        step (as torch skips it). The gradient is compared by value: torch's clip multiplies by its clamped
        coefficient even when it is 1.0 (no change), and version counters cannot tell: they bump without a
        change, and `torch._foreach_mul_` on CPU was seen changing values without bumping them (torch 2.13)."""
        if not st.exposed:
            return False
        assert st.user_grad is not None and st.host_grad is not None
        changed = False
        gv = self._user_grad_views(st)
        for j in sorted(st.touched):
            g = st.spec.entries[j].param.grad
            if g is None:
                # set to None outside `zero_grad` (`nn.Module.zero_grad` of a torch.compile wrapper, which
                # Trainer calls, or user code): as in torch, the next backward starts a fresh gradient
                st.touched.discard(j)
                gv[j].zero_()
                changed = True
            elif g is not gv[j]:
                gv[j].copy_(g)
        if st.local:
            return changed  # user_grad is the local sum itself: the edits are in it, host_grad is stale
        # a sharded chunk: this rank's own shard only (each rank decides for its shard; no collective here)
        seen = st.user_grad if st.shard is None else st.user_grad[st.shard.start : st.shard.end]
        if not torch.equal(seen, st.host_grad.to(seen.dtype)):
            st.host_grad.copy_(seen)
            changed = True
        return changed

    def adopt_assigned(self) -> None:
        """`optimizer.step()`: gradients the user assigned by hand (`p.grad = g`, e.g. from `torch.autograd.grad`,
        which runs no gradient hook, or with no backward at all) join their chunk's gradient, so the step uses
        them as plain PyTorch's does (before this, session 23, they were ignored and the step changed nothing).
        An assigned gradient replaces what the chunk held for that parameter, as `p.grad = g` does in torch.

        Refused in a job of several ranks: the gradients are averaged across the ranks by backward's hooks, and
        a chunk sharded across them holds one rank's shard of its state only."""
        lost, self._assigned_lost = self._assigned_lost, None
        if lost is not None:
            raise AssignedGradientError(assigned_in_a_group(lost))
        for st in self.states:
            assigned = self._assigned(st)
            if not assigned:
                continue
            if self.group is not None:
                raise AssignedGradientError(assigned_in_a_group(st.spec.entries[assigned[0]].name))
            if st.offloaded:
                self._adopt_offloaded(st, assigned)
            else:
                for j in assigned:
                    g = st.spec.entries[j].param.grad
                    assert g is not None
                    self._into_area(st, j, g)

    def _assigned(self, st: ChunkState) -> list[int]:
        """The chunk's parameters whose `.grad` the runtime did not set: a persistent chunk's or an exposed
        offloaded chunk's parameters outside `touched` (a persistent chunk's own gradient view excepted); any
        `.grad` of an offloaded chunk not exposed (the runtime leaves those None)."""
        entries = st.spec.entries
        if st.offloaded and not st.exposed:
            return [j for j, e in enumerate(entries) if e.param.grad is not None]
        views = self.grad_views(st) if not st.offloaded and st.grad is not None else [None] * len(entries)
        return [
            j
            for j, (e, v) in enumerate(zip(entries, views, strict=True))
            if j not in st.touched and e.param.grad is not None and e.param.grad is not v
        ]

    def _adopt_offloaded(self, st: ChunkState, assigned: list[int], *, filled: bool = False) -> None:
        """The assigned gradients into the offloaded chunk's host gradient, then exposed as after a backward (every
        parameter with a gradient shows `.grad`, a view of `user_grad`), so `reconcile` and the step see them.
        `filled`: `user_grad` holds the host gradient already (at the end of backward)."""
        self._settle_host_grad(st)
        assert st.host_grad is not None
        # the host gradient holds nothing since zero_grad: the positions not assigned read 0
        if st.flushes == 0:
            st.host_grad.zero_()
            st.flushes = 1
        user = local_grads.whole_user_grad(st, self.ctx, self.compute_dtype)
        if not st.exposed and not filled:
            user.copy_(st.host_grad)  # gradients of earlier backwards not zeroed, which `.grad` then shows
        gv = self._user_grad_views(st)
        for j in assigned:
            e = st.spec.entries[j]
            g = e.param.grad
            assert g is not None
            st.host_grad[e.offset : e.end].copy_(g.reshape(-1))
            gv[j].copy_(g)
            st.touched.add(j)
        for j in st.touched:
            st.spec.entries[j].param.grad = gv[j]
        st.exposed = True

    def _zero_some(self, st: ChunkState, kept: set[int], *, set_to_none: bool) -> bool:
        """`zero` of the chunk's entries other than `kept` (parameters with a gradient the optimizer does not
        hold), whose gradients stay and accumulate: the cleared entries' ranges of the gradient are zeroed, and
        an offloaded chunk's next flush adds to its host gradient (`flushes` > 0, the `set_to_none=False` path's
        state). False where this is not done (a device-sharded chunk; a host-sharded one whose `.grad` was not
        shown since its last synchronising backward: its `user_grad` is the whole gradient the next turn's
        reduce-scatter carries): the caller forgets every entry's gradient, as before session 27."""
        cleared = st.touched - kept
        if st.own is not None or (st.offloaded and st.shard is not None and (st.local or not st.exposed)):
            return False
        entries = st.spec.entries
        if not st.offloaded:
            views = self.grad_views(st)
            for j in cleared:
                view = views[j]
                if set_to_none:
                    entries[j].param.grad = None
                elif view is not None:
                    view.zero_()
        else:
            assert self.host_steps is not None and st.host_grad is not None
            if st.stepped:
                self.host_steps.undo(st, why="zero_grad() without optimizer.step()")
            self._settle_host_grad(st)
            lo, hi = (st.shard.start, st.shard.end) if st.shard is not None else (0, st.numel)
            for j in cleared:
                e = entries[j]
                a, b = max(e.offset, lo), min(e.end, hi)
                if a < b:
                    st.host_grad[a - lo : b - lo].zero_()
                if st.user_grad is not None:
                    st.user_grad[e.offset : e.end].zero_()
                if set_to_none and st.exposed:
                    e.param.grad = None
            st.flushes = max(st.flushes, 1)  # the next flush adds: the kept gradients stay
            st.unaveraged = False
        if set_to_none:
            st.touched -= cleared
        return True

    def _settle_host_grad(self, st: ChunkState) -> None:
        """Before the training thread writes an offloaded chunk's host gradient: the host work on the chunk and the
        gradient copies into it are done."""
        st.wait_host()
        for ev in st.pending_events:
            self.ctx.host_wait(ev)
        st.pending_events = []

    def sync_persistent(self, st: ChunkState) -> None:
        """A persistent chunk steps from its gradient area, which its parameters' `.grad` view: a `.grad`
        the user replaced by another tensor is copied in, one set to None is not stepped (as in torch)."""
        gv = self.grad_views(st)
        for j in sorted(st.touched):
            g, view = st.spec.entries[j].param.grad, gv[j]
            if g is None:
                st.touched.discard(j)
            elif g is not view:
                assert view is not None  # a touched parameter's gradient arrived in the area (`receive`)
                view.copy_(g)
                st.spec.entries[j].param.grad = gv[j]

    def retract(self) -> None:
        """Before a training forward: the user's edits go into the host gradients, `.grad` of offloaded
        parameters goes back to None (the next backward adds on the host), and a speculative step that no
        `optimizer.step()` confirmed is undone (gradient accumulation: the gradient is not final)."""
        for st in self.states:
            if not st.offloaded or not (st.exposed or st.stepped):
                continue
            assert self.host_steps is not None
            st.wait_host()
            self.reconcile(st)
            if st.stepped:
                self.host_steps.undo(
                    st, why="another backward pass started before optimizer.step() (gradient accumulation)"
                )
            if st.exposed:
                for e in st.spec.entries:
                    e.param.grad = None
                st.exposed = False

    @torch.no_grad()
    def zero(self, *, set_to_none: bool = True, held: frozenset[int] | None = None) -> None:
        """`zero_grad`: forget the gradients of every chunk (a speculative step no `step()` confirmed is undone).
        `held`: the ids of the parameters the optimizer holds (its `zero_grad`; None: `model.zero_grad()`, every
        parameter). A parameter with a gradient that the optimizer does not hold keeps it, as in plain PyTorch
        (`_zero_some`; before session 27 every chunk's gradients were forgotten, so `clip_grad_norm_` over
        `model.parameters()` saw another norm than plain PyTorch's)."""
        for st in self.states:
            if held is not None:
                kept = {j for j in st.touched if id(st.spec.entries[j].param) not in held}
                if kept and self._zero_some(st, kept, set_to_none=set_to_none):
                    continue
            if set_to_none:
                st.touched = set()
            # else: the parameters with a gradient keep it, zeroed (torch's zero_grad(set_to_none=False) leaves a
            # parameter without one without; before session 23 every trainable parameter was marked, and those
            # without a gradient were stepped with zeros)
            if not st.offloaded:
                if set_to_none:
                    # as in plain PyTorch: no gradient until backward makes one; the gradient hook copies it
                    # into the chunk's gradient area and points `.grad` there. (Zeroing the area and letting
                    # backward accumulate into it cost a memset and an add pass over every gradient.)
                    for e in st.spec.entries:
                        e.param.grad = None
                    continue
                if st.grad is None:
                    continue  # frozen parameters only: no gradient area, no `.grad`
                st.grad.zero_()
                for j, (e, g) in enumerate(zip(st.spec.entries, self.grad_views(st), strict=True)):
                    if g is not None and j in st.touched and e.param.grad is not g:
                        e.param.grad = g
                continue
            assert self.host_steps is not None
            if st.stepped:  # a speculative step no optimizer.step() confirmed: skipped, as torch would
                self.host_steps.undo(st, why="zero_grad() without optimizer.step()")
            st.flushes = 0
            st.unaveraged = False
            st.local = False
            st.user_grad_filled = False
            if st.exposed and set_to_none:
                for e in st.spec.entries:
                    e.param.grad = None
                st.exposed = False
            if not set_to_none:
                self._settle_host_grad(st)
                assert st.host_grad is not None
                st.host_grad.zero_()
                st.flushes = 1
                if st.exposed:  # `.grad` stays, zeroed, as in plain PyTorch
                    assert st.user_grad is not None
                    st.user_grad.zero_()
                elif st.shard is not None:
                    # a no_sync flush adds into user_grad (flushes > 0): it must hold the (zero) gradient too
                    local_grads.whole_user_grad(st, self.ctx, self.compute_dtype).zero_()
