"""Node-shared compute copy of sharded chunks (issue 20; docs/architecture/runtime.md "Sharded chunks").

Where every rank of the job runs on one node (`client.contract.compute_copy_shared`) and
`RuntimeOptions.share_compute_copy` is on, the compute copies of all sharded offloaded chunks live in ONE
segment of node-shared memory per wrapped job instead of one private copy per rank: each chunk's N*s elements
(its zero-padded flat size over N ranks) at a 16-byte-aligned offset. Rank r writes only its shard
[r*s, (r+1)*s) of each chunk (its stepped master), every rank uploads whole chunks from it, and the
parameters of a non-resident chunk point into it. The node holds the bytes once, not N times, and the
all-gather of every compute copy after `optimizer.step()` becomes one barrier (`HostSteps.publish_shards`).

Creation (`open_node_shared`, a collective of the job's group, same decision on every rank):
1. every rank sends (host, global rank, its `share_compute_copy`); sharing needs all on one host and all on;
2. the lowest global rank creates `<shared_memory_dir>/memplan-<pid>-<random>` with O_CREAT|O_EXCL, reserves
   it with `os.posix_fallocate` (a full /dev/shm -- docker's default is 64 MiB -- is an ENOSPC error now,
   never a SIGBUS at a later page fault), maps it (`mmap`, MAP_SHARED) and zero-fills the alignment gaps;
3. the name goes to every rank (`all_gather_object`); each opens `<its own shared_memory_dir>/<name>`,
   checks the size and maps it; on CUDA each registers its mapping (`cudaHostRegister`, see below);
4. every rank's outcome is gathered; if any rank failed, EVERY rank unmaps and falls back to private copies
   and all-gathers, with one warning naming each failure and the host memory the fallback costs;
5. the creator unlinks the file at once: every rank holds a mapping by then, so nothing is left in the
   directory, whatever happens to the ranks later. The memory goes when the last mapping does.
A creator that dies between steps 2 and 5 (one collective) leaves the file behind: the only window.

The mapping lives as long as any tensor viewing it (`torch.frombuffer` keeps the `mmap` referenced):
`release` (at detach, after the parameters got private copies) unregisters it and drops the runtime's
references; a tensor the user still holds (e.g. from an earlier `state_dict()`) stays valid.

CUDA: **`register_cuda` has never run** (the development machine has no GPU). It page-locks this rank's whole
mapping with `torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)` so uploads from it are asynchronous,
and `release` unregisters it. `registration()` is what it would register; the CPU tests check that range.
"""

from __future__ import annotations

import logging
import mmap
import os
import secrets
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import _disable_current_modes

from agent.runtime.layout import ChunkLayout
from agent.runtime.options import RuntimeOptions
from agent.runtime.process_group import RankGroup, UnevenNodesError, busiest_host_ranks, host_name
from client.contract import PARAMETER_ALIGN_BYTES, compute_copy_shared

log = logging.getLogger(__name__)

NAME_PREFIX = "memplan-"


class NodeSharedError(RuntimeError):
    """The node-shared segment could not be made, opened or page-locked on this rank."""


