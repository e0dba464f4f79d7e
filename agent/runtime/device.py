"""Device context: where chunks live, and the streams and events that order copies against compute.

On CUDA the runtime uses two side streams (host->device uploads and device->host gradient offloads)
and orders them against the compute stream with events, never with a global synchronisation. On CPU
"device" and "host" are both CPU memory: copies are real copies, streams and events are no-ops (every
`Event` is `None`), so the same code path runs in CI. The CUDA branches below are written for, but
could not be exercised in, the CPU-only session that wrote them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, TypeAlias

import torch

if TYPE_CHECKING:
    from agent.runtime.host_arena import HostArena

Event: TypeAlias = "torch.cuda.Event | None"


class DeviceContext:
    """One compute device plus its host, with an upload stream and an offload stream on CUDA."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.is_cuda = device.type == "cuda"
        if self.is_cuda:
            self.upload_stream: torch.cuda.Stream | None = torch.cuda.Stream(device)
            self.offload_stream: torch.cuda.Stream | None = torch.cuda.Stream(device)
        else:
            self.upload_stream = None
            self.offload_stream = None
        # every pinned host buffer is sliced from this one allocation when set (`agent.wrap` sets it: see
        # `host_arena.py`); None: each pinned buffer is its own allocation from PyTorch's caching host allocator
        self.host_arena: HostArena | None = None

    # ----------------------------------------------------------------------------------- allocation
    def device_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, device=self.device)

    def host_empty(self, numel: int, dtype: torch.dtype, *, pinned: bool) -> torch.Tensor:
        """Host memory; page-locked on CUDA when `pinned` (so copies can be asynchronous). A pinned buffer
        comes from the host arena when there is one (a buffer that does not fit it is allocated here and
        counted in the arena's stats)."""
        if pinned and self.host_arena is not None and numel > 0:
            t = self.host_arena.take(numel, dtype)
            if t is not None:
                return t
        return torch.empty(numel, dtype=dtype, device="cpu", pin_memory=pinned and self.is_cuda)

    def host_adopt(self, t: torch.Tensor, *, pinned: bool) -> torch.Tensor:
        """Host memory made outside this context (the node-shared segment of `node_shared.py`, page-locked by
        it on CUDA): returned as it is. A test double of the context records it as host memory."""
        return t

    def close_host_arena(self) -> None:
        """Unregister the host arena's page-locked memory (the runtime is being detached)."""
        if self.host_arena is not None:
            self.host_arena.close()

    # --------------------------------------------------------------------------------- stream order
    def compute_stream(self) -> torch.cuda.Stream | None:
        return torch.cuda.current_stream(self.device) if self.is_cuda else None

    def record(self, stream: torch.cuda.Stream | None = None, *, timing: bool = False) -> Event:
        """An event marking all work enqueued so far on `stream` (default: the current stream)."""
        if not self.is_cuda:
            return None
        event = torch.cuda.Event(enable_timing=timing)
        event.record(stream if stream is not None else torch.cuda.current_stream(self.device))
        return event

    def wait(self, event: Event, stream: torch.cuda.Stream | None = None) -> None:
        """Make `stream` (default: the current stream) wait for `event` without blocking the host."""
        if event is not None:
            (stream if stream is not None else torch.cuda.current_stream(self.device)).wait_event(event)

    @staticmethod
    def host_wait(event: Event) -> None:
        """Block the calling host thread until `event` has completed (used by the host worker only)."""
        if event is not None:
            event.synchronize()

    @contextlib.contextmanager
    def on(self, stream: torch.cuda.Stream | None) -> Iterator[None]:
        if stream is None:
            yield
        else:
            with torch.cuda.stream(stream):
                yield

    def synchronize(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize(self.device)


def element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
