"""Hardware probe: device name and capacity, host memory and cores, measured host<->device copy bandwidth.

Bandwidth is measured by real copies at sizes from 64 KiB to 256 MiB: for each size the copy is run a few
times (after one warm-up copy) and the median time kept. On CUDA, "pinned" copies use page-locked host
buffers (`pin_memory=True`) and "pageable" ones ordinary host memory; copies are synchronised before the
clock is read. On CPU the device *is* host memory: every curve is a real `memcpy` between two host
buffers (pinned and pageable are the same memory there, yet each curve is still measured, not copied
from another).

Each direction is measured alone on an idle device, and both pinned directions again at the same time
(`duplex_h2d_pinned`, `duplex_d2h_pinned`): the runtime overlaps uploads with gradient offloads and swap
copies, and a link or host memory system shared by both directions may give each less than it gets alone.
On CUDA the two copies run on two streams started together (one event both wait on), each timed by events on
its own stream; on CPU they run on two threads started together (a barrier), each timed by its own wall
clock. Every copy is timed by the profiler's `DeviceClock` (CUDA events read after a synchronisation, or the
wall clock on CPU). The concurrent pairs add half again as many copies (run two at a time); on the 2-core
development machine at load average 13 the whole probe took 11.6 s (median of 3, benchmarks/copy_bandwidth.py;
docs/BENCHMARKS.md). It is cached per process and device, since the machine does not change between
profiles; pass `hardware=` to `profile` to reuse one explicitly.
The CUDA branch follows the PyTorch API but was not run on the development machine (no GPU there).
"""

from __future__ import annotations

import functools
import os
import platform
import statistics
import threading

import torch

from agent.profiler.device_clock import DeviceClock
from client.contract import BandwidthCurves, BandwidthSample, DeviceType, Distributed, Hardware

KiB = 2**10
MiB = 2**20
BANDWIDTH_SIZES: tuple[int, ...] = (64 * KiB, 256 * KiB, 1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB, 256 * MiB)