def _round_up(n: int) -> int:
    return -(-n // PARAMETER_ALIGN_BYTES) * PARAMETER_ALIGN_BYTES


@dataclass(frozen=True)
class SegmentLayout:
    """Where each sharded chunk's compute copy lies in the segment (bytes; chunk index -> offset, size)."""

    offsets: dict[int, int] = field(default_factory=dict)
    sizes: dict[int, int] = field(default_factory=dict)
    total: int = 0

    @classmethod
    def of(cls, layout: ChunkLayout) -> SegmentLayout:
        """The sharded offloaded chunks of `layout` in chunk order, each N*s compute-dtype elements, aligned."""
        esize = torch.empty((), dtype=layout.compute_dtype).element_size()
        offsets: dict[int, int] = {}
        sizes: dict[int, int] = {}
        at = 0
        for c in layout.chunks:
            if c.offloaded and c.sharded:
                offsets[c.index] = at
                sizes[c.index] = c.shard_numel * layout.world_size * esize
                at += _round_up(sizes[c.index])
        return cls(offsets, sizes, at)

    def gaps(self) -> list[tuple[int, int]]:
        """Alignment padding between the chunks' copies: (start, end) byte ranges."""
        return [
            (o + self.sizes[c], _round_up(o + self.sizes[c]))
            for c, o in self.offsets.items()
            if self.sizes[c] % PARAMETER_ALIGN_BYTES
        ]


class NodeSharedCopy:
    """This rank's mapping of the node's segment: the sharded chunks' compute copies."""

    def __init__(self, mapping: mmap.mmap, segment: SegmentLayout, dtype: torch.dtype, name: str) -> None:
        self.segment = segment
        self.dtype = dtype
        self.name = name  # the file's name (unlinked once every rank mapped it)
        self.world_size = 1  # set by `open_node_shared`: the ranks sharing it
        self._mapping: mmap.mmap | None = mapping
        with _disable_current_modes():  # host memory, no kernel's output (as the host arena's)
            self.memory: torch.Tensor | None = torch.frombuffer(
                mapping, dtype=torch.uint8, count=segment.total
            )
        self.registered = False

    @property
    def nbytes(self) -> int:
        """Bytes of the segment: the node holds them once, every rank maps them all."""
        return self.segment.total

    @property
    def share_bytes(self) -> int:
        """This rank's share of the segment (one shard of every chunk, as the planner counts it)."""
        return sum(_round_up(n // self.world_size) for n in self.segment.sizes.values())

    def chunk(self, index: int) -> torch.Tensor:
        """Chunk `index`'s compute copy: N*s elements of the compute dtype, a view of the mapping."""
        assert self.memory is not None, "NodeSharedCopy.chunk: released"
        o, n = self.segment.offsets[index], self.segment.sizes[index]
        with _disable_current_modes():
            return self.memory[o : o + n].view(self.dtype)

    def registration(self) -> tuple[int, int]:
        """(address, bytes) `register_cuda` page-locks: this rank's whole mapping."""
        assert self.memory is not None
        return self.memory.data_ptr(), self.segment.total

    def register_cuda(self) -> None:
        """Page-lock the mapping for asynchronous uploads. NEVER RUN: written for CUDA on a CPU-only machine."""
        ptr, nbytes = self.registration()
        err = int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0))
        if err != 0:
            raise NodeSharedError(
                f"cudaHostRegister of the {nbytes}-byte node-shared compute copy failed (cudaError {err}); "
                "check `ulimit -l` and the container's memlock limit"
            )
        self.registered = True

    def release(self) -> None:
        """Unregister (CUDA) and drop the runtime's references; the mapping goes with the last tensor on it."""
        if self.registered and self.memory is not None:
            err = int(torch.cuda.cudart().cudaHostUnregister(self.memory.data_ptr()))
            if err != 0:
                log.warning(
                    "memplan: cudaHostUnregister of the node-shared compute copy failed (cudaError %d)", err
                )
            self.registered = False
        self.memory = None
        self._mapping = None


def _create(directory: str, nbytes: int) -> tuple[str, mmap.mmap]:
    """A new file of `nbytes` reserved in `directory`, mapped shared; (its name, the mapping)."""
    name = f"{NAME_PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
    path = os.path.join(directory, name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        try:
            os.posix_fallocate(fd, 0, nbytes)  # tmpfs pages reserved now: ENOSPC here, never SIGBUS later
            return name, mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.unlink(path)
            raise
    finally:
        os.close(fd)


def _open(directory: str, name: str, nbytes: int) -> mmap.mmap:
    """Map the creator's file `name` in `directory` (this rank's option), checking its size."""
    fd = os.open(os.path.join(directory, name), os.O_RDWR)
    try:
        size = os.fstat(fd).st_size
        if size != nbytes:
            raise NodeSharedError(f"{os.path.join(directory, name)}: {size} bytes, expected {nbytes}")
        return mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class NodeSharing:
    """What `open_node_shared` found: the copy (None: private copies per rank) and whether the planner counted
    a shared one (`compute_copy_shared` for the job: it does wherever the ranks are on one node)."""

    copy: NodeSharedCopy | None
    planned: bool


def open_node_shared(
    layout: ChunkLayout, group: RankGroup, options: RuntimeOptions, device: torch.device
) -> NodeSharing:
    """The job's node-shared compute copy (a collective of `group`: every rank calls it with the same layout).
    No copy where the job is not on one node, sharing is off on some rank, nothing is sharded, or a rank
    failed (then warned)."""
    segment = SegmentLayout.of(layout)
    if not segment.offsets:
        return NodeSharing(None, planned=False)
    me = (host_name(), dist.get_rank(), options.share_compute_copy)
    everyone = group.all_gather_object(me)
    try:
        planned = compute_copy_shared(group.world_size, busiest_host_ranks([h for h, _, _ in everyone]))
    except UnevenNodesError:
        planned = False  # several nodes, unevenly: not one node
    if not planned or not all(on for _, _, on in everyone):
        return NodeSharing(None, planned=planned)
    creator = min(range(group.world_size), key=lambda i: everyone[i][1])  # lowest global rank
    directory = options.shared_memory_dir
    name: str | None = None
    mapping: mmap.mmap | None = None
    error: str | None = None
    shared: NodeSharedCopy | None = None
    # any failure must reach the agreement below (caught broadly): a rank that raised here would leave the
    # others waiting in the collective
    if group.rank == creator:
        try:
            name, mapping = _create(directory, segment.total)
        except Exception as e:
            error = f"rank {group.rank} could not create {segment.total} bytes in {directory}: {e}"
    name = group.all_gather_object(name)[creator]
    if group.rank != creator and name is not None:
        try:
            mapping = _open(directory, name, segment.total)
        except Exception as e:
            error = f"rank {group.rank} could not open {os.path.join(directory, name)}: {e}"
    if mapping is not None and name is not None:
        try:
            shared = NodeSharedCopy(mapping, segment, layout.compute_dtype, name)
            if device.type == "cuda" and error is None:
                shared.register_cuda()
        except Exception as e:
            error = f"rank {group.rank} could not map or page-lock it: {e}"
    errors = [e for e in group.all_gather_object(error) if e is not None]
    if group.rank == creator and name is not None:
        try:  # every rank mapped it (or gave up): nothing stays in the directory
            os.unlink(os.path.join(directory, name))
        except FileNotFoundError:
            log.warning("memplan: the node-shared compute copy %s was removed by someone else", name)
    if errors:
        if shared is not None:
            shared.release()
        n = group.world_size
        log.warning(
            "memplan: the sharded chunks' compute copies are not shared between the %d ranks of this node (%s); "
            "every rank keeps a private copy of %d bytes and all-gathers it after each optimizer step: %d more "
            "host bytes on the node, %d per rank",
            n,
            "; ".join(errors),
            segment.total,
            (n - 1) * segment.total,
            segment.total - segment.total // n,
        )
        return NodeSharing(None, planned=True)
    assert shared is not None
    shared.world_size = group.world_size
    if group.rank == creator:
        assert shared.memory is not None
        for a, b in segment.gaps():
            shared.memory[a:b].zero_()  # padding between chunks, once (each chunk's own padding: its shards)
    return NodeSharing(shared, planned=True)
