"""Collective probe (issue 20): the job's own process group, measured as the sharded runtime will use it.

Every rank calls `probe_process_group` (it runs collectives); each gets the same `Distributed`, which rank 0
puts in the one trace it profiles and uploads for the job (`profile(..., distributed=...)`).

Measured, on the job's group and device:
- all-gather (`all_gather_into_tensor`) and reduce-scatter (`reduce_scatter_tensor`) at a few whole-tensor
  sizes: per size one warm-up, one barrier, then the repetitions one after another, as the runtime issues
  them (a sharded chunk's reduce-scatter then its `.grad` all-gather; the compute-copy all-gathers at step()
  in chunk order), timed together (`_consecutive_time`); a collective is as slow as its slowest rank, so the
  slowest rank's time is kept (all-reduce MAX). (Each repetition after a barrier of its own, as measured
  before, read 1.5-3x faster on gloo than the same collectives issued one after another: both ranks start
  together, which a training step never arranges; docs/BENCHMARKS.md, "Where the managed 2-rank iteration
  goes".) The contract's rate is the whole tensor over the time (`CollectiveSample`: algorithm bandwidth).
  On a CPU device (gloo) the curves are instead measured as a training step issues them
  (`measure_in_step_curves`, session 9): a burst of compute (the same matmuls on every rank), the reduce-scatter,
  right after it the all-gather (a sharded chunk's gradient, then its `.grad` fill), another burst, the all-reduce
  (a replicated chunk's gradient average; the `all_reduce` curve); each call's mean time over the repetitions and
  the ranks, its wait for the later rank included. Why: on a CPU device compute, the gloo threads and the other
  ranks share the cores, and a collective issued after compute (the ranks arriving apart, the gloo threads
  woken from idle) took 2-5x what the same collective took back to back on this machine
  (docs/BENCHMARKS.md, "Where the managed 2-rank iteration goes"); back to back it is the figure of a loop the
  runtime never runs. A GPU job's collectives run on NCCL's stream beside compute on devices the ranks do not
  share, so the CUDA branch keeps the back-to-back timing (unmeasured here: no GPU on the development machine)
  and leaves `all_reduce` empty (the cost model then reads an all-reduce as a reduce-scatter plus an all-gather).
- overlap with host<->device copies: at one size, the collective alone, a copy of the same size alone, and
  both started together (the collective asynchronous, the copy on its own CUDA stream on a GPU; on a CPU the
  gloo worker thread runs the collective while this thread copies), for all-gather beside H2D and
  reduce-scatter beside D2H, the two pairs the runtime overlaps (prefetch, gradient offload).
- control checks (`control_s`): one tiny all-gather (two int32 per rank) read on the host, as the runtime's
  per-iteration checks issue it (the same-use check at a backward's start, the agreement on the entries with a gradient at its end, the
  device-shard agreements; the barrier at step()): after a compute burst on a CPU device, back to back on a GPU.
  On this 2-core VM one such call took 0.5-2.5 ms after compute, against nothing in the cost model before
  (docs/BENCHMARKS.md, "Session 10"). On a CPU device also `phase_control_s`: the same call after a burst of
  PHASE_BURSTS in-step bursts (~20 ms, a training phase's compute), what the checks at a phase's end pay: the
  wait for the later rank grows with the compute before the call and levels off (2 ranks on the 2-core VM,
  means of 16 after bursts of 2, 5, 10, 20, 40 ms: ~1.6, ~1.3, ~2.5, ~2.9, ~2.4 ms; session 13), and the
  checks at backward's start measured 0.6-3.6 ms above the 5 ms figure in the benchmark's rows.
- ranks per node: ranks whose host name is rank 0's (the busiest host when hosts differ); the interconnect
  names the backend, and the links as far as the process can tell (peer access between CUDA devices; one
  host: shared memory or loopback).

On CPU (gloo) every figure is a real measurement of the loopback group; the CUDA/NCCL branch follows the
PyTorch API and was not run on the development machine (no GPU there).

Planning a multi-rank job (`probe_for_planning`): under a process group `agent.wrap` obtains the plan once, on
rank 0 (history, the service, or profiling and solving in-process), and broadcasts it. That plan is the job's,
not rank 0's alone: it may shard offloaded chunks across the ranks and it times the collectives that sharding
and the gradient average add, so the job's trace must carry the group (every rank profiles at once and the
slowest rank's trace is the job's: `agent/group_profiling.py`). The probe is a collective: every rank
calls it with the same sizes, or none does. Only rank 0 knows whether it will profile (a plan given to wrap,
or no sample batch, needs no probe), so rank 0 decides and broadcasts the decision together with the sizes
(`ProbeSettings`, scaled to the model so that a small model's probe stays short); every rank then probes or
not. `agent.profile(process_group=)` does the same with rank 0's model. A plan found in the service's history
is found after the probe (the look-up needs the hardware key, which names the ranks per node, which takes a
collective to learn): a history hit pays for one probe it does not use.
"""

