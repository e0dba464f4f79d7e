"""A stream-ordering checker: CUDA's stream semantics simulated on CPU, checking happens-before on every access.

TEST DOUBLE. This stands in for the parts of `torch.cuda` the chunk runtime uses (Stream, Event,
current_stream, stream contexts, wait_stream / wait_event, record_stream, synchronize, non_blocking
copies, pinned memory). It exists only because no GPU runs where memplan's tests do; nothing in
`agent/` imports it. It lives under tests/ for that reason: it is a test tool, never shipped.

How it works. `simulated_cuda()` is a context manager that, for its duration,
* replaces `torch.cuda.Stream`, `Event`, `current_stream`, `default_stream`, `stream`, `synchronize`
  and `torch.Tensor.record_stream` with simulated ones (every computation still runs on the CPU,
  immediately; only the *ordering* CUDA would give is modelled);
* makes the runtime believe it runs on CUDA without editing it: `agent.runtime.device.DeviceContext`
  (and `agent.runtime.arena.runtime_arena_context`), which `agent.wrap` imports when it builds the
  manager, give a `SimulatedCudaContext` (a `DeviceContext` with `is_cuda=True`, side streams, host buffers marked
  pinned), the activation swap store gets its two CUDA streams, its pinned host buffers are marked,
  and the host worker runs inline (one thread, so the dispatch mode below sees its work);
* records every read and write of every tensor storage through a `TorchDispatchMode` (the operator
  schema says which arguments an op writes), with the stream it was issued on: an op inside a
  host-worker job (unless it touches device memory: then it is issued on the current stream), or touching only
  host storages (`host_empty`, swap buffers, what host ops made), runs on the host;
  any other op is a kernel on the current stream. A storage not seen before (a tensor made before the
  simulation, or by `torch.empty`) is device memory, unless a host-worker job touches it first.

Happens-before is tracked with vector clocks: one clock per stream plus one for the host. A kernel
ticks its stream's clock; `Event.record` copies the stream's vector; `wait_event` / `wait_stream`
merge it into the waiting stream; `Event.synchronize`, `Stream.synchronize`, `torch.cuda.synchronize`,
a blocking device/host copy, a non_blocking copy from pageable host memory and `.item()` merge into
the host's vector, which every later submission inherits (program order). An access conflicts with
an earlier access to overlapping bytes from another stream or the host (write/any or any/write) unless
the earlier one happens-before it; each conflict is a `Violation` with both stack traces.

Freed device memory: when a device storage dies (a finalizer on its storage), every access to it
from a stream other than the one it was allocated on must already be ordered before that stream's
current point, because the allocator may hand the bytes out again at once. Under
`allocator="caching"` (PyTorch's caching allocator) `record_stream(s)` exempts stream `s`; under
`allocator="planned"` (the planned allocator, a `CUDAPluggableAllocator`) `record_stream` does
nothing, as in PyTorch.

Timing events: an `Event(enable_timing=True)` notes the stream it was recorded on and the wall time of the
record (the simulated work runs at once on the CPU, so that is when the stream reaches the event);
`elapsed_time` is the difference, and reading it before the host has waited for both events (an event or
stream synchronise, `torch.cuda.synchronize`) raises and is a `Violation`, as CUDA answers
`cudaErrorNotReady`; so is reading an event made without `enable_timing`. `SimulatedCuda.timing_events` lists
every timing event recorded, for tests that check which streams a clock marks.

Limits (say so when reading a clean result): host threads are one agent (the host worker is made
inline), so races between host threads are not checked; storages are tracked by address ranges of
the CPU tensors that stand in for device memory; the caching host allocator's own event tracking of
pinned blocks is assumed correct (frees of host memory are not checked). The runtime's host arena
(`agent/runtime/host_arena.py`) is known to the checker: chunk buffers are its views (marked pinned
host memory), and its swap region is one host storage whose ranges the swap store hands out again, so a
copy into a reused range that is not ordered after the copies that used it before is a violation.
Ops a host-worker job issues on device memory (the sharded chunks' collectives and copies, issued inside
`torch.cuda.stream(...)`) are kernels on the current stream, which inline is the training thread's: the
runtime's worker functions enter their stream explicitly, as on a GPU they must; a tensor a host-worker
job allocates is host or device memory by the first op on it (with device memory: a device temporary).
A device copy `.to(device)` of a host tensor is the tensor itself here (both are CPU tensors). torch's
`clip_grad_norm_` over offloaded parameters' host `.grad` was seen reported as a compute-stream write of host
memory (not investigated: its scalar temporaries may count as device memory); the scenarios do not clip.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

Allocator = Literal["caching", "planned"]
HOST = 0  # agent index of the host; streams are 1, 2, ...
_ALLOC_OPS = {
    torch.ops.aten.empty.memory_format,
    torch.ops.aten.empty_strided.default,
    torch.ops.aten.empty_like.default,
}
_NO_DATA_OPS = {
    torch.ops.aten.detach.default,
    torch.ops.aten.alias.default,
    torch.ops.aten.view.default,
    torch.ops.aten._unsafe_view.default,
    torch.ops.aten.set_.source_Storage_storage_offset,
    torch.ops.aten.set_.source_Storage,
    torch.ops.aten.resize_.default,
}


class StreamOrderError(AssertionError):
    """The simulated run accessed memory without the stream ordering CUDA would need."""


def _stack(skip: int = 2, limit: int = 30) -> tuple[tuple[str, int, str], ...]:
    """The caller's stack without PyTorch's and the checker's own frames, innermost `limit` frames."""
    frames = []
    f = sys._getframe(skip)
    while f is not None and len(frames) < limit:
        code = f.f_code
        if "/torch/" not in code.co_filename and code.co_filename not in (__file__, weakref.__file__):
            frames.append((code.co_filename, f.f_lineno, code.co_name))
        f = f.f_back
    return tuple(frames)


