"""Timing hook of the runtime: named sections that torch's profiler sees and listeners can time.

Each entry point torch calls (module hooks, saved-tensor hooks, gradient hooks, the end-of-backward
callback, `zero_grad`, `step`) and each move of a chunk (upload, evict, gradient flush) runs as a section
`memplan::<name>`: under `torch.profiler` it is a `record_function` range (as FSDP2 labels its
`FSDP::pre_forward`, `FSDP::all_gather`, ...), and every registered `TimingListener` receives its wall time
and nesting depth. The profiler's probes time the runtime through this, not by subclassing it. With no
listener and no active profiler a section costs about half a microsecond (one wrapper call and
one check), on the hooks torch calls per module, saved tensor and gradient.

A wall time is what the host spent in a section; on CUDA the section's copies and kernels run later, on the
runtime's streams. A probe that needs the device's time registers a `SectionClock` with `add_marks`: the
section takes the clock's mark at its start and at its end (the profiler's `DeviceClock` records CUDA
events on the streams the runtime uses) and hands both marks to the listener, which reads the time between
them after the measured window is synchronised.
"""

from __future__ import annotations

import functools
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Protocol, TypeVar, cast

import torch
from torch.utils.hooks import RemovableHandle

# entry points (called by torch or the user) and moves (inside them)
ROOT_FORWARD = "root_forward"
AFTER_ROOT_FORWARD = "after_root_forward"
OUTPUT_GRAD = "output_grad"
END_BACKWARD = "end_backward"
MODULE_FORWARD = "module_forward"
AFTER_MODULE_FORWARD = "after_module_forward"
PACK = "pack_saved"
UNPACK = "unpack_saved"
GRAD_HOOK = "grad_hook"
ZERO_GRAD = "zero_grad"
STEP = "step"
UPLOAD = "upload"
EVICT = "evict"
FLUSH = "flush"
# the activation swap store (`swap.SwapStore`, a timing of its own)
SWAP_OUT = "swap_out"  # pack hook: a saved tensor copied to the host
SWAP_IN = "swap_in"  # unpack hook: a swapped tensor back on the device
SWAP_PREFETCH = "swap_prefetch"  # a block's swapped tensors copied back ahead of use
ENTRY_POINTS = frozenset(
    {
        ROOT_FORWARD,
        AFTER_ROOT_FORWARD,
        OUTPUT_GRAD,
        END_BACKWARD,
        MODULE_FORWARD,
        AFTER_MODULE_FORWARD,
        PACK,
        UNPACK,
        GRAD_HOOK,
        ZERO_GRAD,
        STEP,
    }
)


_profiler_enabled = torch.autograd._profiler_enabled


class TimingListener(Protocol):
    """Receives each finished section: its name, wall seconds, and depth (0: not inside another section)."""

    def __call__(self, name: str, seconds: float, depth: int) -> None: ...


class SectionClock(Protocol):
    """Marks points of a section's work (`agent.profiler.device_clock.DeviceClock`)."""

    def mark(self) -> Any: ...


class MarkListener(Protocol):
    """Receives each finished section: its name, the clock's marks at its start and end, and its depth."""

    def __call__(self, name: str, start: Any, end: Any, depth: int) -> None: ...


class RuntimeTiming:
    """The listeners of one runtime and the depth of the sections running now (one training thread)."""

    def __init__(self) -> None:
        self._listeners: OrderedDict[int, TimingListener] = OrderedDict()  # weak-referenced by handles
        self._marked: OrderedDict[int, tuple[SectionClock, MarkListener]] = OrderedDict()
        self.depth = 0

    @property
    def active(self) -> bool:
        return bool(self._listeners) or bool(self._marked) or torch.autograd._profiler_enabled()

    @property
    def listening(self) -> bool:
        """Some listener wants the sections (the decorator's fast path skips all this when none does)."""
        return bool(self._listeners) or bool(self._marked)

    def add_marks(self, clock: SectionClock, listener: MarkListener) -> RemovableHandle:
        """Call `listener` with `clock`'s marks at the start and end of every section from now on."""
        handle = RemovableHandle(self._marked)
        self._marked[handle.id] = (clock, listener)
        return handle

    def add_listener(self, listener: TimingListener) -> RemovableHandle:
        """Call `listener` after every section from now on; `.remove()` on the handle stops it."""
        handle = RemovableHandle(self._listeners)
        self._listeners[handle.id] = listener
        return handle

    def run(self, name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run `fn` as section `name`."""
        depth = self.depth
        self.depth = depth + 1
        marked = [(clock.mark(), clock, listen) for clock, listen in list(self._marked.values())]
        t0 = time.perf_counter()
        try:
            if not _profiler_enabled():  # a listener only: no profiler range (it would cost a few us a call)
                return fn(*args, **kwargs)
            with torch.profiler.record_function(f"memplan::{name}"):
                return fn(*args, **kwargs)
        finally:
            seconds = time.perf_counter() - t0
            ends = [(start, clock.mark(), listen) for start, clock, listen in marked]
            self.depth = depth
            for listener in list(self._listeners.values()):
                listener(name, seconds, depth)
            for start, end, listen in ends:
                listen(name, start, end, depth)


F = TypeVar("F", bound=Callable[..., Any])


def section(name: str) -> Callable[[F], F]:
    """Decorate a method of an object with a `timing: RuntimeTiming` attribute: the method runs as a section."""

    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            timing: RuntimeTiming = self.timing
            if not timing.listening and not _profiler_enabled():  # the common case: ~0.5 us a call
                return fn(self, *args, **kwargs)
            return timing.run(name, fn, self, *args, **kwargs)

        return cast(F, wrapper)

    return decorate
