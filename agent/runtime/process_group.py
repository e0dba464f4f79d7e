"""The job's process group and the runtime's collectives on it (issue 20).

`agent.wrap` inside an initialised `torch.distributed` process group (or with `process_group=`) runs one
runtime per rank and keeps them in step as `DistributedDataParallel` does: rank 0's parameters and buffers
are broadcast at wrap, every chunk's gradient is averaged across the ranks after backward (unless inside
`wrapped.no_sync()`), so every rank steps the same averaged gradient and holds the same model state.

Collectives take host tensors (gloo, and the offloaded chunks' host gradients) or device tensors (NCCL with
persistent chunks); a host tensor on a backend that cannot reduce host memory (NCCL) goes through a device
copy (`_on_backend_device`): correct, not fast, and not yet run on a GPU.

Sharded offloaded chunks (issue 20) use reduce-scatter (the gradient: each rank receives the mean of its own
shard), all-gather (a private compute copy after the host step, the exposed gradient, the optimizer state of a
full state dict) and barriers (a node-shared compute copy, `node_shared.py`: every rank wrote its shard).
`ranks_per_node` counts the ranks on the busiest host from their host names. On gloo these take host tensors as
they are (what the tests run); on NCCL they go through the same device copies, written straightforwardly and
not run on a GPU yet.
"""

from __future__ import annotations