def _format(stack: tuple[tuple[str, int, str], ...]) -> str:
    return "\n".join(f'    File "{fn}", line {ln}, in {name}' for fn, ln, name in reversed(stack))


@dataclass
class Access:
    start: int
    end: int
    agent: int
    clock: int
    write: bool
    what: str
    stack: tuple[tuple[str, int, str], ...]


@dataclass
class Violation:
    message: str
    this_stack: str
    other_stack: str

    def __str__(self) -> str:
        return f"{self.message}\n  this access:\n{self.this_stack}\n  the earlier, unordered access:\n{self.other_stack}"


@dataclass
class _Storage:
    """What the checker knows of one storage (by its address)."""

    nbytes: int
    host: bool
    pinned: bool
    alloc_agent: int
    recorded: set[int] = field(default_factory=set)
    accesses: list[Access] = field(default_factory=list)
    # the storage object seen at this address (torch keeps one Python object per live storage); a storage resized
    # in place (`untyped_storage().resize_`, the device-sharded chunks' gather and release) moves to new bytes
    # without dying, so its finalizer never frees the old address: `Clocks._entry` notices the mismatch
    owner: Any = None


class Clocks:
    """Vector clocks of the host and every stream, and the record of accesses."""

    def __init__(self, allocator: Allocator) -> None:
        self.allocator = allocator
        self.vc: list[list[int]] = [[0, 0], [0, 0]]  # host, default (compute) stream
        self.names = ["host", "compute (default stream)"]
        self.storages: dict[int, _Storage] = {}
        self.violations: list[Violation] = []
        self.in_host_job = False  # the (inline) host worker is running a job: every op is host work
        self.timing_events: list[SimEvent] = []  # every Event(enable_timing=True) recorded, in order
        self._current = threading.local()

    # ------------------------------------------------------------------ agents
    def new_agent(self, name: str) -> int:
        self.names.append(name)
        for v in self.vc:
            v.append(0)
        self.vc.append([0] * len(self.names))
        return len(self.names) - 1

    def current(self) -> int:
        return getattr(self._current, "agent", 1)

    def set_current(self, agent: int) -> None:
        self._current.agent = agent

    @staticmethod
    def merge(into: list[int], other: list[int]) -> None:
        for i, x in enumerate(other):
            if x > into[i]:
                into[i] = x

    def submit(self, agent: int) -> list[int]:
        """Work the host enqueues on `agent` now comes after everything the host has waited for."""
        if agent != HOST:
            self.merge(self.vc[agent], self.vc[HOST])
        return self.vc[agent]

    def host_waits_for(self, vc: list[int]) -> None:
        self.merge(self.vc[HOST], vc)

    # ------------------------------------------------------------------ storages
    def _entry(self, st: torch.UntypedStorage) -> _Storage | None:
        """The entry of the storage `st` is now, by its address; an entry left there by another storage object
        (one that was resized in place and moved, or died unseen) is that storage's bytes freed: checked as a
        free, then forgotten."""
        key = st.data_ptr()
        info = self.storages.get(key)
        if info is not None and info.owner is not None and info.owner() is not st:
            self._freed(key, info)
            return None
        return info

    def storage(self, t: torch.Tensor, *, host_op: bool, created: bool) -> tuple[int, _Storage]:
        st = t.untyped_storage()
        key = st.data_ptr()
        info = self._entry(st)
        if info is None:
            host = host_op
            info = _Storage(
                st.nbytes(), host=host, pinned=False, alloc_agent=HOST if host else self.current()
            )
            info.owner = weakref.ref(st)
            self.storages[key] = info
            weakref.finalize(st, self._freed, key, info)
        return key, info

    def mark_host(self, t: torch.Tensor, *, pinned: bool) -> None:
        st = t.untyped_storage()
        info = self._entry(st)
        if info is None:
            info = self.storages[st.data_ptr()] = _Storage(
                st.nbytes(), host=True, pinned=pinned, alloc_agent=HOST, owner=weakref.ref(st)
            )
            weakref.finalize(st, self._freed, st.data_ptr(), info)
        info.host, info.pinned, info.alloc_agent = True, pinned, HOST

    def kind(self, t: torch.Tensor) -> str:
        """ "host", "device", or "unknown" (not seen yet: a factory op's result, or made before the simulation)."""
        info = self._entry(t.untyped_storage())
        return "unknown" if info is None else "host" if info.host else "device"

    def is_host(self, t: torch.Tensor) -> bool:
        info = self._entry(t.untyped_storage())
        return info is not None and info.host

    def record_stream(self, t: torch.Tensor, agent: int) -> None:
        _, info = self.storage(t, host_op=False, created=False)
        if self.allocator == "caching":
            info.recorded.add(agent)

    # ------------------------------------------------------------------ accesses
    def access(
        self, t: torch.Tensor, agent: int, *, write: bool, what: str, host_op: bool, created: bool
    ) -> None:
        if t.numel() == 0 or t.device.type != "cpu" or t.layout != torch.strided:
            return
        key, info = self.storage(t, host_op=host_op, created=created)
        size = t.element_size()
        span = sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride(), strict=True)) + 1
        start = t.storage_offset() * size
        end = start + span * size
        mine = self.vc[agent]
        stack = _stack(3)
        keep: list[Access] = []
        for a in info.accesses:
            overlaps = a.start < end and start < a.end
            if overlaps and a.agent != agent and (write or a.write) and mine[a.agent] < a.clock:
                self.violations.append(
                    Violation(
                        f"{self.names[agent]} {'writes' if write else 'reads'} bytes [{start}, {end}) of a "
                        f"{'host' if info.host else 'device'} buffer of {info.nbytes} bytes ({what}) while "
                        f"{self.names[a.agent]}'s {'write' if a.write else 'read'} of [{a.start}, {a.end}) "
                        f"({a.what}) is not ordered before it (no event wait or synchronisation in between)",
                        _format(stack),
                        _format(a.stack),
                    )
                )
            superseded = overlaps and write and start <= a.start and a.end <= end and mine[a.agent] >= a.clock
            same_read = a.agent == agent and not a.write and not write and start <= a.start and a.end <= end
            if not (superseded or same_read):
                keep.append(a)
        keep.append(Access(start, end, agent, mine[agent], write, what, stack))
        info.accesses = keep

    def _freed(self, key: int, info: _Storage) -> None:
        if self.storages.get(key) is not info:
            return
        del self.storages[key]
        if info.host:
            return  # PyTorch's caching host allocator tracks the streams that used a pinned block itself
        owner = self.vc[info.alloc_agent]
        for a in info.accesses:
            if a.agent in (info.alloc_agent, HOST) or a.agent in info.recorded or owner[a.agent] >= a.clock:
                continue
            hint = (
                " (record_stream does nothing under the planned allocator)"
                if self.allocator == "planned"
                else " (no record_stream for that stream)"
            )
            self.violations.append(
                Violation(
                    f"a device buffer of {info.nbytes} bytes allocated on {self.names[info.alloc_agent]} is freed "
                    f"while {self.names[a.agent]}'s {'write' if a.write else 'read'} of it ({a.what}) is not "
                    f"ordered before {self.names[info.alloc_agent]}: the allocator may hand the bytes out again "
                    f"at once{hint}",
                    _format(_stack(2)),
                    _format(a.stack),
                )
            )


