"""Host worker: one thread that runs host-side chunk work (gradient absorb, optimizer steps) in order.

One thread keeps per-chunk work in submission order (a chunk's gradient absorb always runs before its
step) without locks. torch's CPU kernels release the GIL and use the intra-op thread pool, so the work
overlaps the training thread's backward. Errors surface when the training thread waits on a chunk.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any


class HostWorker:
    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="memplan-host-optimizer")

    def submit(self, fn: Callable[..., None], *args: Any) -> Future[None]:
        return self._pool.submit(fn, *args)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)
