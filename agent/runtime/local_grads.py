"""Local gradients of sharded chunks inside `no_sync()` (issue 20): accumulated whole on the host, reduced once.

As `DistributedDataParallel.no_sync`: a backward inside `no_sync()` moves nothing between the ranks. A sharded
offloaded chunk's flush then copies its whole gradient area (this rank's own, un-averaged gradient) to the host
and adds it into the chunk's `user_grad` (whole, compute dtype: the buffer `.grad` views, so after a no_sync
backward `.grad` is the local accumulated gradient, as DDP's `param.grad`). No new host memory: `user_grad`
exists for every sharded chunk anyway. The first flush of the chunk in the next synchronising backward adds
`user_grad` into the device gradient area before its reduce-scatter, so one reduce-scatter moves the sum
(`ChunkState.local` says the add is still due: it happens exactly once, also when the chunk is flushed again
later in that backward). A chunk the synchronising backward does not use is reduce-scattered straight from
`user_grad` at its end (`GradientFlow.average_stragglers`).

Precision: the local sum and the add are in the compute dtype. In fp32 this is DDP's arithmetic (autograd adds
each micro-step into `.grad`, the bucket is all-reduced once). With bf16 compute and an fp32 master it is what
DDP of a bf16 model does (`.grad` accumulates in bf16); outside `no_sync()` the runtime instead accumulates the
averaged shards in the fp32 host gradient, so accumulation inside `no_sync()` rounds each micro-step's sum to
bf16 where the other path rounds each micro-step's average (the reduce-scatter is in bf16 either way).

On a CPU device the gradient area is host memory: added directly. On CUDA the copies go through the chunk's
pinned staging buffer (one shard, `s` elements) in `world_size` pieces, on the host worker and the offload
stream. THE CUDA FUNCTIONS HERE ARE WRITTEN BUT HAVE NEVER RUN ON A GPU (no GPU where they were written). What
ran: the CPU path (gloo, `tests/agent/distributed/test_sharded_chunks.py`), and these CUDA functions on CPU under
the stream-ordering checker (a test double simulating streams and events, 2 ranks): no ordering violation, and
the same parameters as the CPU path to the bit; taking out either host wait below makes the checker fail.
"""

from __future__ import annotations

import torch

from agent.runtime.chunks import ChunkState
from agent.runtime.device import DeviceContext


def whole_user_grad(st: ChunkState, ctx: DeviceContext, dtype: torch.dtype) -> torch.Tensor:
    """The chunk's `user_grad` (host, pageable, `dtype`, the whole zero-padded chunk for a sharded one), made on
    first use."""
    if st.user_grad is None:
        n = st.shard.total if st.shard is not None else st.numel
        st.user_grad = ctx.host_empty(n, dtype, pinned=False)
    return st.user_grad


def accumulate(user: torch.Tensor, area: torch.Tensor, *, fresh: bool) -> None:
    """CPU device: the whole gradient area (host memory) into `user` (overwritten when `fresh`, else added)."""
    whole = area[: user.numel()]
    if fresh:
        user.copy_(whole)
    else:
        user.add_(whole)


def add_to_area(user: torch.Tensor, area: torch.Tensor) -> None:
    """CPU device: the accumulated local gradient into the gradient area, before its reduce-scatter."""
    area[: user.numel()].add_(user)


def accumulate_on_device(
    st: ChunkState,
    area: torch.Tensor,
    user: torch.Tensor,
    stream: torch.cuda.Stream | None,
    copied: torch.cuda.Event,
    fresh: bool,
) -> None:
    """Host worker, CUDA (WRITTEN, NOT RUN ON A GPU): the whole gradient area to the host through the pinned
    staging buffer, one shard-sized piece at a time on the offload stream (after the compute the flush waited
    for), each piece overwritten into or added to `user`; then `copied` is recorded (the slot may be reused)."""
    assert st.shard is not None and st.stage is not None
    s, stage = st.shard.size, st.stage
    landed = torch.cuda.Event()
    with torch.cuda.stream(stream):
        for i in range(st.shard.world_size):
            piece = slice(i * s, (i + 1) * s)
            stage.copy_(area[piece], non_blocking=True)
            landed.record(stream)
            landed.synchronize()  # the host reads the stage next, and the next piece rewrites it
            if fresh:
                user[piece].copy_(stage)
            else:
                user[piece].add_(stage)
        copied.record(stream)


def add_to_area_on_device(st: ChunkState, area: torch.Tensor, stream: torch.cuda.Stream | None) -> None:
    """Host worker, CUDA (WRITTEN, NOT RUN ON A GPU): `user_grad` into the device gradient area before the
    reduce-scatter, one shard-sized piece at a time: the host copies the piece into the pinned staging buffer, an
    H2D copy and an add run on the offload stream (the stream the reduce-scatter then runs on), and the host
    waits for the H2D copy before the next piece rewrites the stage."""
    assert st.shard is not None and st.stage is not None and st.user_grad is not None
    s, stage, user = st.shard.size, st.stage, st.user_grad
    sent = torch.cuda.Event()
    with torch.cuda.stream(stream):
        for i in range(st.shard.world_size):
            piece = slice(i * s, (i + 1) * s)
            stage.copy_(user[piece])
            area[piece].add_(stage.to(area.device, non_blocking=True))
            sent.record(stream)
            sent.synchronize()