class SimStream:
    """Stand-in for torch.cuda.Stream."""

    def __init__(self, clocks: Clocks, name: str | None = None, agent: int | None = None) -> None:
        self._clocks = clocks
        self.agent = (
            agent if agent is not None else clocks.new_agent(name or f"side stream {len(clocks.names) - 1}")
        )

    def wait_event(self, event: SimEvent) -> None:
        self._clocks.merge(self._clocks.submit(self.agent), event.vc)

    def wait_stream(self, stream: SimStream) -> None:
        self.wait_event(stream.record_event())

    def record_event(self, event: SimEvent | None = None) -> SimEvent:
        event = event if event is not None else SimEvent(self._clocks)
        event.record(self)
        return event

    def synchronize(self) -> None:
        self._clocks.host_waits_for(self._clocks.vc[self.agent])

    def query(self) -> bool:
        return False  # never assume completion without a synchronisation

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SimStream) and other.agent == self.agent

    def __hash__(self) -> int:
        return hash(self.agent)

    def __repr__(self) -> str:
        return f"<SimStream {self._clocks.names[self.agent]}>"


class SimEvent:
    """Stand-in for torch.cuda.Event."""

    def __init__(self, clocks: Clocks, enable_timing: bool = False, **_: Any) -> None:
        self._clocks = clocks
        self.vc = [0] * len(clocks.names)
        self.enable_timing = enable_timing
        self.agent: int | None = None  # the stream it was last recorded on
        self.kernels = 0  # kernels that stream had run when the event was recorded
        self.at = 0.0  # wall time of the record (the simulated stream reaches it at once)

    def record(self, stream: SimStream | None = None) -> None:
        agent = stream.agent if stream is not None else self._clocks.current()
        self.vc = list(self._clocks.submit(agent))
        self.agent, self.kernels, self.at = agent, self.vc[agent], time.perf_counter()
        if self.enable_timing:
            self._clocks.timing_events.append(self)

    def wait(self, stream: SimStream | None = None) -> None:
        agent = stream.agent if stream is not None else self._clocks.current()
        self._clocks.merge(self._clocks.submit(agent), self.vc)

    def synchronize(self) -> None:
        self._clocks.host_waits_for(self.vc)

    def query(self) -> bool:
        return False

    def elapsed_time(self, end: SimEvent) -> float:
        """Milliseconds from this event to `end`; both must be recorded with timing and waited for by the host."""
        c = self._clocks
        host = c.vc[HOST]
        for e in (self, end):
            problem = (
                "was made without enable_timing=True"
                if not e.enable_timing
                else "was never recorded"
                if e.agent is None
                else None
                if all(host[i] >= x for i, x in enumerate(e.vc))
                else "is read before the host waited for it (cudaErrorNotReady: synchronise first)"
            )
            if problem is not None:
                where = c.names[e.agent] if e.agent is not None else "no stream"
                v = Violation(f"elapsed_time: an event on {where} {problem}", _format(_stack(2)), "")
                c.violations.append(v)
                raise StreamOrderError(str(v))
        return (end.at - self.at) * 1e3