def cpu_model_name() -> str:
    """The CPU model from /proc/cpuinfo (`model name`), else what the platform module reports."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def host_memory_bytes() -> int:
    """Total host RAM from /proc/meminfo (MemTotal), else from sysconf."""
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * KiB
    except OSError:
        pass
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def cpu_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _time_copy(dst: torch.Tensor, src: torch.Tensor, device: torch.device, reps: int) -> float:
    """Median seconds of `dst.copy_(src)` alone (after one warm-up copy)."""
    clock = DeviceClock(device)
    dst.copy_(src, non_blocking=clock.cuda)  # warm-up: page faults, first-touch
    clock.synchronize()
    times: list[float] = []
    for _ in range(reps):
        t0 = clock.mark()
        dst.copy_(src, non_blocking=clock.cuda)
        t1 = clock.mark()
        clock.synchronize()
        times.append(clock.seconds(t0, t1))
    return max(statistics.median(times), 1e-9)


def _time_duplex(
    dev_dst: torch.Tensor,
    host_src: torch.Tensor,
    host_dst: torch.Tensor,
    dev_src: torch.Tensor,
    reps: int,
    *,
    cuda: bool | None = None,
) -> tuple[float, float]:
    """Median seconds of an H2D copy (`host_src` -> `dev_dst`) and a D2H copy (`dev_src` -> `host_dst`) run at
    the same time, each timed alone (after one warm-up pair). `cuda`: two streams and events (default: the
    device is a GPU)."""
    device = dev_dst.device
    times: list[tuple[float, float]] = []
    if device.type == "cuda" if cuda is None else cuda:
        up, down = torch.cuda.Stream(device), torch.cuda.Stream(device)
        clock = DeviceClock(device, [up, down], cuda=True)
        for rep in range(reps + 1):
            go = torch.cuda.current_stream(device).record_event()  # both copies start from one point
            up.wait_event(go)
            down.wait_event(go)
            start = clock.mark()
            with torch.cuda.stream(up):
                dev_dst.copy_(host_src, non_blocking=True)
            with torch.cuda.stream(down):
                host_dst.copy_(dev_src, non_blocking=True)
            end = clock.mark()
            clock.synchronize()
            h2d, d2h = clock.spans(start, end)  # one span per stream: up, down
            if rep:
                times.append((h2d, d2h))
        torch.cuda.current_stream(device).wait_stream(up)
        torch.cuda.current_stream(device).wait_stream(down)
    else:
        clock = DeviceClock(device)
        for rep in range(reps + 1):
            pair = _threads_together(clock, (dev_dst, host_src), (host_dst, dev_src))
            if rep:
                times.append(pair)
    return (
        max(statistics.median(t[0] for t in times), 1e-9),
        max(statistics.median(t[1] for t in times), 1e-9),
    )


def _reps(size: int) -> int:
    return 5 if size <= 4 * MiB else (3 if size <= 64 * MiB else 2)


def _threads_together(
    clock: DeviceClock, first: tuple[torch.Tensor, torch.Tensor], second: tuple[torch.Tensor, torch.Tensor]
) -> tuple[float, float]:
    """Seconds of `dst.copy_(src)` for each (dst, src) pair, run on two threads started together (CPU)."""
    together = threading.Barrier(2)
    seconds = [0.0, 0.0]
    # the other thread's error, raised here (not a time of 0, which became a bandwidth of ~1e15 B/s)
    failed: list[BaseException] = []

    def copy(i: int, dst: torch.Tensor, src: torch.Tensor) -> None:
        together.wait()
        t0 = clock.mark()
        dst.copy_(src)  # torch releases the GIL while it copies
        seconds[i] = clock.seconds(t0, clock.mark())

    def other_copy() -> None:
        try:
            copy(1, *second)
        except BaseException as e:  # noqa: BLE001 - re-raised by the probing thread below
            failed.append(e)
            together.abort()  # the probing thread, if still waiting, gets BrokenBarrierError, not a hang

    other = threading.Thread(target=other_copy, name="memplan-d2h-probe")
    other.start()
    try:
        copy(0, *first)
    finally:
        other.join()
        if failed:
            raise failed[0]
    return seconds[0], seconds[1]


def measure_bandwidth(device: torch.device, sizes: tuple[int, ...] = BANDWIDTH_SIZES) -> BandwidthCurves:
    """H2D and D2H copy bandwidth, pinned and pageable, each alone, and pinned H2D and D2H at the same time,
    at each size (median of repetitions)."""
    curves: dict[str, list[BandwidthSample]] = {
        "h2d_pinned": [],
        "d2h_pinned": [],
        "h2d_pageable": [],
        "d2h_pageable": [],
        "duplex_h2d_pinned": [],
        "duplex_d2h_pinned": [],
    }
    pin = device.type == "cuda"
    for size in sorted(set(sizes)):
        dev = torch.empty(size, dtype=torch.uint8, device=device)
        dev.fill_(1)
        reps = _reps(size)
        for pinned in (True, False):
            host = torch.empty(size, dtype=torch.uint8, pin_memory=pin and pinned)
            host.fill_(2)
            kind = "pinned" if pinned else "pageable"
            h2d = _time_copy(dev, host, device, reps)
            d2h = _time_copy(host, dev, device, reps)
            curves[f"h2d_{kind}"].append(BandwidthSample(size_bytes=size, bytes_per_s=size / h2d))
            curves[f"d2h_{kind}"].append(BandwidthSample(size_bytes=size, bytes_per_s=size / d2h))
            if pinned:  # both directions at once: a second device buffer read while `dev` is written
                dev_src = torch.empty(size, dtype=torch.uint8, device=device).fill_(3)
                host_dst = torch.empty(size, dtype=torch.uint8, pin_memory=pin).fill_(4)
                up, down = _time_duplex(dev, host, host_dst, dev_src, reps)
                curves["duplex_h2d_pinned"].append(BandwidthSample(size_bytes=size, bytes_per_s=size / up))
                curves["duplex_d2h_pinned"].append(BandwidthSample(size_bytes=size, bytes_per_s=size / down))
                del dev_src, host_dst
            del host
        del dev
    return BandwidthCurves(**curves)


def _device_count() -> int:
    # Devices per node that the job uses: the launcher's local world size when distributed, else one.
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


@functools.lru_cache(maxsize=8)
def _probe(device_key: str) -> Hardware:
    """The device as measured (its whole capacity): one bandwidth probe per process and device, whatever
    device-memory limits the callers plan for (the limit only lowers the capacity, `probe_hardware`)."""
    device = torch.device(device_key)
    host = host_memory_bytes()
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        dtype, name, capacity = DeviceType.cuda, str(props.name), int(props.total_memory)
    elif device.type == "cpu":
        dtype, name, capacity = DeviceType.cpu, cpu_model_name(), host
    else:
        raise ValueError(f"device: {device_key!r} is not supported (cpu or cuda)")
    return Hardware(
        device_type=dtype,
        device_name=name,
        device_count=_device_count(),
        device_memory_bytes=capacity,
        host_memory_bytes=host,
        pinned_memory_limit_bytes=None,
        cpu_cores=cpu_cores(),
        bandwidth=measure_bandwidth(device),
    )


def probe_hardware(device: torch.device, device_memory_limit: int | None = None) -> Hardware:
    """The Hardware of `device` (measured once per process and device, then reused, for every
    `device_memory_limit`: the limit caps the capacity, it does not change what the copies cost)."""
    if device_memory_limit is not None and device_memory_limit <= 0:
        raise ValueError(f"device_memory_limit: must be positive, got {device_memory_limit}")
    key = str(
        device
        if device.index is not None or device.type == "cpu"
        else torch.device("cuda", torch.cuda.current_device())
    )
    hw = _probe(key)
    capacity = hw.device_memory_bytes
    if device_memory_limit is not None:
        capacity = min(capacity, device_memory_limit)
    return hw.model_copy(deep=True, update={"device_memory_bytes": capacity})


def in_group(hw: Hardware, distributed: Distributed | None) -> Hardware:
    """`hw` as one rank of the job's process group sees it (None: `hw` unchanged, a single-process job). The
    node's devices are its ranks' (launchers that set no LOCAL_WORLD_SIZE too), and the hardware key then
    names the world size, so history and the plan cache never mix a multi-rank job with a single-rank one."""
    if distributed is None:
        return hw
    return hw.model_copy(update={"distributed": distributed, "device_count": distributed.ranks_per_node})
