"""Runtime options: the typed knobs of applying a plan (everything else comes from the plan itself)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from client.contract import Precision

if TYPE_CHECKING:
    from client.contract import Trace, Workload


@dataclass(frozen=True)
class RuntimeOptions:
    """How to apply a plan.

    device: where persistent chunks and buffers live; default: the model's device if it is not the CPU,
        else CUDA when available, else the CPU.
    compute_dtype: dtype of the training copy (parameters, gradients); default: the model's dtype. When
        it is not fp32 the runtime keeps an fp32 master copy (mixed precision) unless fp32_master is False.
        An fp32 model wrapped with compute_dtype=torch.bfloat16 keeps its exact fp32 values as master.
    fp32_master: with a compute dtype narrower than fp32 (e.g. a bf16 model), keep an fp32 master copy and
        fp32 optimizer state, step in fp32 and round into the compute copy (default True: 4 more bytes per
        parameter, optimizer state twice as wide; on the host for offloaded chunks, on the device for
        persistent ones). Losses then differ slightly from plain bf16 PyTorch (which steps the bf16
        parameters with bf16 state): more accurate, not equal. False: no master; the optimizer steps the
        compute copy with state in the compute dtype, exactly as plain PyTorch on a bf16 model does (as
        ZeRO allows with bf16 optimizer states).
    overlap_host_step: run each offloaded chunk's host optimizer step as soon as its gradients reach the
        host, overlapped with the rest of backward (default). These steps are speculative: after backward
        every offloaded parameter exposes `.grad` (a host tensor), and `optimizer.step()` checks whether
        that gradient was changed since (clipping, unscaling, any user edit), whether the hyper-parameters
        changed, or whether another backward came first (gradient accumulation); only the chunks whose
        speculative step was wrong are restored from their backup and stepped again. `zero_grad()`
        without `step()` undoes them. Set False to run every host step at `optimizer.step()` (no backup
        memory, no overlap).
    undo_host_steps: keep, per offloaded chunk, what undoing a speculative step needs (a copy of the fp32
        master and of the optimizer state, on the host) (default True). False saves that host memory;
        then a gradient changed after an overlapped step (e.g. clipping that actually scales) raises an
        error instead of being honoured. Ignored when overlap_host_step is False.
    async_step: let `optimizer.step()` return before the host optimizer steps finish (default False).
        Each chunk's next upload waits for its own step, so deferred host steps overlap the next
        forward; but until `wrapped.synchronize()` (or a state dict, clip, report) offloaded
        parameters read directly may be mid-update.
    measure_uploads: on CUDA, time every upload with events (for the benchmark's hidden-upload figure).
    share_compute_copy: with sharded chunks and every rank on one node, keep the sharded chunks' compute copies
        once per node in shared memory (`node_shared.py`) instead of once per rank, and replace their
        all-gather after each optimizer step by a barrier (default True). False: a private copy per rank,
        all-gathered (what several nodes always do). Sharing needs it on every rank.
    shared_memory_dir: the directory the node-shared segment is created in, a tmpfs every rank of the node
        sees (default /dev/shm). It is reserved up front and unlinked as soon as every rank mapped it.
    persistent_reductions_in_backward: in a job of several ranks, average each persistent chunk's gradient as
        backward completes it, overlapping the rest of backward as DDP's buckets do, where every rank's forward
        used the same persistent parameters (else all of them after backward). None (default): on a CUDA device
        only, where the host worker issues them on the offload stream; on a CPU device they would run inline,
        overlapping nothing, and only add points where each rank waits for the others mid-backward (session
        25, 2 gloo ranks: 704 against 674 ms a step, median of 6 alternated rounds). True or False: always,
        never (True on a CPU device is for tests of the path).
    rank_arrival_timeout_s: with sharded chunks, how long rank 0 waits at a collective the user calls
        (`optimizer.state_dict()`, `optimizer.load_state_dict()`, `agent.unwrap`) for every other rank to
        call it too, before raising an error that names the call and its fix (default 60 s). A DDP habit
        calls the state dict on rank 0 alone; without the check rank 0 would wait for the backend's timeout.
    broadcast_buffers: in a job of several ranks, make every rank's persistent module buffers (BatchNorm's
        running statistics) rank 0's at the end of each synchronising backward, as `DistributedDataParallel(
        broadcast_buffers=True)` (its default) does before the next forward (default True). Non-persistent
        buffers (rotary caches, masks: recomputed or constant) are not sent.
    """

    device: torch.device | str | None = None
    compute_dtype: torch.dtype | None = None
    overlap_host_step: bool = True
    undo_host_steps: bool = True
    fp32_master: bool = True
    async_step: bool = False
    measure_uploads: bool = False
    share_compute_copy: bool = True
    shared_memory_dir: str = "/dev/shm"
    persistent_reductions_in_backward: bool | None = None
    rank_arrival_timeout_s: float = 60.0
    broadcast_buffers: bool = True

    def __post_init__(self) -> None:
        if not self.rank_arrival_timeout_s > 0:
            raise ValueError(
                f"rank_arrival_timeout_s: must be a positive number of seconds, got {self.rank_arrival_timeout_s}"
            )


def job_workload(
    workload: Workload, options: RuntimeOptions | None = None, *, clips_gradients: bool = False
) -> Workload:
    """The profiled workload as the runtime will run it, for the planner: the fp32 master and its fp32
    optimizer state (a narrower model dtype with `fp32_master`), the undo backup of speculative host steps
    (`undo_host_steps` with `overlap_host_step`: a copy of the master and of the optimizer state) and whether
    the job clips (its speculative host steps are then redone after backward). The profiler measures the
    plain job, which has none of these. A `compute_dtype` other than the model's is not modelled."""

    opts = options or RuntimeOptions()
    elt = {Precision.fp32: 4, Precision.bf16: 2, Precision.fp16: 2}[workload.precision]
    master = 4 if workload.precision != Precision.fp32 and opts.fp32_master else 0
    state = workload.optimizer_state_bytes_per_param * (4 // elt if master else 1)
    backup = (master or elt) + state if opts.overlap_host_step and opts.undo_host_steps else 0
    return workload.model_copy(
        update={
            "master_bytes_per_param": master,
            "optimizer_state_bytes_per_param": state,
            "undo_backup_bytes_per_param": backup,
            "clips_gradients": clips_gradients,
        }
    )


def job_trace(trace: Trace, options: RuntimeOptions | None = None, *, clips_gradients: bool = False) -> Trace:
    """`trace` with its workload as the runtime will run it (`job_workload`): what `agent.wrap` plans for, and
    what a benchmark that solves a profiled trace itself must plan for to predict what the runtime does."""
    return trace.model_copy(
        update={"workload": job_workload(trace.workload, options, clips_gradients=clips_gradients)}
    )