class _Recorder(TorchDispatchMode):
    def __init__(self, clocks: Clocks) -> None:
        super().__init__()
        self.clocks = clocks

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        c = self.clocks
        if func in _ALLOC_OPS:  # no data access, but the new storage belongs to the current stream (or host)
            if c.in_host_job:
                return out  # host or device: the first op on it says (with device memory: a device temporary)
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                    c.storage(t, host_op=c.in_host_job, created=True)
            return out
        if func in _NO_DATA_OPS:
            return out
        schema = func._schema
        writes_any = any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)
        if not writes_any and schema.returns and all(r.alias_info is not None for r in schema.returns):
            return out  # a view (slice, transpose, as_strided, ...): metadata only, no memory access
        inputs: list[tuple[torch.Tensor, bool, str]] = []
        for i, arg in enumerate(schema.arguments):
            value = (
                kwargs.get(arg.name)
                if arg.kwarg_only or arg.name in kwargs
                else (args[i] if i < len(args) else None)
            )
            write = arg.alias_info is not None and arg.alias_info.is_write
            for t in tree_flatten(value)[0]:
                if isinstance(t, torch.Tensor):
                    inputs.append((t, write, f"{func} argument {arg.name!r}"))
        known = [c.kind(t) for t, _, _ in inputs]
        # the host worker's jobs are host work, but for an op on device memory they issue (a kernel or copy on
        # the current stream: the sharded chunks' reduce-scatters and copies, issued by the worker inside
        # `torch.cuda.stream(...)`); elsewhere an op on host buffers only; anything else is a kernel (a storage
        # not seen before counts as device memory, what torch.empty on CUDA would give)
        if c.in_host_job:
            host_op = "device" not in known
        else:
            host_op = bool(known) and all(k == "host" for k in known)
        agent = HOST if host_op else c.current()
        c.submit(agent)
        c.vc[agent][agent] += 1
        written = {id(t) for t, w, _ in inputs if w}
        for t, write, what in inputs:
            c.access(t, agent, write=write, what=what, host_op=host_op, created=False)
        outs = out if isinstance(out, (tuple, list)) else (out,)
        for ret, value in zip(schema.returns, outs, strict=False):
            if ret.alias_info is not None:
                continue  # a view of an input (or the in-place result, recorded above)
            for t in tree_flatten(value)[0]:
                if isinstance(t, torch.Tensor) and id(t) not in written:
                    c.access(t, agent, write=True, what=f"{func} result", host_op=host_op, created=True)
        if not host_op:
            blocking_copy = func is torch.ops.aten.copy_.default and (
                not kwargs.get("non_blocking", args[2] if len(args) > 2 else False)
                or any(
                    c.is_host(t) and not c.storages[t.untyped_storage().data_ptr()].pinned
                    for t, _, _ in inputs
                )
            )
            if blocking_copy and any(c.is_host(t) for t, _, _ in inputs):
                c.host_waits_for(c.vc[agent])  # a synchronous host<->device copy returns when it is done
            if func is torch.ops.aten._local_scalar_dense.default:
                c.host_waits_for(c.vc[agent])  # .item() waits for the value
        return out


