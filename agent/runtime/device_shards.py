"""Device-sharded persistent chunks (issue 20, ZeRO-3 on the device; docs/architecture/runtime.md "Sharded chunks").

A PERSISTENT chunk with `Chunk.sharded` in a plan for N ranks keeps on the device only this rank's shard (`s`
elements, `shards.py`) of its compute copy (`ChunkState.own`), of its fp32 master (mixed precision) and of its
optimizer state, which the chunk's stepper steps on the device with the user's implementation flags. Its
`params` tensor is the whole compute copy (N*s elements), whose storage exists only while the chunk is GATHERED:

- `issue`: the storage is resized to N*s elements and an all-gather of every rank's `own` into it is started
  (`async_op`: on NCCL it runs on the backend's stream and overlaps compute; through the host worker on CUDA when
  the runtime has one, so one thread issues every collective in one order on every rank);
- `gather`: waits for it and points the parameters at their views of `params`;
- `release`: points the parameters at zero-stride placeholders (one element per dtype: the right shape, no
  memory; a read shows NaN, so a use outside the owning module's forward is loud, not silently zeros; a write
  fails) and resizes the storage to 0 bytes. Tensors autograd saved in
  forward (the parameter itself, `weight.t()`) keep the storage object: the pre-backward gather refills the same
  storage before any backward node reads them (what FSDP1 does with its flat parameter).

Forward: a pre-hook on each module owning parameters of such chunks gathers them (and prefetches the next chunk
of the access order recorded in the first iteration); its post-hook releases a chunk no running module holds and
the access order does not use next, and registers a pre-backward hook (`register_multi_grad_hook` on the module's
outputs, as FSDP2) that gathers the chunk again (and prefetches the next of the recorded backward order). A chunk
is released in backward once every gradient expected of it has arrived (kept to the end of backward when it holds
frozen parameters: a node may still read one), and at the end of backward.

Gradients: the gradient area stays whole on the device, in the chunk's layout (the parameters' `.grad` view it,
DDP-exact for `clip_grad_norm_` and `no_sync`, as a replicated persistent chunk's); it is averaged with one
all-reduce at the end of a synchronising backward (the same bytes as a reduce-scatter into the shard followed by
the `.grad` fill all-gather), and the stepper reads its own shard's slice. The gradient is therefore NOT sharded:
ZeRO-3 for the parameters, the master and the optimizer state.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from agent.runtime.accounting import Counters
from agent.runtime.chunks import ChunkState, views
from agent.runtime.device import DeviceContext
from agent.runtime.host_worker import HostWorker
from agent.runtime.process_group import RankArrivalError, RankGroup, UnusedParametersError, all_gather_single
from agent.runtime.schedule import Direction

AGREE_ROW = 4
"""int32 per rank in an agreement: the chunk (-1: a pass ends, -2: a backward begins), the direction (its code,
`_DIRECTIONS`), grad enabled, backwards begun."""
_DIRECTIONS: tuple[Direction | None, ...] = (None, *Direction)
"""An agreement row's direction code: its index here (0: outside forward/backward)."""


def placeholder(dtype: torch.dtype, device: torch.device, shape: torch.Size) -> torch.Tensor:
    """A released parameter: one element expanded to `shape` (zero strides, no memory; a write fails), NaN for
    floating dtypes (zeros otherwise), so a read outside forward/backward poisons what it computes."""
    fill = float("nan") if dtype.is_floating_point or dtype.is_complex else 0
    return torch.full((), fill, dtype=dtype, device=device).expand(shape)