from __future__ import annotations

import functools
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch
import torch.distributed as dist

from agent.runtime.process_group import UnevenNodesError, all_gather_single, reduce_scatter_single
from agent.runtime.process_group import ranks_per_node as node_ranks
from client.contract import (
    IN_STEP_BURST_S,
    CollectiveBackend,
    CollectiveCopyOverlap,
    CollectiveCurves,
    CollectiveSample,
    Distributed,
    Interconnect,
)

if TYPE_CHECKING:
    from torch import nn

    from agent.runtime.process_group import RankGroup

log = logging.getLogger(__name__)

KiB = 2**10
MiB = 2**20
COLLECTIVE_SIZES: tuple[int, ...] = (256 * KiB, 4 * MiB, 32 * MiB, 128 * MiB)
OVERLAP_SIZE = 32 * MiB
REPEATS = 5
SMALLEST_SIZE = 64 * KiB
"""The smallest whole tensor `ProbeSettings.for_model` measures (a model smaller than that is measured there)."""
PLANNING_REPEATS = 3
"""Repetitions per size when a job is probed to be planned (`agent.wrap`, `agent.profile(process_group=)`)."""
IN_STEP_REPEATS = 16
"""Repetitions per size of the in-step sequence on a CPU device (at least; more when `repeats` asks for more):
its calls vary with the other rank's arrival and take a heavy-tailed time (on the 2-core VM a 512 KiB all-reduce
took ~0.5 or ~2.5 ms, by turns), so the mean of a few is noisy (8 before session 10)."""
IN_STEP_COMPUTE_S = IN_STEP_BURST_S
"""The compute burst before each in-step collective, about one block's backward on a CPU (the benchmark's 4-layer
models: 5-7 ms; 2 ms before session 10, after which a 512 KiB all-reduce read 1.1-2.0 ms where the managed run's
took 2.3-3.4 ms, and 1.9-3.8 ms after 5-6 ms bursts: docs/BENCHMARKS.md, session 10)."""
PHASE_BURSTS = 4
"""In-step bursts before each call of the phase-end control check (`phase_control_s`): ~20 ms of compute, past
where the wait for the later rank levels off on the 2-core VM (session 13)."""
COMPUTE_DIM = 128
CALIBRATION_START = 8
CALIBRATION_TIMINGS = 3
CALIBRATION_MAX = 1 << 20


@dataclass(frozen=True)
class ProbeSettings:
    """What `probe_process_group` measures; every rank of the group must use the same settings (rank 0 picks
    them and broadcasts them in `agent.wrap`)."""

    sizes: tuple[int, ...] = COLLECTIVE_SIZES
    overlap_size: int = OVERLAP_SIZE
    repeats: int = REPEATS

    @classmethod
    def for_model(cls, model_bytes: int, repeats: int = PLANNING_REPEATS) -> ProbeSettings:
        """The default sizes up to the model's parameter bytes, then that size itself: no chunk of the plan is
        larger than the model (the cost model reads a curve flat beyond its largest sample), so a small model's
        probe stays short instead of moving 128 MiB tensors it will never have. The overlap is measured at the
        largest size measured, at most OVERLAP_SIZE."""
        top = min(COLLECTIVE_SIZES[-1], max(SMALLEST_SIZE, model_bytes))
        sizes = tuple(s for s in COLLECTIVE_SIZES if s < top) + (top,)
        return cls(sizes=sizes, overlap_size=min(OVERLAP_SIZE, top), repeats=repeats)