import hashlib
import logging
import socket
from collections import Counter
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankGroup:
    """One process group as the runtime sees it: the group, this process's rank in it and its size."""

    group: Any  # dist.ProcessGroup (None: the default group)
    rank: int
    world_size: int
    backend: str
    device: torch.device  # where collectives on this backend take their tensors
    # made by `resolve` for the runtime, not the user's: `release` lends it to the next wrap
    owned: bool = False

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    # ================================================================================= collectives
    def average_(self, tensor: torch.Tensor) -> None:
        """All-reduce `tensor` in place to the mean over the ranks (DDP's gradient average)."""
        with _on_backend_device(tensor, self.device) as t:
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
            t.div_(self.world_size)

    def broadcast_(self, tensor: torch.Tensor, src: int = 0) -> None:
        """Every rank's `tensor` becomes rank `src`'s (in place)."""
        with _on_backend_device(tensor, self.device) as t:
            dist.broadcast(
                t, src=dist.get_global_rank(self.group, src) if self.group else src, group=self.group
            )

    def broadcast_coalesced_(self, tensors: list[torch.Tensor], src: int = 0) -> None:
        """Every rank's `tensors` become rank `src`'s, one broadcast per dtype (flattened, then copied back)."""
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        for same in by_dtype.values():
            flat = torch.cat([t.detach().reshape(-1) for t in same])
            self.broadcast_(flat, src)
            at = 0
            for t in same:
                t.copy_(flat[at : at + t.numel()].view_as(t))
                at += t.numel()

    def reduce_scatter_mean(self, output: torch.Tensor, full: torch.Tensor) -> None:
        """`output` (s elements) = the mean over the ranks of `full[rank*s : (rank+1)*s]` (`full`: world_size*s
        elements, left unchanged). `output` must not overlap `full` (gloo is only documented for separate ones)."""
        with (
            _on_backend_device(full, self.device, write_back=False) as src,
            _on_backend_device(output, self.device) as dst,
        ):
            reduce_scatter_single(dst, src, group=self.group)
            dst.div_(self.world_size)

    def all_gather(self, full: torch.Tensor, own: torch.Tensor) -> None:
        """`full` (world_size*s elements) = every rank's `own` (s elements) in rank order. `own` must not
        overlap `full` (pass a copy of this rank's slice)."""
        with (
            _on_backend_device(own, self.device, write_back=False) as src,
            _on_backend_device(full, self.device) as dst,
        ):
            all_gather_single(dst, src, group=self.group)

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's Python object, in rank order (pickled: `torch.distributed.all_gather_object`)."""
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def barrier(self) -> None:
        """Every rank reached this point (`torch.distributed.barrier`; on NCCL it also waits for the device)."""
        dist.barrier(group=self.group)

    def max(self, values: list[float]) -> list[float]:
        """The element-wise maximum of `values` over the ranks (the slowest rank's time, the largest peak)."""
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return [float(v) for v in t.tolist()]

    def count_(self, mask: torch.Tensor) -> None:
        """`mask` (int32, 0 or 1, the same length on every rank) becomes, element-wise, how many ranks hold 1
        (in place): above 0 where any rank does (their union), below `world_size` where some rank does not."""
        with _on_backend_device(mask, self.device) as t:
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)

    def gather_rows(self, row: torch.Tensor) -> torch.Tensor:
        """Every rank's `row` (1-D, the same length and dtype on every rank) as the rows of a host tensor, in
        rank order (`world_size` x len(row))."""
        full = torch.empty(self.world_size * row.numel(), dtype=row.dtype, device=self.device)
        with _on_backend_device(row, self.device, write_back=False) as src:
            all_gather_single(full, src, group=self.group)
        return full.view(self.world_size, -1).cpu()

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Rank `src`'s Python object on every rank (pickled: `torch.distributed.broadcast_object_list`)."""
        box = [obj if self.rank == src else None]
        global_src = dist.get_global_rank(self.group, src) if self.group else src
        dist.broadcast_object_list(box, src=global_src, group=self.group, device=self.device)
        return box[0]

    def check_arrival(self, call: str, fix: str, timeout_s: float, backwards: int = 0) -> None:
        """Before a collective a user calls (a full optimizer state dict, unwrap): every rank marks in the job's
        store that it reached `call`. Rank 0 waits up to `timeout_s` for the others' marks; a rank missing then
        raises `RankArrivalError` on rank 0 naming `call` and `fix`, where the collective itself would wait for
        it until the backend's timeout (30 minutes on gloo): the DDP habit `if rank == 0:
        torch.save(optimizer.state_dict())`. A non-zero rank waits for rank 0's mark without a time limit (rank
        0 may be busy with its own evaluation), but raises as soon as rank 0 is seen past the call without
        making it: rank 0 publishes its count of backward passes begun (`publish_backwards`), and one above
        this rank's `backwards` means rank 0 went on training (`if rank == 1: ...`, the same habit on another rank,
        which used to hang). One store write per rank and one wait per rank (milliseconds); the store is the
        one every backend's group was made with, so NCCL jobs get the same check."""
        whole = self.group if self.group is not None else dist.group.WORLD
        ranks = ",".join(str(r) for r in dist.get_process_group_ranks(whole))
        n = _arrivals.get(ranks, 0)
        keys = [f"memplan/arrival/{ranks}/{n}/{r}" for r in range(self.world_size)]
        store = dist.distributed_c10d._get_default_store()
        store.set(keys[self.rank], call)
        if self.rank != 0:
            self._wait_for_rank_0(store, keys[0], ranks, call, fix, backwards)
            _arrivals[ranks] = n + 1
            return
        others = keys[1:]
        try:
            store.wait(others, timedelta(seconds=timeout_s))
        except RuntimeError:  # torch's DistStoreError (the wait timed out) is one
            missing = [r for r, key in enumerate(keys) if r and not store.check([key])]
            raise RankArrivalError(
                f"memplan: {call} is a collective here (every rank takes part; sharded chunks: each holds a shard): rank "
                f"0 called it, rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} did not "
                f"within {timeout_s:g} s. {fix} (RuntimeOptions.rank_arrival_timeout_s sets the wait)"
            ) from None
        for key in others:
            store.delete_key(key)
        if (
            n
        ):  # every other rank marked this call, so each passed its wait for rank 0's mark of the previous one
            # (deleting it on entry raced: a call with no collective after its check let rank 0 reach the next
            # call and delete the mark before a slow rank had seen it, which then waited forever)
            store.delete_key(f"memplan/arrival/{ranks}/{n - 1}/0")
        _arrivals[ranks] = n + 1

    def _wait_for_rank_0(self, store: Any, key: str, ranks: str, call: str, fix: str, backwards: int) -> None:
        """A non-zero rank at `call`: wait for rank 0's mark `key`, checking each second whether rank 0 went on
        to a later backward instead (then `RankArrivalError`), or its store is gone (it exited)."""
        progress = _progress_key(ranks)
        while True:
            try:
                store.wait([key], timedelta(seconds=1))
                return
            except RuntimeError:  # timed out (DistStoreError), or rank 0's store went away with it
                try:
                    ahead = int(store.get(progress)) if store.check([progress]) else 0
                except RuntimeError:
                    ahead = backwards + 1  # the store lives in rank 0's process: rank 0 exited
            if ahead > backwards:
                raise RankArrivalError(
                    f"memplan: {call} is a collective here (every rank takes part; sharded chunks: each holds a shard): "
                    f"rank {self.rank} called it, rank 0 went on without calling it (it began backward {ahead}, this "
                    f"rank {backwards}). {fix}"
                )

    def publish_backwards(self, backwards: int) -> None:
        """Rank 0, as each backward begins: its count, which a non-zero rank waiting in `check_arrival` reads
        (one store write, rank 0 only; a backward, not a forward: rank 0 may evaluate with grad enabled)."""
        if self.rank == 0:
            whole = self.group if self.group is not None else dist.group.WORLD
            ranks = ",".join(str(r) for r in dist.get_process_group_ranks(whole))
            dist.distributed_c10d._get_default_store().set(_progress_key(ranks), str(backwards))


