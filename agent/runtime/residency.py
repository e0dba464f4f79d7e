"""Residency of offloaded chunks (FSDP2's param-group role): which chunk is in which device buffer.

`acquire` makes a chunk resident (a hit, or a demand upload into the Belady victim's buffer) and prefetches
the next chunks of the recorded access order into buffers whose chunks are needed later or never;
`upload` (FSDP2's `unshard`) copies a chunk's host copy into a buffer on the upload stream and points the
parameters there; `evict` (`reshard`) flushes the chunk's pending gradients (the gradient flow's job,
called back), points the parameters at the host copy (copying the buffer back first when user code wrote a
parameter there in place: `_write_back`) and frees the buffer once compute has read it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from agent.runtime.accounting import Counters
from agent.runtime.buffers import BufferPool, Slot
from agent.runtime.chunks import ChunkState, ShownBackup, ViewCache, bind
from agent.runtime.device import DeviceContext, Event, element_size
from agent.runtime.layout import ChunkLayout
from agent.runtime.options import RuntimeOptions
from agent.runtime.schedule import AccessSchedule
from agent.runtime.timing import EVICT, UPLOAD, RuntimeTiming, section

log = logging.getLogger(__name__)


class ChunkResidency:
    """Moves offloaded chunks between their host copies and the device buffers, one training thread."""

    def __init__(
        self,
        states: list[ChunkState],
        layout: ChunkLayout,
        ctx: DeviceContext,
        options: RuntimeOptions,
        counters: Counters,
        schedule: AccessSchedule,
        views: ViewCache,
        timing: RuntimeTiming,
    ) -> None:
        self.states = states
        self.layout = layout
        self.ctx = ctx
        self.options = options
        self.counters = counters
        self.schedule = schedule
        self.views = views
        self.timing = timing
        self.pool = BufferPool(ctx, layout.n_buffers, layout.buffer_numel, layout.compute_dtype)
        self.slot_by_storage = self.pool.storage_ids()
        # set by the manager: flush a chunk's gradients still in its buffer before the buffer is reused
        self.flush: Callable[[ChunkState, Slot], None] = _no_flush
        self._clock = 0
        # chunks whose saved tensors the running backward node has unpacked: it is about to read them,
        # so no upload may overwrite their buffers until the next node runs
        self._node: Any = None
        self._node_chunks: set[int] = set()
        self._sample_offsets: dict[int, torch.Tensor] = {}  # per chunk: `_sample_at`
        self._warned_write_back = False
        self._warned_shared_write = False
        self.upload_timings: list[tuple[Event, Event]] = []  # (start, end) of each upload
        self.stall_timings: list[tuple[Event, Event]] = []  # (compute reached the wait, upload done)
        self._esize = element_size(layout.compute_dtype)

    def acquire(self, c: int, *, pin: bool = False) -> Slot:
        """Make chunk `c` resident (pinned for the caller when `pin`), then prefetch what comes next."""
        st = self.states[c]
        self._clock += 1
        self.schedule.demand(c)
        if st.slot is None:
            self.upload(st, self._victim(demand=True))
            self.counters.demand_uploads += 1
        else:
            self.counters.resident_hits += 1
        slot = self.pool.slots[st.slot]  # type: ignore[index]
        slot.last_use = self._clock
        if pin:
            slot.pins += 1
        if self.options.measure_uploads and st.ready is not None:
            self.stall_timings.append((self.ctx.record(timing=True), st.ready))
        self.ctx.wait(st.ready)
        self.prefetch()
        return slot

    def note_unpacked(self, c: int) -> None:
        """The running autograd node unpacked a saved tensor of chunk `c`: keep its buffer until the next node."""
        node = torch._C._current_autograd_node()
        if node is not self._node:
            self._node, self._node_chunks = node, set()
        self._node_chunks.add(c)

    def forget_nodes(self) -> None:
        """End of backward: no node reads anything any more."""
        self._node = None
        self._node_chunks = set()

    def _victim(self, *, demand: bool, before: float = float("inf")) -> Slot | None:
        for slot in self.pool.slots:
            if slot.chunk is None:
                return slot
        # the chunks the running backward node unpacked; a node that is no longer running reads nothing (a
        # recompute inside a later node's unpack must be able to evict what an earlier node used)
        node_chunks = self._node_chunks if torch._C._current_autograd_node() is self._node else set()
        candidates = [s for s in self.pool.slots if s.pins == 0 and s.chunk not in node_chunks]
        if not candidates:
            if demand:
                held = [s.chunk for s in self.pool.slots]
                raise RuntimeError(
                    f"chunk runtime: all {len(self.pool.slots)} device buffers hold chunks in use {held}; "
                    "the plan needs more buffers (policy.n_buffers) for this model"
                    + (
                        " (chunks recomputed in backward by activation checkpointing stay resident until "
                        "their gradients are complete; two forwards with gradients before one backward, their "
                        "losses summed, recompute both: run one forward on the batches concatenated, or a "
                        "forward and its backward in turn for each)"
                        if any(self.states[c].recompute_pins for c in held if c is not None)
                        else ""
                    )
                )
            return None
        best = max(candidates, key=lambda s: (self.schedule.next_use(s.chunk), -s.last_use))  # type: ignore[arg-type]
        if not demand and self.schedule.next_use(best.chunk) <= before:  # type: ignore[arg-type]
            return None
        return best

    def prefetch(self) -> None:
        """Upload the next chunks of the access order while a buffer holds one needed later (or never)."""
        for t in self.schedule.upcoming(len(self.pool.slots) - 1):
            st = self.states[t]
            if st.slot is not None or not st.offloaded:
                continue
            if st.host_work is not None and not st.host_work.done() and not self.layout.sharded:
                # its host step is still running: do not block the training thread for a prefetch. With sharded
                # chunks the upload waits instead: prefetching may evict a chunk whose gradients are still in its
                # buffer, and that flush is a collective: where it happens must not depend on timing, or ranks
                # would issue their collectives in different orders (issue 20)
                break
            victim = self._victim(demand=False, before=self.schedule.next_use(t))
            if victim is None:
                break
            self.upload(st, victim)
            self.counters.prefetches += 1

    @section(UPLOAD)
    def upload(self, st: ChunkState, slot: Slot | None) -> None:
        """Copy the chunk's host copy into `slot` (evicting its chunk) and point the parameters there."""
        assert slot is not None and st.host_params is not None
        if slot.chunk is not None:
            self.evict(slot)
        # the host step must have finished writing the upload source (a sharded chunk: and every rank's stepped
        # shard must be in it: the all-gather into a private copy, or the barrier after which every rank has
        # written its shard of a node-shared copy, queued after the steps at optimizer.step())
        st.wait_host()
        if st.node_shared:
            self._check_shared_writes(st)
        n = st.numel
        stream = self.ctx.upload_stream
        for issued in slot.issued:
            issued.result()
        slot.issued.clear()
        with self.ctx.on(stream):
            for ev in slot.free_after:
                self.ctx.wait(ev, stream)
            slot.free_after.clear()
            timing = self.options.measure_uploads
            start = self.ctx.record(stream, timing=True) if timing else None
            slot.params[:n].copy_(st.host_params[:n], non_blocking=True)
            # a sharded chunk's gradient area is reduce-scattered whole: its padding up to world_size shards too
            slot.grad[: st.shard.total if st.shard is not None else n].zero_()
            st.ready = self.ctx.record(stream, timing=timing)
            if start is not None:
                self.upload_timings.append((start, st.ready))
        slot.chunk = st.index
        st.slot = slot.index
        self._note_written(st)
        bind(slot.params, st.spec.entries, self.views.get(slot.index, st, slot.params))
        st.shown_backup = None
        st.slot_versions = st.param_versions()
        self.counters.uploads += 1
        self.counters.upload_bytes += n * self._esize

    @section(EVICT)
    def evict(self, slot: Slot) -> None:
        """Release the buffer: flush the chunk's pending gradients, point its parameters at the host copy."""
        assert slot.chunk is not None
        st = self.states[slot.chunk]
        if st.in_slot:
            self.flush(st, slot)
        slot.free_after.append(self.ctx.record())  # compute that read the buffer so far
        assert st.host_params is not None
        if st.slot_versions != st.param_versions():
            self._write_back(st, slot)
        bind(st.host_params, st.spec.entries, self.views.get(ViewCache.HOST, st, st.host_params))
        if st.node_shared:
            st.host_versions = st.param_versions()
        slot.chunk = None
        st.slot = None
        st.ready = None
        self.counters.evictions += 1

    def _check_shared_writes(self, st: ChunkState) -> None:
        """A node-shared chunk about to be uploaded: user code wrote one of its parameters in place while they
        pointed at the node's shared host copy (`p.mul_(0.9)` after step(), outside forward). Every rank of the
        node that runs that code writes the same memory, so the write is applied once per rank (0.9 became 0.81:
        review, session 27), racing with the others. Said once (NOT CORRECTED: the write happened); an idempotent
        write (`copy_`, `clamp_`) is right, and `load_state_dict` is the runtime's own path."""
        before, st.host_versions = st.host_versions, None
        if before is None or self._warned_shared_write:
            return
        for e, v, now in zip(st.spec.entries, before, st.param_versions(), strict=True):
            if now != v:
                self._warned_shared_write = True
                log.warning(
                    "memplan: parameter %r was written in place while it pointed at the compute copy this node's "
                    "ranks share (RuntimeOptions.share_compute_copy): every rank's write lands in the same memory, "
                    "so a write that is not idempotent (p.mul_(0.9)) is applied once per rank. Write through "
                    "model.load_state_dict(), or use RuntimeOptions(share_compute_copy=False)",
                    e.name,
                )
                return

    def _write_back(self, st: ChunkState, slot: Slot) -> None:
        """User code wrote a parameter in place while its chunk sat in `slot` (say `p.copy_(w)` after an
        evaluation left the chunk resident): uploads come from the host copy, so the write would be lost at this
        eviction (session 22 review). Copy the buffer back: into the host copy and, in mixed precision, the fp32
        master the host step starts from. A chunk sharded across the ranks is not written back (its master is
        this rank's shard, and a write on one rank would leave the ranks apart): said once."""
        if st.shard is not None or st.node_shared:
            if not self._warned_write_back:
                self._warned_write_back = True
                log.warning(
                    "memplan: a parameter of offloaded chunk %d (sharded across the ranks) was written in place "
                    "while in a device buffer; the write is not kept. Write parameters before agent.wrap, or "
                    "through optimizer.step()",
                    st.index,
                )
            return
        assert st.host_params is not None and st.master is not None
        st.wait_host()  # no host step may be writing the host copy
        n = st.numel
        self.ctx.host_wait(self.ctx.record())  # the device work that wrote the buffer
        st.host_params[:n].copy_(slot.params[:n])
        if st.mixed:
            st.master[:n].copy_(st.host_params[:n])
        self.counters.write_backs += 1

    def evict_chunk(self, st: ChunkState) -> None:
        """Evict `st` if it is resident (else point its parameters at the host copy, in case they showed the
        values before a speculative step: `show_before_step`)."""
        if st.slot is not None:
            self.evict(self.pool.slots[st.slot])
        elif st.shown_backup is not None:
            self.show_host(st)

    def _sample_at(self, st: ChunkState) -> torch.Tensor:
        """Offsets of the first, middle and last element of every parameter of the chunk (cached)."""
        at = self._sample_offsets.get(st.index)
        if at is None:
            offsets = sorted(
                {
                    o
                    for e in st.spec.entries
                    if e.numel
                    for o in (e.offset, e.offset + e.numel // 2, e.end - 1)
                }
            )
            at = self._sample_offsets[st.index] = torch.tensor(offsets, dtype=torch.long)
        return at

    def show_before_step(self, st: ChunkState) -> None:
        """End of backward, chunk evicted, its speculative step done: the parameters show the values before the
        step (`backup_master`) until `optimizer.step()` settles it, as in plain PyTorch, where parameters change
        only in `step()` (user code between backward and step reads them: an L2 term added to `.grad` by hand,
        a norm logged). Only where the master is the compute copy itself (fp32 parameters, not sharded): the
        backup then has its dtype and layout, and pointing the parameters at it copies nothing."""
        assert st.slot is None and st.backup_master is not None
        bind(st.backup_master, st.spec.entries, self.views.get(ViewCache.BACKUP, st, st.backup_master))
        at = self._sample_at(st)
        st.shown_backup = ShownBackup(st.param_versions(), at, st.backup_master[at])

    def _note_written(self, st: ChunkState) -> None:
        """Set `st.written` when user code wrote a parameter while it showed the values before the step: an
        in-place op on it (its version counter), or a write through `.data` that changed a sampled element
        (`ShownBackup`; one that changes none of them, e.g. a clamp of a few elements, goes unseen)."""
        shown = st.shown_backup
        if shown is None or st.written:
            return
        assert st.backup_master is not None
        if shown.versions != st.param_versions() or not torch.equal(
            st.backup_master[shown.sample_at], shown.samples
        ):
            st.written = True

    def written_before_step(self, st: ChunkState) -> bool:
        """Whether user code wrote a parameter while it showed the values before the step (since then)."""
        self._note_written(st)
        return st.written

    def show_host(self, st: ChunkState) -> None:
        """Point the (evicted) chunk's parameters at its host copy again (a write to the values before the step
        seen so far is kept in `st.written`)."""
        assert st.slot is None and st.host_params is not None
        self._note_written(st)
        bind(st.host_params, st.spec.entries, self.views.get(ViewCache.HOST, st, st.host_params))
        st.shown_backup = None

    def bound_views(self, st: ChunkState) -> list[torch.Tensor]:
        """The views the offloaded chunk's parameters point at now: its buffer's, the values before a speculative
        step (`show_before_step`) or its host copy's."""
        if st.slot is not None:
            slot = self.pool.slots[st.slot]
            return self.views.get(slot.index, st, slot.params)
        if st.shown_backup is not None:
            return self.views.get(ViewCache.BACKUP, st, st.backup_master)
        return self.views.get(ViewCache.HOST, st, st.host_params)

    def evict_all(self) -> None:
        """Release every buffer. (Parameters showing the values before a speculative step keep showing them: a
        state dict taken between backward and `step()` holds those, as plain PyTorch's does, and one loaded there
        writes them, which `step()` then sees as a write and steps from.)"""
        for slot in self.pool.slots:
            if slot.chunk is not None:
                self.evict(slot)

    def unpin_all(self) -> None:
        """End of backward: no module or recomputation holds a buffer any more."""
        for slot in self.pool.slots:
            slot.pins = 0


def _no_flush(st: ChunkState, slot: Slot) -> None:
    raise AssertionError("ChunkResidency.flush: not wired")
