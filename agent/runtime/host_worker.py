"""Host worker: runs host-side chunk work (gradient absorb, optimizer steps) in submission order.

On CUDA it is one thread: per-chunk work stays in submission order (a chunk's gradient absorb always runs
before its step) without locks, and torch's CPU kernels release the GIL, so the host work overlaps the
training thread's backward while the GPU computes. Errors surface when the training thread waits on a chunk.

On a CPU device (`inline=True`) the work runs at once on the calling thread and the returned future is
already done. There the "device" compute and the host work use the same cores: a second thread has no
idle hardware to overlap with, only the GIL and the cores to contend for (measured on 2 cores: llama-24L
with every chunk offloaded spent ~7 ms more per iteration with the thread than inline). Inline is also what
the cost model assumes for a CPU device (no copy/compute overlap: host steps serial with compute).
Inline work runs with torch's dispatch modes switched off, as the thread's does (modes are thread-local):
it is host work on host memory, and on CPU the device-memory meter (`agent.measure`, a TorchDispatchMode on
the training thread) would otherwise count its temporaries as device memory (issue 20: a sharded chunk's
all-gathers copy this rank's shard first, which the plan rightly does not count as device memory).
`modes_see_inline_work=True` keeps the modes on (the CUDA-semantics checker's simulation is a dispatch mode
that must see the host jobs).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from torch.utils._python_dispatch import _disable_current_modes


class HostWorker:
    def __init__(self, *, inline: bool = False, modes_see_inline_work: bool = False) -> None:
        self.inline = inline
        self.modes_see_inline_work = modes_see_inline_work
        self._pool = (
            None if inline else ThreadPoolExecutor(max_workers=1, thread_name_prefix="memplan-host-optimizer")
        )

    def submit(self, fn: Callable[..., None], *args: Any) -> Future[None]:
        if self._pool is not None:
            return self._pool.submit(fn, *args)
        done: Future[None] = Future()
        try:
            if self.modes_see_inline_work:
                fn(*args)
            else:
                with _disable_current_modes():
                    fn(*args)
        except Exception as e:  # surfaces when the training thread waits on the chunk, as with the thread
            done.set_exception(e)
        else:
            done.set_result(None)
        return done

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