def _progress_key(ranks: str) -> str:
    return f"memplan/backwards/{ranks}"


_arrivals: dict[str, int] = {}
"""Per group (its global ranks): how many arrival checks this process passed; the store keys' generation."""


class RankArrivalError(RuntimeError):
    """A rank did not reach a collective the user called on rank 0 (a call made on one rank only), or the ranks
    are in different passes of a model with device-sharded chunks (a forward made on one rank only)."""


class UnusedParametersError(RuntimeError):
    """The ranks' forwards used different offloaded chunks, or ran different modules of device-sharded
    persistent chunks (data-dependent unused parameters, e.g. an expert that got tokens on some ranks only):
    they would issue different collectives."""


class JobMismatchError(ValueError):
    """The ranks called `wrap` with different models (parameters, buffers) or different memory limits."""


def batch_order(shape: tuple[int, int]) -> tuple[int, int]:
    """How (rows, sequence length) batch shapes compare when the job plans for the largest: most rows x length,
    then the longer sequence (`check_same_job`, and the job's trace in `group_profiling`)."""
    return shape[0] * shape[1], shape[1]


@dataclass(frozen=True)
class JobAgreement:
    """What every rank of a job plans for (`check_same_job`)."""

    device_memory: int | None
    host_memory: int | None
    batch: tuple[int, int] | None  # (rows, sequence length): the largest sample batch any rank gave


def check_same_job(
    group: RankGroup,
    model: torch.nn.Module,
    *,
    batch: tuple[int, int] | None = None,
    device_memory: int | None = None,
    host_memory: int | None = None,
) -> JobAgreement:
    """At `wrap`, before any profiling or planning: every rank wraps the same model (parameter and buffer names,
    shapes, dtypes, which parameters train), else every rank raises `JobMismatchError` naming the first
    difference and the ranks. Returns what the job plans for: the smallest device_memory and host_memory any
    rank gave (e.g. each rank's free device memory; a JobMismatchError where only some ranks gave one), and the
    largest sample batch (`batch`, rows and sequence length: most rows x length, then the longer sequence; a
    padding collator pads each rank's first batch to its own longest example), which every rank's batch guard
    then compares against. One `all_gather_object` of a digest (a second one of the whole lists when they
    differ). Before, a rank 1 model unlike rank 0's failed somewhere later (profiling, or the plan rank 0
    solved did not fit it: a `PlanMismatchError` about precision on one rank and a gloo connection reset on
    the other), and a smaller `device_memory` on rank 1 was ignored (rank 0's planned the job)."""
    tensors = [
        (name, tuple(p.shape), str(p.dtype), p.requires_grad) for name, p in model.named_parameters()
    ] + [(name, tuple(b.shape), str(b.dtype), None) for name, b in model.named_buffers()]
    digest = hashlib.sha256(repr(tensors).encode()).hexdigest()
    limits = {"device_memory": device_memory, "host_memory": host_memory}
    every = group.all_gather_object((digest, limits, batch))
    if len({d for d, _, _ in every}) > 1:
        lists = group.all_gather_object(tensors)
        raise JobMismatchError(
            f"memplan: the ranks wrap different models: {_first_difference(lists)}. Every "
            "rank must wrap the same model with the same trainable parameters (DistributedDataParallel refuses "
            "it too)"
        )
    agreed: dict[str, int | None] = {}
    for field in limits:
        values = [lim[field] for _, lim, _ in every]
        if len(set(values)) > 1 and None in values:
            said = ", ".join(f"rank {r}: {'not given' if v is None else v}" for r, v in enumerate(values))
            raise JobMismatchError(
                f"{field}: given on some ranks only ({said}); rank 0 plans one policy for the whole job: pass "
                "it on every rank, or on none (each device's own)"
            )
        agreed[field] = min(values) if None not in values else None
        if len(set(values)) > 1:
            log.info("memplan: %s differs across the ranks (%s); planning for the smallest", field, values)
    batches = [b for _, _, b in every if b is not None]
    largest = max(batches, key=batch_order) if batches else None
    if len(set(batches)) > 1:
        log.info(
            "memplan: the ranks' sample batches differ (rows x sequence: %s); planning for the largest, %dx%d",
            ", ".join(f"{b[0]}x{b[1]}" for b in batches),
            *largest,  # type: ignore[misc]
        )
    return JobAgreement(agreed["device_memory"], agreed["host_memory"], largest)


