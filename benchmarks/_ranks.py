"""Launching a benchmark's job on N ranks (issue 20): fresh processes, one process group, one result per rank.

Each rank is a new Python process (`torch.multiprocessing` with the `spawn` start method): no rank inherits
the parent's allocator cache, CUDA context or imports, as the single-process benchmarks run each strategy in
a fresh process; the parent never touches CUDA. The group is NCCL when the job's device is CUDA (rank r on
`cuda:r`), gloo on the CPU. Each rank writes its own result file; a rank that raises writes why first and
then fails, so that `start_processes` ends the other ranks instead of leaving them waiting in a collective.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

RankJob = Callable[[int, int, torch.device, dict[str, Any]], dict[str, Any]]
"""What runs on every rank: (rank, world size, this rank's device, the spec) -> this rank's result."""


def free_port() -> int:
    """A TCP port free on this host now (the group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rank_device(device_type: str, rank: int) -> torch.device:
    """Rank r's device: `cuda:r` (one GPU per rank on one node) or the CPU."""
    return torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")


def backend_for(device_type: str) -> str:
    return "nccl" if device_type == "cuda" else "gloo"


def reset_peak_rss() -> bool:
    """Restart this process's resident-set high-water mark (`VmHWM`; Linux >= 4.0: "5" to clear_refs), so
    that `peak_rss_bytes` covers a window (the training steps), not what came before (rank 0's profile and
    hardware probe, whose buffers are freed). False where the kernel does not allow it. (It also resets what
    `getrusage`'s ru_maxrss reports, which is why no lifetime peak is offered beside it.)"""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int | None:
    """This process's resident-set high-water mark since the last `reset_peak_rss` (None off Linux)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def rss_bytes() -> int:
    """This process's resident set now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def launch(
    job: RankJob,
    world: int,
    spec: dict[str, Any],
    *,
    timeout_s: float = 600.0,
    start_method: str = "spawn",
) -> list[dict[str, Any]]:
    """Run `job` on `world` fresh ranks; rank r's result at index r. A rank that failed, or was ended because
    another failed, has {"skipped": why} (the first failure's reason is in its own row). `timeout_s` bounds
    every collective (a rank left waiting fails instead of hanging). `start_method="fork"` is for tests on
    the CPU only (the ranks start with the parent's imports: seconds instead of ~10 s each on a loaded
    2-core machine); benchmarks spawn, so that no rank inherits the parent's state."""
    with tempfile.TemporaryDirectory(prefix="memplan-ranks-") as tmp:
        error: str | None = None
        try:
            mp.start_processes(
                _entry,
                args=(world, free_port(), job, spec, tmp, timeout_s),
                nprocs=world,
                join=True,
                start_method=start_method,
            )
        except Exception as exc:  # noqa: BLE001 - a failed rank is a result of the benchmark, not a crash
            error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"
        rows: list[dict[str, Any]] = []
        for r in range(world):
            f = Path(tmp) / f"rank{r}.json"
            if f.is_file():
                rows.append(json.loads(f.read_text()))
            else:
                rows.append(
                    {"skipped": f"rank {r} ended without a result ({error or 'no error reported'})"[:400]}
                )
        return rows


def _entry(
    rank: int, world: int, port: int, job: RankJob, spec: dict[str, Any], out: str, timeout_s: float
) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    device = rank_device(spec["device_type"], rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend_for(device.type),
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
        device_id=device if device.type == "cuda" else None,
    )
    target = Path(out) / f"rank{rank}.json"
    try:
        row = job(rank, world, device, spec)
        target.write_text(json.dumps(row, default=str))
    except BaseException as exc:
        target.write_text(
            json.dumps(
                {
                    "skipped": f"rank {rank}: {type(exc).__name__}: {exc}"[:400],
                    "out_of_memory": isinstance(exc, torch.OutOfMemoryError),
                    "traceback": traceback.format_exc()[-2000:],
                }
            )
        )
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