class DeviceShards:
    """Gathers and releases the device-sharded persistent chunks; one training thread."""

    def __init__(
        self,
        states: list[ChunkState],
        group: RankGroup,
        ctx: DeviceContext,
        counters: Counters,
        worker: HostWorker | None,
    ) -> None:
        self.states = {st.index: st for st in states if st.shard is not None and not st.offloaded}
        self.group = group
        self.ctx = ctx
        self.counters = counters
        # on CUDA the host worker issues the offloaded chunks' collectives during backward: ours go through it
        # too, so every rank issues them in one order (on CPU the worker runs inline)
        self.worker = worker if worker is not None and ctx.is_cuda else None
        self._issuer = worker  # the runtime's one issuer of collectives (inline on CPU): the agreements' too
        self._pending: dict[
            int, Any
        ] = {}  # chunk -> the Work (or the worker's future of it) of its all-gather
        self._full_views: dict[int, list[torch.Tensor]] = {}
        self._placeholders: dict[int, list[torch.Tensor]] = {}
        for st in self.states.values():
            assert st.params is not None
            self._full_views[st.index] = views(st.params, st.spec.entries)
            self._placeholders[st.index] = [
                placeholder(e.param.dtype, st.params.device, e.shape) for e in st.spec.entries
            ]
        self.pins: dict[int, int] = dict.fromkeys(self.states, 0)
        # access order per direction, recorded in the first iteration that runs it; the position in it
        self._order: dict[Direction, list[int]] = {}
        self._recording: list[int] | None = None
        self._direction: Direction | None = None
        self._pos = 0
        self.max_gathered_bytes = 0  # the most bytes of gathered copies held at once (memory report)
        self._disagreed = False  # an `agree` raised on every rank; its forward/backward has not ended yet
        # the pass every rank must be in at an `agree` (`start` sets them): how many backwards began before it
        # and whether the forward began with grad enabled
        self._backwards = 0
        self._grad = True
        # `agree`: this rank's (chunk, direction, grad, backwards) and every rank's, on the backend's device
        self._agree_row = torch.zeros(AGREE_ROW, dtype=torch.int32, device=group.device)
        self._agree_rows = torch.zeros(AGREE_ROW * group.world_size, dtype=torch.int32, device=group.device)

    def __contains__(self, c: int) -> bool:
        return c in self.states

    def __bool__(self) -> bool:
        return bool(self.states)

    # ================================================================================ access order
    def start(self, direction: Direction, backwards: int) -> None:
        """A forward or a backward begins, `backwards` begun so far (this one included): record its order the first
        time, else follow the recorded one."""
        if self._recording is not None and self._direction is not None:
            self._order.setdefault(self._direction, self._recording)
        self._direction = direction
        self._backwards = backwards
        self._grad = direction is Direction.backward or torch.is_grad_enabled()
        self._disagreed = False
        self._recording = None if direction in self._order else []
        self._pos = 0

    def _note(self, c: int) -> None:
        if self._recording is not None:
            self._recording.append(c)
            return
        order = self._order.get(self._direction) if self._direction is not None else None
        if order is None:
            return
        for i in range(self._pos, len(order)):
            if order[i] == c:
                self._pos = i + 1
                return

    def next_chunk(self, c: int) -> int | None:
        """The chunk the recorded order uses after `c` (another one; None while recording or at its end)."""
        order = self._order.get(self._direction) if self._direction is not None else None
        if self._recording is not None or order is None:
            return None
        for i in range(self._pos, len(order)):
            if order[i] != c:
                return order[i]
        return None

    def used_next(self, c: int) -> bool:
        """The recorded order uses `c` again right now (the next access): keep it gathered."""
        order = self._order.get(self._direction) if self._direction is not None else None
        if self._recording is not None or order is None:
            return False
        return self._pos < len(order) and order[self._pos] == c

    # ================================================================================ gather/release
    def agree(self, c: int, direction: Direction | None = None) -> None:
        """Before an all-gather of chunk `c` (or, `c` = -1, as a forward or backward ends): the ranks compare what
        they are about to do (one all-gather of four int32 per rank, the same size whatever each rank does, so a
        difference cannot pair collectives of other sizes): the chunk, the direction, whether the forward began
        with grad enabled, and how many backwards began before. Gathers are issued from module hooks, so

        - a rank that did not run a module (data-dependent control flow: an expert without tokens there) would
          pair its next all-gather with another rank's gather of a different chunk (gloo aborts on the size
          mismatch; equal sizes would mix chunks silently): every rank raises `UnusedParametersError`;
        - a forward made on some ranks only (the DDP habit `if rank == 0: evaluate(model)`, or `generate`) would
          pair its gathers with the other ranks' next training forward, then the ranks' next collectives would
          differ (a hang until the backend's timeout): the pass differs in the grad mode or the backward count,
          and every rank raises `RankArrivalError` naming each rank's pass.

        The same verdict on every rank from the same gathered rows, before any mismatched collective. Not caught:
        a forward on some ranks while the others wait in a collective of their own (`dist.barrier()`), which
        pairs with it (gloo and NCCL cannot tell collectives apart)."""
        if self.group.world_size == 1:
            return
        step = direction if direction is not None else self._direction
        row, out = self._agree_row, self._agree_rows  # kept: no allocation per gather
        row[0], row[1] = c, _DIRECTIONS.index(step)
        row[2], row[3] = int(self._grad), self._backwards

        def run() -> None:
            all_gather_single(out, row, group=self.group.group)

        t0 = time.perf_counter()
        if self._issuer is None:
            run()
        else:
            self._issuer.submit(run).result()
        flat = out.tolist()
        self.counters.control_s += time.perf_counter() - t0
        self.counters.control_checks += 1
        rows = [flat[i : i + AGREE_ROW] for i in range(0, len(flat), AGREE_ROW)]
        if all(r == rows[0] for r in rows):
            return
        self._disagreed = True
        for d in self.states.values():
            d.expected.clear()  # this forward/backward is not completed (a hook raises)

        def when(r: list[int]) -> str:
            return str(_DIRECTIONS[r[1]] or "outside forward/backward")

        if any(r[1:] != rows[0][1:] for r in rows):

            def pass_(r: list[int]) -> str:
                grad = (
                    ""
                    if _DIRECTIONS[r[1]] is not Direction.forward
                    else (" with grad" if r[2] else " without grad")
                )
                return f"in a {when(r)}{grad} after {r[3]} backward{'s' if r[3] != 1 else ''}"

            raise RankArrivalError(
                "memplan: the ranks are in different passes of a model with chunks sharded on the device (each "
                "forward and backward gathers their parameters from every rank, a collective): "
                f"{'; '.join(f'rank {i} {pass_(r)}' for i, r in enumerate(rows))}. Run every forward on every "
                "rank, evaluation and generation included (each rank on its own share of the data, as FSDP "
                "requires; Hugging Face `generate(..., synced_gpus=True)` keeps the ranks' decoding steps together "
                "when their sequences end at different lengths), or plan without device-sharded chunks (a forward "
                "of replicated or host-sharded chunks may run on one rank alone)"
            )

        def say(r: list[int]) -> str:
            if r[0] < 0:
                return f"{'began' if r[0] == -2 else 'ended'} its {when(r)}"
            names = [e.name for e in self.states[r[0]].spec.entries]
            return f"gathered chunk {r[0]} ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''}) in {when(r)}"

        raise UnusedParametersError(
            "memplan: the ranks ran different modules of device-sharded persistent chunks (gathered from module "
            f"hooks): {'; '.join(f'rank {i} {say(r)}' for i, r in enumerate(rows))}. Parameters used on some "
            "ranks only (data-dependent control flow, e.g. an expert without tokens) are supported in replicated "
            "persistent chunks (averaged as DistributedDataParallel(find_unused_parameters=True) does), not in "
            "sharded ones: make every rank run every module (e.g. run each expert on an empty batch), or plan "
            "these parameters in unsharded persistent chunks"
        )

    def agree_begin(self) -> None:
        """A synchronising backward with offloaded chunks begins (`agree` with chunk -2), before the same-use check."""
        self.agree(-2)

    def agree_end(self) -> None:
        """A forward or backward ends (`agree` with no chunk), unless an agreement of it already failed on every
        rank (its error is propagating: the root's always-called post-hook must not add another)."""
        if self._disagreed:
            self._disagreed = False
            return
        self.agree(-1)

    def issue(self, st: ChunkState) -> None:
        """Start the all-gather of `st`'s shards into its (re-allocated) whole copy, unless gathered or started;
        the ranks agree first (`agree`)."""
        if st.gathered or st.index in self._pending:
            return
        self.agree(st.index)
        assert st.params is not None and st.own is not None
        storage = st.params.untyped_storage()
        storage.resize_(st.params.numel() * st.params.element_size())
        full, own, group = st.params, st.own, self.group

        if full.device.type != group.device.type:
            # a backend that does not take the device's tensors (gloo with a CUDA device): through copies on the
            # backend's device, synchronously (`RankGroup.all_gather`); nothing to wait for afterwards
            group.all_gather(full, own)
            self._pending[st.index] = _DONE
        elif self.worker is None:
            self._pending[st.index] = all_gather_single(full, own, group=group.group, async_op=True)
        else:
            issued: list[Any] = []  # the Work, once the worker issued the all-gather

            def run() -> None:
                issued.append(all_gather_single(full, own, group=group.group, async_op=True))

            self._pending[st.index] = (self.worker.submit(run), issued)
        self.counters.device_shard_gathers += 1
        self.counters.device_shard_gather_bytes += st.params.nbytes
        self.max_gathered_bytes = max(self.max_gathered_bytes, self.gathered_bytes())

    def gathered_bytes(self) -> int:
        """Bytes of the whole copies held now (gathered, or an all-gather into them in flight)."""
        return sum(s.params.untyped_storage().nbytes() for s in self.states.values() if s.params is not None)

    def gather(self, st: ChunkState) -> None:
        """`st` gathered: every rank's shard in `params`, the parameters pointing at it (waits for the all-gather)."""
        if st.gathered:
            return
        self.issue(st)
        self._wait(st)
        with torch.no_grad():
            for e, v in zip(st.spec.entries, self._full_views[st.index], strict=True):
                e.param.data = v
        st.gathered = True

    def _wait(self, st: ChunkState) -> None:
        work = self._pending.pop(st.index, None)
        if work is None:
            return
        if isinstance(work, tuple):
            future, issued = work
            future.result()
            work = issued[0]
        work.wait()  # on NCCL: the current (compute) stream waits for the backend's stream

    def release(self, st: ChunkState) -> None:
        """Free `st`'s whole copy: the parameters point at placeholders, the storage shrinks to 0 bytes."""
        if not st.gathered and st.index not in self._pending:
            return
        self._wait(st)  # an all-gather in flight into the storage (a prefetch never used)
        assert st.params is not None
        with torch.no_grad():
            for e, v in zip(st.spec.entries, self._placeholders[st.index], strict=True):
                e.param.data = v
        if not st.params.untyped_storage().resizable():
            # a user's `.numpy()` of a gathered parameter (numpy then shares the memory) fixes the storage's size:
            # leave that storage to them, the chunk gets a new one
            st.params = torch.empty_like(st.params)
            self._full_views[st.index] = views(st.params, st.spec.entries)
        # on CUDA the caching allocator reuses the block in stream order after the compute that read it
        st.params.untyped_storage().resize_(0)
        st.gathered = False
        self.counters.device_shard_releases += 1

    def acquire(self, c: int) -> None:
        """A module is about to use chunk `c` (forward, recomputation or backward): gather it, prefetch the next."""
        st = self.states[c]
        self._note(c)
        self.gather(st)
        nxt = self.next_chunk(c)
        if nxt is not None and nxt in self.states:
            ahead = self.states[nxt]
            if not ahead.gathered and nxt not in self._pending:
                self.issue(ahead)
                self.counters.device_shard_prefetches += 1

    def gather_all(self) -> None:
        """Every device-sharded chunk gathered, in chunk order (a collective: every rank)."""
        for c in sorted(self.states):
            self.gather(self.states[c])

    def release_all(self, keep: Iterable[int] = ()) -> None:
        kept = set(keep)
        for c in sorted(self.states):
            if c not in kept:
                self.release(self.states[c])

    def after_module(self, chunks: list[int], backward: bool) -> None:
        """A module using `chunks` finished its forward: release what nothing holds and the order does not use next."""
        for c in chunks:
            self.pins[c] = max(0, self.pins[c] - 1)
        if backward:
            return  # a recomputation: its chunks stay until their gradients arrived (or backward ends)
        for c in chunks:
            if self.pins[c] == 0 and not self.used_next(c):
                self.release(self.states[c])

    def refresh_own_from_master(self, st: ChunkState) -> None:
        """After the master changed (a step, a load): this rank's compute shard from it; the whole copy is stale."""
        assert st.own is not None and st.master is not None
        if st.mixed:
            st.own.copy_(st.master)
        self.release(st)

    def whole(self, st: ChunkState, source: torch.Tensor) -> torch.Tensor:
        """Every rank's shard of `source` (this rank's fp32 master or compute shard) as one whole tensor (a
        collective: every rank, chunk order)."""
        assert st.shard is not None
        out = torch.empty(st.shard.total, dtype=source.dtype, device=source.device)
        self.group.all_gather(out, source.clone())
        return out


class _Done:
    """The Work of an all-gather that already finished (issued synchronously)."""

    def wait(self) -> None:
        return None


_DONE = _Done()


def pre_backward_hook(outputs: list[torch.Tensor], fn: Callable[[], None]) -> Any:
    """Call `fn` once when the first gradient w.r.t. any of `outputs` is computed (before the module's backward)."""
    return torch.autograd.graph.register_multi_grad_hook(outputs, lambda _grad: fn(), mode="any")