def _first_difference(lists: list[list[tuple[Any, ...]]]) -> str:
    def say(t: tuple[Any, ...] | None) -> str:
        if t is None:
            return "absent"
        kind = "buffer" if t[3] is None else "parameter" + ("" if t[3] else " (frozen)")
        return f"{kind} {t[0]!r} {list(t[1])} {t[2].removeprefix('torch.')}"

    for i in range(max(len(x) for x in lists)):
        items = [x[i] if i < len(x) else None for x in lists]
        if len(set(items)) > 1:
            return "; ".join(f"rank {r}: {say(t)}" for r, t in enumerate(items)) + f" (tensor {i} in order)"
    return "their parameter lists differ"


class UnevenNodesError(RuntimeError):
    """The ranks of a group are spread unevenly over their hosts."""


def busiest_host_ranks(hosts: list[str]) -> int:
    """Ranks on the busiest of the ranks' `hosts` (one host name per rank); it must divide the world size."""
    counts = Counter(hosts)
    busiest = max(counts.values())
    if len(hosts) % busiest:
        raise UnevenNodesError(
            f"ranks_per_node: hosts run uneven numbers of ranks ({dict(counts)}); memplan plans for nodes with "
            "equal ranks"
        )
    return busiest


def host_name() -> str:
    """This process's host, as the ranks compare them (ranks with the same name share a node's memory)."""
    return socket.gethostname()


def ranks_per_node(group: Any) -> int:
    """Ranks on the busiest host of `group` (a `dist.ProcessGroup`, None: the default group); a collective
    (host names gathered from every rank)."""
    names: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(names, host_name(), group=group)
    return busiest_host_ranks([str(n) for n in names])


# torch 2.13 names them `*_single` (the `*_tensor` names are deprecated); older ones have only the latter
all_gather_single: Any = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single: Any = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _on_backend_device:
    """`tensor` itself when the backend takes it where it is, else a copy on the backend's device that is
    written back on exit unless `write_back` is False (an input) (NCCL reduces device memory only)."""

    def __init__(self, tensor: torch.Tensor, device: torch.device, *, write_back: bool = True) -> None:
        self.tensor = tensor
        self.device = device
        self.copy = tensor.device.type != device.type
        self.write_back = write_back

    def __enter__(self) -> torch.Tensor:
        if not self.copy:
            return self.tensor
        self.moved = self.tensor.to(self.device, copy=True)
        return self.moved

    def __exit__(self, *exc: object) -> None:
        if self.copy and self.write_back and exc[0] is None:
            self.tensor.copy_(self.moved)


def resolve(process_group: Any = None) -> RankGroup | None:
    """The group `wrap` runs in: `process_group` if given, else, when torch.distributed is initialised with more
    than one rank, a group of every rank of the runtime's own (`dist.new_group()`: a collective, and `wrap` runs
    on every rank; or one an `unwrap` gave back, `release`),
    so the runtime's collectives, some issued from its host worker thread (during backward; after `step()` with
    `async_step`), never pair up with the user's own on the default group in a different order on different
    ranks; None for a single-process job (nothing to synchronise)."""
    if not dist.is_available() or not dist.is_initialized():
        if process_group is not None:
            raise ValueError("process_group: given, but torch.distributed is not initialised")
        return None
    group = process_group
    world = dist.get_world_size(group)
    if process_group is None and world == 1:
        return None
    if process_group is None:
        spare = _spare_group()
        group = spare if spare is not None else dist.new_group()
    backend = str(dist.get_backend(group))
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    return RankGroup(
        group=group,
        rank=dist.get_rank(group),
        world_size=world,
        backend=backend,
        device=device,
        owned=process_group is None,
    )


# Groups `resolve` made that an `unwrap` gave back, with the default group they were made under. Each wrap made
# a new group and none was ever destroyed: a process that wrapped and unwrapped again and again (a sweep, an
# evaluation script, Lightning's `fit` called twice) kept every one (gloo: 3 threads and a connection per peer
# each; NCCL: a communicator's device buffers, outside every plan). Lending a released group to the next wrap
# keeps the count at the most wraps alive at once; a live wrap never shares its group (two host workers issuing
# collectives on one group could pair them differently on different ranks). Every rank wraps and unwraps in the
# same order (both are collectives), so every rank takes the same group from the same list.
_SPARE: list[tuple[Any, Any]] = []


def _spare_group() -> Any:
    """A released group made under the current default group, taken off the spare list (None: none)."""
    world = dist.group.WORLD
    for i, (made_under, group) in enumerate(_SPARE):
        if made_under is world:
            del _SPARE[i]
            return group
    _SPARE[:] = [(w, g) for w, g in _SPARE if w is world]  # groups of a destroyed default group: gone with it
    return None


def release(group: RankGroup | None) -> None:
    """`unwrap`: the runtime no longer uses `group` (its host worker has stopped); a group `resolve` made is lent
    to the next `wrap` on this rank instead of being left behind (the user's own group is theirs)."""
    if group is not None and group.owned:
        _SPARE.append((dist.group.WORLD, group.group))
