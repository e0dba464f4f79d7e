"""Device clocks: how every probe times work, with wall clocks on CPU and CUDA events on CUDA.

On CPU an op has finished when the call returns, so `time.perf_counter` is exact: a mark is the wall time
and the seconds between two marks are their difference, at once.

On CUDA kernels and copies run asynchronously on streams; the host's wall clock between two calls times only
the launches. A mark there records one timing event (`torch.cuda.Event(enable_timing=True)`) on each stream the
measured work runs on (the compute stream, and the side streams of what is measured: the chunk runtime's
upload and offload streams, the swap store's copy-out and copy-in streams, a copy probe's H2D and D2H streams).
The events are read (`elapsed_time`) only after `synchronize()` at the end of the measured window (reading one
earlier is an error here, as `cudaErrorNotReady` would be on the device). The seconds between two marks run
from the latest start event (every stream has reached the start: what was queued before is done, so the
marked work can run) to the latest end event (all of it done). In the middle of a busy iteration this leaves
out the backlog a stream still had when the host marked the start (a copy stream's span alone would include
the wait for the compute stream to produce what it copies); at the start of a window that follows a
synchronisation every stream is idle and it is the window's whole time. `spans` gives each stream's own span
(the hardware probe times one copy direction per stream that way).

`now()` is the older synchronised wall clock (it synchronises the device, then reads the wall time), kept for
the hook marks of a profiled iteration, whose per-block sums are rescaled to an un-hooked iteration's wall time
afterwards (the calibration that removes hook overhead).

The CUDA path follows the PyTorch API; it runs on CPU under the stream-ordering checker's stand-in for
`torch.cuda` (tests/agent/runtime/cuda_semantics), which checks that every event is recorded on a stream the
work runs on and read only after a synchronisation. No GPU ran it.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class Mark:
    """A point in the measured work: the host's wall time, and on CUDA one timing event per clock stream."""

    host_s: float
    events: tuple[Any, ...] = ()  # torch.cuda.Event, one per stream of the clock (CUDA only)
    epoch: int = 0  # the clock's synchronisations before this mark


class DeviceClock:
    """Marks and the seconds between them on `device` (see the module docstring).

    `streams`: the streams the measured work runs on (CUDA); the current stream when None. `cuda`: whether
    to time with events (default: `device.type == "cuda"`; the probes pass the runtime's own answer, so a
    runtime that takes its CUDA code paths is timed with events).
    """

    def __init__(
        self,
        device: torch.device,
        streams: Sequence[Any | None] | None = None,
        *,
        cuda: bool | None = None,
    ) -> None:
        self.device = device
        self.cuda = device.type == "cuda" if cuda is None else cuda
        self.streams: list[Any] = []
        if self.cuda:
            chosen = [torch.cuda.current_stream(device)] if streams is None else list(streams)
            for s in chosen:  # each stream once, in order
                if s is not None and all(s != t for t in self.streams):
                    self.streams.append(s)
        self._syncs = 0

    @classmethod
    def with_side_streams(
        cls, device: torch.device, side: Iterable[Any | None], *, cuda: bool | None = None
    ) -> DeviceClock:
        """A clock on the current (compute) stream plus `side` streams (None entries are skipped)."""
        is_cuda = device.type == "cuda" if cuda is None else cuda
        compute = [torch.cuda.current_stream(device)] if is_cuda else []
        return cls(device, [*compute, *side], cuda=is_cuda)

    def mark(self) -> Mark:
        """Now: the wall time, and on CUDA an event recorded on each of the clock's streams."""
        if not self.cuda:
            return Mark(time.perf_counter(), (), self._syncs)
        events = []
        for s in self.streams:
            e = torch.cuda.Event(enable_timing=True)
            e.record(s)
            events.append(e)
        return Mark(time.perf_counter(), tuple(events), self._syncs)

    def synchronize(self) -> None:
        """End of a measured window: wait for the device (CUDA); marks taken before it can be read."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
        self._syncs += 1

    def seconds(self, start: Mark, end: Mark) -> float:
        """Seconds from `start` to `end`: wall time on CPU; on CUDA from the latest start event to the latest
        end event over the clock's streams (`min_j max_i elapsed(start_j, end_i)`: the latest start is the
        one whose distance to the latest end is the smallest), readable once the clock synchronised after
        `end` was marked."""
        if not self.cuda:
            return end.host_s - start.host_s
        self._check(start, end)
        return max(0.0, min(max(s.elapsed_time(e) for e in end.events) for s in start.events) / 1e3)

    def spans(self, start: Mark, end: Mark) -> tuple[float, ...]:
        """Seconds from `start` to `end` on each of the clock's streams (CUDA), or the wall time (CPU, one)."""
        if not self.cuda:
            return (end.host_s - start.host_s,)
        self._check(start, end)
        return tuple(s.elapsed_time(e) / 1e3 for s, e in zip(start.events, end.events, strict=True))

    def _check(self, start: Mark, end: Mark) -> None:
        if end.epoch >= self._syncs:
            raise RuntimeError(
                "DeviceClock.seconds: events read before the device was synchronised after the window's end "
                "mark (call synchronize() at the end of the measured window)"
            )
        if len(start.events) != len(end.events) or not start.events:
            raise ValueError("DeviceClock.seconds: marks of different clocks")

    def now(self) -> float:
        """Synchronised wall time: the moment all work queued so far has finished (hook marks)."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
        return time.perf_counter()


@dataclass
class SectionSpans:
    """Marks of the runtime's timing sections (`RuntimeTiming.add_marks`), summed after the window's end.

    Keeps the sections named in `names` (all when empty) that run at depth 0 (not inside another section) when
    `outermost`, else at any depth; `seconds(*names)` reads them after `clock.synchronize()`.
    """

    clock: DeviceClock
    names: frozenset[str] = frozenset()
    outermost: bool = True
    spans: list[tuple[str, Mark, Mark]] = field(default_factory=list)

    def __call__(self, name: str, start: Mark, end: Mark, depth: int) -> None:
        if (not self.names or name in self.names) and (depth == 0 or not self.outermost):
            self.spans.append((name, start, end))

    def seconds(self, *names: str) -> float:
        """The summed seconds of the kept sections called one of `names` (all kept sections when none)."""
        return sum(self.clock.seconds(s, e) for n, s, e in self.spans if not names or n in names)

    def count(self, name: str) -> int:
        return sum(1 for n, _, _ in self.spans if n == name)

    def clear(self, *names: str) -> None:
        self.spans = [x for x in self.spans if names and x[0] not in names]
