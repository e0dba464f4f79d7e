"""Accounting: the bytes the runtime holds on the device and on the host, and what it moved."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from agent.runtime.buffers import BufferPool
    from agent.runtime.chunks import ChunkState
    from agent.runtime.device import DeviceContext
    from agent.runtime.node_shared import NodeSharedCopy
    from agent.runtime.stepper import ChunkStepper


@dataclass
class MemoryReport:
    """Bytes held, by category. Optimizer state is counted once it exists (after the first step).

    `pinned_host_bytes`: with a host arena (`host_arena.py`) its size plus any chunk buffer that went
    around it (on CPU the same figure, though nothing is page-locked there); without one, the host buffers
    that report `is_pinned()`; plus this rank's share of the node-shared compute copy.

    Node-shared compute copy (`node_shared.py`): `host["parameters"]` counts this rank's share of it (one shard
    per sharded chunk: the node holds it once for all its ranks, so the ranks' figures add up to the node's
    bytes); `node_shared_host_bytes` is the whole segment, which every rank of the node maps."""

    device: dict[str, int] = field(default_factory=dict)
    host: dict[str, int] = field(default_factory=dict)
    pinned_host_bytes: int = 0
    node_shared_host_bytes: int = 0

    @property
    def device_bytes(self) -> int:
        return sum(self.device.values())

    @property
    def host_bytes(self) -> int:
        return sum(self.host.values())


@dataclass
class Counters:
    """What the runtime did since it was applied (uploads, reuse, gradient copies, host work)."""

    uploads: int = 0
    upload_bytes: int = 0
    prefetches: int = 0  # uploads issued ahead of use
    demand_uploads: int = 0  # uploads issued when the chunk was already needed
    resident_hits: int = 0  # demands served by a chunk already in a buffer (no upload)
    evictions: int = 0
    grad_flushes: int = 0
    grad_flush_bytes: int = 0
    host_steps: int = 0
    # chunks copied back to the host at eviction: user code wrote a parameter in a buffer
    write_backs: int = 0
    host_step_s: float = 0.0  # wall time of the host steps (restore, backup, step, compute-copy refresh)
    speculative_steps: int = 0  # host steps run during backward, before optimizer.step() validated them
    host_step_redos: int = (
        0  # speculative steps redone at optimizer.step() (gradient or hyper-parameters changed)
    )
    host_step_undos: int = 0  # speculative steps undone (gradient accumulation, zero_grad without step)
    device_steps: int = 0
    iterations: int = 0  # completed backward passes
    grad_reductions: int = 0  # chunk gradients averaged (or reduce-scattered) across the job's ranks
    # persistent chunks' averages issued during backward, as it completed them (`GradientFlow.average_early`)
    overlapped_reductions: int = 0
    param_gathers: int = 0  # sharded chunks' private compute copies all-gathered after their host step
    compute_barriers: int = 0  # barriers that publish node-shared compute copies (step, undo, load, wrap)
    # sharded chunks' gradient reduce-scatters: one per chunk per synchronising backward (more where a chunk is
    # flushed in parts), none inside no_sync(); and their `.grad` all-gathers (none inside no_sync())
    reduce_scatters: int = 0
    grad_gathers: int = 0
    # device-sharded persistent chunks (`device_shards.py`): all-gathers of a whole copy (and its bytes), releases
    device_shard_gathers: int = 0
    device_shard_gather_bytes: int = 0
    device_shard_releases: int = 0
    device_shard_prefetches: int = 0  # all-gathers issued ahead of use (the next chunk of the recorded order)
    # wall time of the job's collectives, by purpose (issue 20; on CUDA the NCCL calls' issue time, not the
    # transfer): gradient reductions (reduce-scatter, all-reduce), the sharded chunks' `.grad` all-gathers,
    # their private compute-copy all-gathers after optimizer.step(), and the host worker's barriers that publish
    # node-shared compute copies (at step() and after an undo; not the ones at wrap and load, on the training
    # thread). On a CPU device each includes the wait for the slowest rank to arrive (gloo blocks until every
    # rank has joined).
    grad_reduction_s: float = 0.0
    grad_fill_s: float = 0.0
    param_gather_s: float = 0.0
    compute_barrier_s: float = 0.0
    # the control checks: tiny synchronous collectives that keep the ranks' collectives paired (the same-use
    # check at a backward's start, the agreement on the entries with a gradient at its end, the device-shard agreements)
    control_s: float = 0.0
    control_checks: int = 0
    # synchronising backwards whose reductions waited for their end: the ranks' forwards used different
    # offloaded chunks (`GradientFlow.check_same_use`); each is slower than planned (no overlap, no speculation)
    deferred_backwards: int = 0
    # CUDA: ops that read a parameter of an offloaded chunk outside its module's forward, the chunk made resident
    # for them (`foreign_reads.py`)
    foreign_reads: int = 0


@dataclass
class RuntimeReport:
    memory: MemoryReport
    counters: Counters
    chunks: int
    offloaded_chunks: int
    n_buffers: int
    chunk_size_bytes: int
    compute_dtype: str
    device: str
    host_optimizer: str  # 'fused', 'foreach' or 'none'
    upload_s: float | None = None  # CUDA with measure_uploads: summed upload copy time

    def __str__(self) -> str:
        gib = 2**30
        m = self.memory
        return (
            f"chunks {self.chunks} ({self.offloaded_chunks} offloaded, {self.n_buffers} "
            f"{'buffer' if self.n_buffers == 1 else 'buffers'} of "
            f"{self.chunk_size_bytes / 2**20:.1f} MiB), {self.compute_dtype} on {self.device}; "
            f"device {m.device_bytes / gib:.3f} GiB, host {m.host_bytes / gib:.3f} GiB "
            f"(pinned {m.pinned_host_bytes / gib:.3f} GiB"
            + (f"; node-shared {m.node_shared_host_bytes / gib:.3f} GiB" if m.node_shared_host_bytes else "")
            + f"); uploads {self.counters.uploads}, "
            f"resident hits {self.counters.resident_hits}, host optimizer {self.host_optimizer}"
        )


def measure_memory(
    states: Sequence[ChunkState],
    steppers: Sequence[ChunkStepper],
    pool: BufferPool | None,
    ctx: DeviceContext,
    shared: NodeSharedCopy | None = None,
) -> MemoryReport:
    """The bytes the chunks, their optimizer state and the buffer pool hold now, by side and category
    (`shared`: the node-shared compute copy, of which a rank holds its share)."""
    rep = MemoryReport()
    dev, host = rep.device, rep.host

    def add(d: dict[str, int], key: str, n: int) -> None:
        d[key] = d.get(key, 0) + n

    arena = ctx.host_arena
    if (
        arena is not None
    ):  # one page-locked allocation, whatever is sliced from it now (and what went around it)
        rep.pinned_host_bytes = arena.pinned_bytes
    if shared is not None:
        rep.node_shared_host_bytes = shared.nbytes
        rep.pinned_host_bytes += shared.share_bytes  # page-locked on CUDA (every rank registers its mapping)
    seen: set[int] = set()
    for st in states:
        side = host if st.offloaded else dev
        if st.own is not None:  # device-sharded persistent: own shard, and the whole copy while gathered
            assert st.params is not None
            add(dev, "parameters", st.own.nbytes)
            add(dev, "gathered_parameters", st.params.untyped_storage().nbytes())
        tensors = {
            "parameters": st.host_params if st.offloaded else (st.params if st.own is None else None),
            "gradients": st.host_grad if st.offloaded else st.grad,
            "master": st.master if st.mixed else None,
            "gradient_staging": st.stage,
            "gradient_exposed": st.user_grad,  # the `.grad` offloaded parameters show after backward
            "undo_backup": st.backup_master,  # speculative host steps: master before the step
        }
        if st.node_shared:  # views of one segment: this rank's share, counted above for pinned
            assert st.shard is not None and st.host_params is not None
            add(host, "parameters", st.shard.size * st.host_params.element_size())
            del tensors["parameters"]
        for key, t in tensors.items():
            if t is None or t.untyped_storage().data_ptr() in seen:
                continue
            seen.add(t.untyped_storage().data_ptr())
            add(side, key, t.nbytes)
            if arena is None and t.is_pinned():
                rep.pinned_host_bytes += t.nbytes
        inner = steppers[st.index].inner if steppers else None
        if inner is not None:
            for s in inner.state.values():
                for v in s.values():
                    if isinstance(v, torch.Tensor):
                        on_host = st.offloaded or (ctx.is_cuda and v.device.type == "cpu")
                        add(host if on_host else dev, "optimizer_state", v.nbytes)
        if steppers and st.offloaded and steppers[st.index].backup_nbytes():
            add(host, "undo_backup", steppers[st.index].backup_nbytes())  # optimizer state before the step
    if pool is not None:
        dev["buffers"] = pool.nbytes
    return rep
