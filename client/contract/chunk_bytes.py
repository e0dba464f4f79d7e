"""Chunk bytes: how many bytes a parameter takes in a chunk, and how many of an offloaded chunk's bytes are pinned.

The planner (`planner_service/solver/chunk_grid.py`, `instance.py`) and the runtime
(`agent/runtime/layout.py`, `manual.py`, `host_arena.py`) both count with these functions, so a plan's chunk
bytes and pinned bytes equal the runtime's byte for byte (issue 19, defect 8 and item 10).

Parameter slots. Every parameter starts at a multiple of `PARAMETER_ALIGN_BYTES` (16) from the start of its
chunk: its slot is its bytes rounded up to 16. Packed back to back, one odd-sized bf16 parameter (e.g. a
bias of 11 elements, 22 bytes) would leave every later parameter of the chunk at an address that is not
16-byte aligned, and vectorised kernels (the fused optimizers, 128-bit loads) either fall back to slow paths
or fault on unaligned data. Chunk buffers themselves are allocated at least 16-byte aligned, so every
parameter view is.

Pinned bytes of an offloaded chunk of U used bytes (what `agent/runtime/chunks.py` keeps page-locked so its
copies can be asynchronous): the compute-dtype copy uploads come from (U), the staging buffer gradient
copies land in when they must be added or cast (U), and, without a separate fp32 master, the host gradient
itself (U: gradient copies write it directly). With a separate fp32 master the host gradient is fp32 and
ordinary memory (the host optimizer reads it; no copy engine writes it). The master and the optimizer
state are ordinary host memory too.

Shards (issue 20). A chunk sharded over N ranks is cut into N shards of `shard_elements` (ceil(n / N) rounded
up to `SHARD_ALIGN_ELEMENTS`, so a shard starts 16-byte aligned in fp32), the flat chunk zero padded to N
shards. Each rank pins the whole compute copy (N shards), its shard's staging buffer and, without a separate
master, its shard's host gradient, each buffer rounded up to 16 bytes as the host arena places it.

Node-shared compute copy (issue 20, session 8). Where every rank of the job runs on one node
(`compute_copy_shared`), the ranks keep ONE compute copy per sharded chunk in node-shared memory instead of one
each: rank r writes its stepped shard into it, and every rank uploads from it. A rank's share of that copy is
one shard (N shards over N ranks), so `sharded_chunk_pinned_bytes(..., shared_compute=True)` counts one
shard's bytes for it in place of the whole copy.
"""

from __future__ import annotations

PARAMETER_ALIGN_BYTES = 16


def parameter_slot_bytes(numel: int, dtype_bytes: int) -> int:
    """Bytes a parameter of `numel` elements of `dtype_bytes` each takes in a chunk, padding included."""
    if numel < 0 or dtype_bytes <= 0:
        raise ValueError(
            f"parameter_slot_bytes: numel {numel} and dtype_bytes {dtype_bytes} must be >= 0 and > 0"
        )
    return -(-numel * dtype_bytes // PARAMETER_ALIGN_BYTES) * PARAMETER_ALIGN_BYTES


def offloaded_chunk_pinned_bytes(used_bytes: int, *, separate_master: bool) -> int:
    """Pinned host bytes of one offloaded chunk of `used_bytes` (slots included) in the compute dtype.

    `separate_master`: an fp32 master distinct from the compute copy is stepped (mixed precision).
    """
    return used_bytes * (2 if separate_master else 3)


SHARD_ALIGN_ELEMENTS = 4  # a shard starts at a multiple of 16 bytes in fp32


def shard_elements(elements: int, world_size: int) -> int:
    """Elements of one rank's shard of a chunk of `elements` sharded over `world_size` ranks."""
    if elements < 0 or world_size < 1:
        raise ValueError(f"shard_elements: elements {elements} must be >= 0 and world_size {world_size} >= 1")
    s = -(-elements // world_size)
    return -(-s // SHARD_ALIGN_ELEMENTS) * SHARD_ALIGN_ELEMENTS


def compute_copy_shared(world_size: int, ranks_per_node: int) -> bool:
    """Whether the sharded chunks' compute copies are node-shared (one per node, not one per rank): a job of
    several ranks, all on one node. Several nodes keep one copy per rank, all-gathered after each step."""
    return world_size > 1 and ranks_per_node == world_size


def sharded_chunk_pinned_bytes(
    used_elements: int,
    world_size: int,
    element_bytes: int,
    *,
    separate_master: bool,
    shared_compute: bool = False,
) -> int:
    """Pinned host bytes one rank keeps for an offloaded chunk of `used_elements` sharded over `world_size`.
    `shared_compute`: the compute copy is node-shared (`compute_copy_shared`), and this rank's share of it is
    one shard."""
    shard = shard_elements(used_elements, world_size) * element_bytes
    whole = _aligned(shard) if shared_compute else _aligned(world_size * shard)
    return whole + _aligned(shard) * (1 if separate_master else 2)


def _aligned(nbytes: int) -> int:
    return -(-nbytes // PARAMETER_ALIGN_BYTES) * PARAMETER_ALIGN_BYTES