class SimulatedCuda:
    """The simulated torch.cuda surface bound to one `Clocks`."""

    def __init__(self, allocator: Allocator) -> None:
        self.clocks = Clocks(allocator)
        self.default = SimStream(self.clocks, agent=1)
        self._streams: dict[int, SimStream] = {1: self.default}
        self._make_classes()

    @property
    def violations(self) -> list[Violation]:
        return self.clocks.violations

    def _make_classes(self) -> None:
        """torch.cuda.Stream / Event stand-ins: real classes (annotations like `torch.cuda.Stream | None`
        are evaluated by libraries imported during the simulation), bound to this simulation's clocks."""
        clocks = self.clocks

        class Stream(SimStream):
            def __init__(self, device: Any = None, priority: int = 0, **_: Any) -> None:
                super().__init__(clocks)

        class Event(SimEvent):
            def __init__(self, enable_timing: bool = False, **kw: Any) -> None:
                super().__init__(clocks, enable_timing, **kw)

        self.Stream = Stream  # noqa: N815 (torch's names)
        self.Event = Event  # noqa: N815

    def current_stream(self, device: Any = None) -> SimStream:
        agent = self.clocks.current()
        return self.default if agent == 1 else self._streams[agent]

    def default_stream(self, device: Any = None) -> SimStream:
        return self.default

    @contextlib.contextmanager
    def stream(self, stream: SimStream | None) -> Iterator[None]:
        if stream is None:
            yield
            return
        self._streams[stream.agent] = stream
        prev = self.clocks.current()
        self.clocks.set_current(stream.agent)
        try:
            yield
        finally:
            self.clocks.set_current(prev)

    def synchronize(self, device: Any = None) -> None:
        for v in self.clocks.vc[1:]:
            self.clocks.host_waits_for(v)

    @property
    def timing_events(self) -> list[SimEvent]:
        return self.clocks.timing_events

    def stream_name(self, event: SimEvent) -> str:
        return "unrecorded" if event.agent is None else self.clocks.names[event.agent]

    def kernels_on(self, name: str) -> int:
        """How many kernels ran on the stream called `name` (e.g. "upload stream"); 0 if it does not exist."""
        c = self.clocks
        return sum(c.vc[i][i] for i, n in enumerate(c.names) if n == name)

    def mark_host(self, t: torch.Tensor, *, pinned: bool) -> torch.Tensor:
        self.clocks.mark_host(t, pinned=pinned)
        return t

    def check(self) -> None:
        """Raise StreamOrderError listing every violation found so far."""
        if self.violations:
            shown = "\n\n".join(str(v) for v in self.violations[:3])
            raise StreamOrderError(
                f"{len(self.violations)} stream-order violation(s); the first ones:\n\n{shown}"
            )