class CollectiveProbeError(RuntimeError):
    """The process group cannot be probed (not initialised, an unsupported backend, uneven nodes)."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _slowest(seconds: float, group: dist.ProcessGroup | None, device: torch.device) -> float:
    """The largest of every rank's `seconds` (a collective finishes when its slowest rank does)."""
    t = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return max(float(t.item()), 1e-9)


def _median_time(
    run: Callable[[], object], group: dist.ProcessGroup | None, device: torch.device, repeats: int
) -> float:
    run()  # warm-up: connections, buffers, first touch
    _sync(device)
    times: list[float] = []
    for _ in range(repeats):
        dist.barrier(group=group)
        _sync(device)
        t0 = time.perf_counter()
        run()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return _slowest(statistics.median(times), group, device)


def _consecutive_time(
    run: Callable[[], object], group: dist.ProcessGroup | None, device: torch.device, repeats: int
) -> float:
    """Seconds per call of `repeats` calls issued one after another (after one warm-up call and one barrier),
    the slowest rank's."""
    run()  # warm-up: connections, buffers, first touch
    _sync(device)
    dist.barrier(group=group)
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(repeats):
        run()
    _sync(device)
    return _slowest((time.perf_counter() - t0) / repeats, group, device)


def _elements(size_bytes: int, world: int) -> int:
    """Elements (uint8) of a whole tensor of about `size_bytes`, divisible by the world size."""
    return max(world, size_bytes // world * world)


def _all_gather(
    size_bytes: int, group: dist.ProcessGroup | None, device: torch.device, world: int
) -> tuple[torch.Tensor, torch.Tensor, int]:
    n = _elements(size_bytes, world)
    out = torch.empty(n, dtype=torch.uint8, device=device)
    shard = torch.ones(n // world, dtype=torch.uint8, device=device)
    return out, shard, n


def _reduce_buffers(
    size_bytes: int, device: torch.device, world: int
) -> tuple[torch.Tensor, torch.Tensor, int]:
    # float32: the sum of a gradient; uint8 has no meaningful SUM on every backend
    n = max(world, size_bytes // 4 // world * world)
    whole = torch.ones(n, dtype=torch.float32, device=device)
    shard = torch.empty(n // world, dtype=torch.float32, device=device)
    return whole, shard, n * 4


def measure_curves(
    group: dist.ProcessGroup | None,
    device: torch.device,
    sizes: tuple[int, ...] = COLLECTIVE_SIZES,
    repeats: int = REPEATS,
) -> tuple[list[CollectiveSample], list[CollectiveSample]]:
    """All-gather and reduce-scatter rates by whole-tensor size (consecutive calls, the slowest rank's time)."""
    world = dist.get_world_size(group)
    gather: list[CollectiveSample] = []
    reduce: list[CollectiveSample] = []
    for size in sorted(set(sizes)):
        out, shard, n = _all_gather(size, group, device, world)
        t = _consecutive_time(
            functools.partial(all_gather_single, out, shard, group=group), group, device, repeats
        )
        gather.append(CollectiveSample(size_bytes=n, bytes_per_s=n / t))
        whole, part, nbytes = _reduce_buffers(size, device, world)
        t = _consecutive_time(
            functools.partial(reduce_scatter_single, part, whole, group=group), group, device, repeats
        )
        reduce.append(CollectiveSample(size_bytes=nbytes, bytes_per_s=nbytes / t))
    return _unique(gather), _unique(reduce)


class _Compute:
    """A burst of compute on the device between collectives, as a training step has a block's backward
    between its chunks' gradient collectives: `count` matmuls of COMPUTE_DIM x COMPUTE_DIM (fp32), the same
    count on every rank (so a slower rank arrives later, as it does in training).

    Calibrated on bursts of many matmuls (the least of CALIBRATION_TIMINGS timings, from a count that takes
    at least a quarter of the target), every rank at once; the ranks' mean time per matmul sets the count.
    Until session 11 one matmul was timed alone (count 1), which reads its first-call and dispatch overhead
    (~100-150 us where a matmul in a run of 1,000 takes ~56 us on the development VM) and took the least
    count of the ranks: bursts meant as 5 ms took 1-2.5 ms."""

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device, target_s: float) -> None:
        self.a = torch.randn(COMPUTE_DIM, COMPUTE_DIM, device=device)
        self.b = torch.randn(COMPUTE_DIM, COMPUTE_DIM, device=device)
        self.count = CALIBRATION_START
        self()  # warm-up
        while True:
            best = min(_timed(self, device) for _ in range(CALIBRATION_TIMINGS))
            if best >= target_s / 4 or self.count >= CALIBRATION_MAX:
                break
            self.count *= 4
        per = torch.tensor([max(best, 1e-9) / self.count], dtype=torch.float64, device=device)
        dist.all_reduce(per, group=group)  # the same work on every rank: the ranks' mean time per matmul
        mean_per = float(per.item()) / dist.get_world_size(group)
        self.count = max(1, min(CALIBRATION_MAX, round(target_s / mean_per)))

    def __call__(self) -> None:
        for _ in range(self.count):
            torch.mm(self.a, self.b)


def _timed(run: Callable[[], object], device: torch.device) -> float:
    t0 = time.perf_counter()
    run()
    _sync(device)
    return time.perf_counter() - t0


def _mean_over_ranks(seconds: list[float], group: dist.ProcessGroup | None, device: torch.device) -> float:
    """The mean over ranks of each rank's mean seconds per call: what a rank's step pays per call on average
    (a call's time on a rank includes its wait for the ranks that arrive later)."""
    t = torch.tensor([statistics.fmean(seconds)], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return max(float(t.item()) / dist.get_world_size(group), 1e-9)


def measure_in_step_curves(
    group: dist.ProcessGroup | None,
    device: torch.device,
    sizes: tuple[int, ...] = COLLECTIVE_SIZES,
    repeats: int = IN_STEP_REPEATS,
    compute_s: float = IN_STEP_COMPUTE_S,
    compute: _Compute | None = None,
) -> tuple[list[CollectiveSample], list[CollectiveSample], list[CollectiveSample]]:
    """All-gather, reduce-scatter and all-reduce rates by whole-tensor size as a training step on a CPU device
    issues them (see `probe_process_group`): per repetition a burst of compute, the reduce-scatter of a sharded
    chunk's gradient, right after it the all-gather of the shards (its `.grad` fill), another burst, the
    all-reduce of a replicated chunk's gradient; each call timed on every rank (mean of the repetitions, mean
    over the ranks). The all-gather is of fp32 shards (the gradient's dtype), `size_bytes` its output."""
    world = dist.get_world_size(group)
    compute = compute or _Compute(group, device, compute_s)  # (a collective: its count is agreed)
    gather: list[CollectiveSample] = []
    reduce: list[CollectiveSample] = []
    allreduce: list[CollectiveSample] = []
    for size in sorted(set(sizes)):
        whole, part, nbytes = _reduce_buffers(size, device, world)
        gathered = torch.empty_like(whole)
        summed = torch.ones_like(whole)
        rs = functools.partial(reduce_scatter_single, part, whole, group=group)
        ag = functools.partial(all_gather_single, gathered, part, group=group)
        ar = functools.partial(dist.all_reduce, summed, group=group)
        times: dict[str, list[float]] = {"rs": [], "ag": [], "ar": []}
        # warm-up: connections, buffers, first touch
        rs(), ag(), ar()
        _sync(device)
        dist.barrier(group=group)
        for _ in range(repeats):
            compute()
            times["rs"].append(_timed(rs, device))
            times["ag"].append(_timed(ag, device))
            compute()
            times["ar"].append(_timed(ar, device))
        for key, curve in (("rs", reduce), ("ag", gather), ("ar", allreduce)):
            t = _mean_over_ranks(times[key], group, device)
            curve.append(CollectiveSample(size_bytes=nbytes, bytes_per_s=nbytes / t))
    return _unique(gather), _unique(reduce), _unique(allreduce)


CONTROL_ELEMENTS = 2
"""int32 elements per rank of the tiny all-gather timed as a control check (the device-shard agreement's row; the
same-use check's row is one element per offloaded chunk: latency-bound either way)."""


def _control_gather(group: dist.ProcessGroup | None, device: torch.device) -> Callable[[], object]:
    """One control check as the runtime issues it (`RankGroup.gather_rows`): an all-gather of a tiny int32 row,
    then its rows read on the host (on CUDA the read waits for the device, as the runtime's check does)."""
    world = dist.get_world_size(group)
    row = torch.zeros(CONTROL_ELEMENTS, dtype=torch.int32, device=device)
    full = torch.empty(world * CONTROL_ELEMENTS, dtype=torch.int32, device=device)

    def run() -> object:
        all_gather_single(full, row, group=group)
        return full.tolist()

    return run


def measure_control_s(
    group: dist.ProcessGroup | None,
    device: torch.device,
    repeats: int = IN_STEP_REPEATS,
    compute: Callable[[], None] | None = None,
) -> float:
    """Seconds of one control check (`CollectiveCurves.control_s`): with `compute` (a CPU device) each call
    after a burst of it, as a backward's start and end come after compute (the mean over repetitions and over
    the ranks: a call's time on a rank includes its wait for the ranks that arrive later); without, calls back
    to back (the slowest rank's)."""
    run = _control_gather(group, device)
    if compute is None:
        return _consecutive_time(run, group, device, repeats)
    run()  # warm-up
    dist.barrier(group=group)
    times: list[float] = []
    for _ in range(repeats):
        compute()
        times.append(_timed(run, device))
    return _mean_over_ranks(times, group, device)


def _unique(samples: list[CollectiveSample]) -> list[CollectiveSample]:
    """Sorted by size, one sample per size (tiny sizes rounded to the world size can coincide)."""
    by_size = {s.size_bytes: s for s in samples}
    return [by_size[k] for k in sorted(by_size)]


def measure_overlap(
    collective: Literal["all_gather", "reduce_scatter"],
    direction: Literal["h2d", "d2h"],
    group: dist.ProcessGroup | None,
    device: torch.device,
    size_bytes: int = OVERLAP_SIZE,
    repeats: int = REPEATS,
) -> CollectiveCopyOverlap:
    """The collective alone, a copy alone, and both together (slowest rank's medians)."""
    world = dist.get_world_size(group)
    cuda = device.type == "cuda"
    if collective == "all_gather":
        out, shard, coll_bytes = _all_gather(size_bytes, group, device, world)

        def start() -> dist.Work | None:
            return all_gather_single(out, shard, group=group, async_op=True)
    else:
        whole, part, coll_bytes = _reduce_buffers(size_bytes, device, world)

        def start() -> dist.Work | None:
            return reduce_scatter_single(part, whole, group=group, async_op=True)

    # a separate device buffer for the copy: on a CPU "device" both ends are host memory (a memcpy)
    dev_buf = torch.empty(size_bytes, dtype=torch.uint8, device=device)
    host_buf = torch.ones(size_bytes, dtype=torch.uint8, pin_memory=cuda)
    src, dst = (host_buf, dev_buf) if direction == "h2d" else (dev_buf, host_buf)
    stream = torch.cuda.Stream(device) if cuda else None

    def copy() -> None:
        if stream is not None:
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)
        else:
            dst.copy_(src)

    def collective_alone() -> None:
        work = start()
        if work is not None:
            work.wait()

    def together() -> None:
        work = start()
        copy()
        if work is not None:
            work.wait()

    alone = _median_time(collective_alone, group, device, repeats)
    copy_s = _median_time(copy, group, device, repeats)
    both = _median_time(together, group, device, repeats)
    return CollectiveCopyOverlap(
        collective=collective,
        direction=direction,
        collective_bytes=coll_bytes,
        copy_bytes=size_bytes,
        collective_s=alone,
        copy_s=copy_s,
        concurrent_s=both,
    )


def ranks_per_node(group: dist.ProcessGroup | None) -> int:
    """Ranks on the busiest host (host names gathered from every rank); must divide the world size."""
    try:
        return node_ranks(group)
    except UnevenNodesError as e:
        raise CollectiveProbeError(str(e)) from e


def interconnect(group: dist.ProcessGroup | None, device: torch.device, per_node: int) -> Interconnect:
    """The backend and links of the group, as far as this process can tell."""
    name = str(dist.get_backend(group)).lower()
    try:
        backend = CollectiveBackend(name)
    except ValueError:
        raise CollectiveProbeError(
            f"backend: {name!r} is not one memplan plans for ({', '.join(b.value for b in CollectiveBackend)})"
        ) from None
    if device.type == "cuda" and torch.cuda.device_count() > 1:
        peer = torch.cuda.can_device_access_peer(device.index or 0, 1 if (device.index or 0) == 0 else 0)
        intra = "cuda peer-to-peer (nvlink or pcie)" if peer else "cuda through host memory (no peer access)"
    elif device.type == "cuda":
        intra = "cuda, one visible device per process"
    else:
        intra = "one host: shared memory or loopback tcp"
    world = dist.get_world_size(group)
    return Interconnect(
        backend=backend,
        intra_node=intra,
        inter_node=None if per_node == world else f"{backend.value} network",
    )


def probe_process_group(
    group: dist.ProcessGroup | None = None,
    device: torch.device | str | None = None,
    *,
    sizes: tuple[int, ...] = COLLECTIVE_SIZES,
    overlap_size: int = OVERLAP_SIZE,
    repeats: int = REPEATS,
) -> Distributed:
    """Measure the job's group (a collective call: every rank of `group` must call it with the same
    arguments). `device`: where the runtime keeps chunks (default: the current CUDA device for NCCL, the
    CPU for gloo)."""
    if not dist.is_available() or not dist.is_initialized():
        raise CollectiveProbeError("process group: torch.distributed is not initialised")
    if repeats < 1:
        raise ValueError(f"repeats: must be at least 1, got {repeats}")
    if device is None:
        nccl = str(dist.get_backend(group)).lower() == "nccl"
        device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    dev = torch.device(device)
    world = dist.get_world_size(group)
    per_node = ranks_per_node(group)
    link = interconnect(group, dev, per_node)
    if world == 1:
        return Distributed(world_size=1, ranks_per_node=1, interconnect=link)
    allreduce: list[CollectiveSample] = []
    if dev.type == "cpu":  # compute and gloo share the cores: timed as a training step issues them
        in_step = max(repeats, IN_STEP_REPEATS)
        burst = _Compute(
            group, dev, IN_STEP_COMPUTE_S
        )  # calibrated once for the curves and the control check
        gather, reduce, allreduce = measure_in_step_curves(group, dev, sizes, in_step, compute=burst)
        control = measure_control_s(group, dev, in_step, burst)

        def phase() -> None:
            for _ in range(PHASE_BURSTS):
                burst()

        phase_control = measure_control_s(group, dev, in_step, phase)
    else:  # a GPU's collectives run on their own stream beside compute (NCCL): back to back (not run here)
        gather, reduce = measure_curves(group, dev, sizes, repeats)
        control = measure_control_s(group, dev, max(repeats, IN_STEP_REPEATS))
        phase_control = 0.0  # not measured on a GPU: `control_s` (back to back) prices every check
    overlap = [
        measure_overlap("all_gather", "h2d", group, dev, overlap_size, repeats),
        measure_overlap("reduce_scatter", "d2h", group, dev, overlap_size, repeats),
    ]
    return Distributed(
        world_size=world,
        ranks_per_node=per_node,
        interconnect=link,
        collectives=CollectiveCurves(
            all_gather=gather,
            reduce_scatter=reduce,
            copy_overlap=overlap,
            all_reduce=allreduce,
            control_s=max(control, 1e-9),
            phase_control_s=max(phase_control, 1e-9) if phase_control else 0.0,
        ),
    )


def parameter_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters (the most one chunk of its plan can hold)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def probe_for_planning(group: RankGroup, profiled: nn.Module | None) -> Distributed | None:
    """The job's group as measured on every rank, or None when rank 0 will not profile (see "Planning a
    multi-rank job" above). Every rank of `group` calls this: it broadcasts rank 0's decision, then probes on
    every rank or on none. `profiled`: on rank 0, the model it is about to profile for a plan, else None; the
    other ranks' argument is not read."""
    settings: ProbeSettings | None = group.broadcast_object(
        ProbeSettings.for_model(parameter_bytes(profiled)) if group.is_main and profiled is not None else None
    )
    if settings is None:
        return None
    started = time.perf_counter()
    distributed = probe_process_group(
        group.group,
        group.device,
        sizes=settings.sizes,
        overlap_size=settings.overlap_size,
        repeats=settings.repeats,
    )
    log.info(
        "memplan: measured the collectives of the %d-rank group (%s, sizes up to %d bytes) in %.2f s",
        group.world_size,
        group.backend,
        max(settings.sizes),
        time.perf_counter() - started,
    )
    return distributed