def _patch(stack: contextlib.ExitStack, obj: Any, name: str, value: Any) -> None:
    old = getattr(obj, name)
    setattr(obj, name, value)
    stack.callback(setattr, obj, name, old)


def _patch_everywhere(stack: contextlib.ExitStack, home: Any, name: str, value: Any) -> None:
    """`home.name` and every loaded `agent` module's binding of the same object (a `from home import name`
    at a module's top binds it there), replaced by `value` for the stack's lifetime."""
    original = getattr(home, name)
    for mod_name, mod in list(sys.modules.items()):
        if mod is not None and (mod_name == "agent" or mod_name.startswith("agent.")):
            if getattr(mod, name, None) is original:
                _patch(stack, mod, name, value)


@contextlib.contextmanager
def simulated_cuda(allocator: Allocator = "caching", *, runtime: bool = True) -> Iterator[SimulatedCuda]:
    """Simulate CUDA stream semantics on CPU for the duration; yields the simulation (`.violations`, `.check()`).

    `runtime=True` also plugs the chunk runtime in (wrap's DeviceContext, the swap store's streams and
    pinned buffers, an inline host worker), so `agent.wrap(...)` called inside runs its CUDA code paths.
    """
    sim = SimulatedCuda(allocator)
    with contextlib.ExitStack() as stack:
        cuda = torch.cuda
        _patch(stack, cuda, "Stream", sim.Stream)
        _patch(stack, cuda, "Event", sim.Event)
        _patch(stack, cuda, "current_stream", sim.current_stream)
        _patch(stack, cuda, "default_stream", sim.default_stream)
        _patch(stack, cuda, "stream", sim.stream)
        _patch(stack, cuda, "synchronize", sim.synchronize)

        def record_stream(t: torch.Tensor, stream: SimStream) -> None:
            sim.clocks.record_stream(t, stream.agent)

        _patch(stack, torch.Tensor, "record_stream", record_stream)
        if runtime:
            _plug_runtime(stack, sim)
        stack.enter_context(_Recorder(sim.clocks))
        yield sim


def _plug_runtime(stack: contextlib.ExitStack, sim: SimulatedCuda) -> None:
    import agent.runtime.arena as arena_mod
    import agent.runtime.device as device_mod
    import agent.runtime.manager as manager_mod
    import agent.runtime.swap as swap_mod
    from agent.runtime.device import DeviceContext
    from agent.runtime.host_worker import HostWorker

    class SimulatedCudaContext(DeviceContext):
        """A DeviceContext that takes the CUDA code paths (side streams, events, pinned host buffers) on CPU."""

        def __init__(self, device: torch.device) -> None:
            super().__init__(device)
            self.is_cuda = True
            self.upload_stream = sim.Stream(device)  # type: ignore[assignment]
            self.offload_stream = sim.Stream(device)  # type: ignore[assignment]
            sim.clocks.names[self.upload_stream.agent] = "upload stream"  # type: ignore[union-attr]
            sim.clocks.names[self.offload_stream.agent] = "offload stream"  # type: ignore[union-attr]

        def host_empty(self, numel: int, dtype: torch.dtype, *, pinned: bool) -> torch.Tensor:
            # pinned buffers are the host arena's views when wrap gave one (as on CUDA), else buffers of their own
            t = (
                self.host_arena.take(numel, dtype)
                if pinned and self.host_arena is not None and numel
                else None
            )
            if t is None:
                t = torch.empty(numel, dtype=dtype, device="cpu")
            return sim.mark_host(t, pinned=pinned)

        def host_adopt(self, t: torch.Tensor, *, pinned: bool) -> torch.Tensor:
            return sim.mark_host(
                t, pinned=pinned
            )  # the node-shared segment: host memory, page-locked on CUDA

    def runtime_arena_context(device: torch.device, layout: Any) -> DeviceContext:
        return SimulatedCudaContext(device)

    # every module that builds a context (agent.applied's apply_plan, the profiler's probes) imports these
    # names at its top: each module's own binding is replaced, not only the defining module's
    _patch_everywhere(stack, device_mod, "DeviceContext", SimulatedCudaContext)
    _patch_everywhere(stack, arena_mod, "runtime_arena_context", runtime_arena_context)

    class InlineHostWorker(HostWorker):
        """The host worker, inline (one thread for the dispatch mode to see), its jobs marked as host work."""

        def __init__(self, *, inline: bool = False) -> None:
            super().__init__(inline=True, modes_see_inline_work=True)

        def submit(self, fn: Callable[..., None], *args: Any) -> Any:
            def as_host_job(*a: Any) -> None:
                sim.clocks.in_host_job = True
                try:
                    fn(*a)
                finally:
                    sim.clocks.in_host_job = False

            return super().submit(as_host_job, *args)

    _patch(stack, manager_mod, "HostWorker", InlineHostWorker)

    original_init: Callable[..., None] = swap_mod.SwapStore.__init__

    def swap_init(self: Any, device: torch.device, is_model_state: Any, host_arena: Any = None) -> None:
        original_init(self, device, is_model_state, host_arena)
        if host_arena is not None and host_arena.swap_region.numel():
            # the swap region is one storage: reuse of its ranges is checked like any other access
            sim.mark_host(host_arena.swap_region, pinned=True)
        self.is_cuda = True
        self.out_stream = sim.Stream(device)
        self.in_stream = sim.Stream(device)
        sim.clocks.names[self.out_stream.agent] = "swap-out stream"
        sim.clocks.names[self.in_stream.agent] = "swap-in stream"

    _patch(stack, swap_mod.SwapStore, "__init__", swap_init)
    original_host_bytes = swap_mod._host_bytes

    def host_bytes(nbytes: int, *, pinned: bool) -> torch.Tensor:
        return sim.mark_host(original_host_bytes(nbytes, pinned=False), pinned=pinned)

    _patch(stack, swap_mod, "_host_bytes", host_bytes)
