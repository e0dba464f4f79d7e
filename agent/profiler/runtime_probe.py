"""Runtime probe: what the agent runtime's own mechanisms cost, measured on one repeated block.

The cost model charges compute from the per-block times and copies by bytes over the measured bandwidth
curves. The runtime adds costs that neither captures, and that matter most where copies are serial with
compute (a CPU "device"): host buffers allocated and copied per saved storage, saved-tensor hooks,
checkpoint's recompute machinery, the chunk runtime's residency hooks, gradient gather and bind/release.
This probe measures them on one repeated block (forward + backward on its captured inputs), through the
same code the runtime uses:

- checkpoint: `torch.utils.checkpoint.checkpoint(..., use_reentrant=False, preserve_rng_state=True)`,
  exactly as `ActivationManager` applies it (the recompute runs inside backward), interleaved `rounds`
  times with the plain block: the difference of the fastest rounds (other work on a shared machine only
  adds time) is what checkpointing the block costs;
- swap: forward inside `SwapStore.swapping` (agent/runtime/swap.py), prefetch, backward, in the same rounds
  (the fastest round is one after the first, which made the host buffers the runtime keeps from one
  iteration to the next): the
  difference to the plain block (forward: swap-out; backward: swap-in), and never less than the time
  measured inside the store's pack hook, prefetch and unpack hook;
- offload: the block's parameters in one offloaded chunk of a `ModelStateManager` (one device buffer);
  the time spent in its entry points (module, saved-tensor, gradient and backward hooks: upload, binding,
  packing, gradient gather, gradient copy to the host, the chunk's host step with the user's optimizer
  class, release; `optimizer.step()` settling the speculative step; `zero_grad`) is timed directly, over
  `OFFLOAD_RUNS` runs after a warm-up run (the fastest), and within it each upload and release;
- the offloaded block's cost outside those entry points (`offload_outside_s`; wall clock only, i.e. a CPU
  "device"): its fastest forward + backward less the entry points' time within them, less the plain
  block's fastest forward + backward. Autograd calling the runtime's hooks is timed by no section, and the
  block's own kernels run slower after the chunk's copies and host step have been through the caches: on
  the development machine (AMD EPYC, 2 cores) a Llama block of 0.8 MB of parameters spent 4.4-5.6 ms in the
  entry points and another 2.4-4.0 ms outside them (`aten::mm` ~13% slower; MmBackward0's and
  AccumulateGrad's own time ~10x with the hooks), which no figure charged before (session 12). On CUDA the
  block runs are device time, where a kernel waiting on an upload's event would charge the copy a second
  time (the bandwidth model charges it), and the cost model reads the chunk costs on a CPU device only: not
  measured there (0.0).

The entry points are timed directly (rather than as a difference of two block runs), which keeps their
small figures out of the noise of the block's compute; the outside cost can only be a difference, taken
between the fastest runs.

Every figure comes from one `DeviceClock` (agent/profiler/device_clock.py): wall time on CPU; on CUDA timing
events recorded on the streams the work runs on (compute; the swap store's copy-out and copy-in streams for
the block runs and the store's sections; the chunk runtime's upload and offload streams for its sections),
read once the run's window is synchronised (at the end of each block run, after backward), so the
figures are the device's time, not the host's launches. `profile` turns them into per-block trace fields
(swap_out_s, swap_in_s, recompute_s, offload_overhead_s) for every block, scaled by each block's own
activation bytes, forward re-run time or parameter count (the repeated blocks are modules of one class:
the assumption the `max_blocks` extrapolation makes). Parameters, gradients and RNG state are restored.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from agent.profiler.block_chunks import fresh_optimizer
from agent.profiler.device_clock import DeviceClock, SectionSpans
from agent.profiler.tensors import iter_tensors
from agent.runtime.device import DeviceContext
from agent.runtime.layout import ChunkLayout, ChunkSpec, ParamEntry
from agent.runtime.manager import ModelStateManager
from agent.runtime.optimizer import ChunkedOptimizer, UnsupportedOptimizerError
from agent.runtime.options import RuntimeOptions
from agent.runtime.swap import SwapStore
from agent.runtime.timing import (
    ENTRY_POINTS,
    EVICT,
    FLUSH,
    STEP,
    SWAP_IN,
    SWAP_OUT,
    SWAP_PREFETCH,
    UPLOAD,
    ZERO_GRAD,
)
from client.contract import Placement

OFFLOAD_RUNS = 3  # timed runs of the offloaded block after its warm-up (the fastest is kept)


@dataclass(frozen=True)
class RuntimeProbe:
    """What the probed block costs in each mode (seconds; the fastest round where repeated)."""

    plain_s: float  # forward + backward of the plain block
    checkpoint_s: float  # forward + backward under checkpointing (its recompute runs inside backward)
    # swap: the larger of the time inside the swap store (pack hook in forward; prefetch and unpack hook in
    # backward) and the difference of the swapped block's forward (backward) to the plain block's
    swap_out_s: float
    swap_in_s: float
    offload_s: float  # time inside the chunk runtime's hooks over forward + backward (copies included)
    offload_params: int  # parameter tensors in the probed chunk
    offload_bytes: int  # their bytes (the copies the bandwidth model already charges)
    offload_stepped: bool = False  # offload_s includes the chunk's host optimizer step (run in its hook)
    upload_s: float = (
        0.0  # one upload and one release of the chunk (copy of its bytes included), within offload_s
    )
    offload_outside_s: float = 0.0  # the offloaded block's forward + backward beyond the plain block's,
    # outside the runtime's entry points (wall clock only; 0.0 on CUDA and where not measured)
    # the parts of the per-chunk cost (wall clock only; 0.0 on CUDA and where not measured): in forward, the
    # offloaded block's forward beyond the plain block's less its moves (the upload and release the cost model
    # charges per upload); in `optimizer.step()`, its settling of the chunk (its section)
    offload_forward_s: float = 0.0
    offload_step_s: float = 0.0

    @property
    def checkpoint_extra_s(self) -> float:
        """What checkpointing adds to the block's forward + backward (its recompute, machinery included)."""
        return max(0.0, self.checkpoint_s - self.plain_s)


class _OffloadRun(NamedTuple):
    """One timed run of the offloaded block (seconds)."""

    block_s: float  # its forward + backward
    forward_s: float  # of which its forward, less the moves (uploads, releases) inside it
    step_s: float  # in the settling `optimizer.step()` after it
    resident_s: float  # in the runtime's entry points (the settling step() and zero_grad included)
    resident_fb_s: float  # of those, inside the forward + backward
    move_s: float  # one upload and one release (`_OffloadedChunk.move_s`)


class _NotProbed(Exception):
    pass


def _outputs(value: Any) -> list[torch.Tensor]:
    return [t for t in iter_tensors(value) if t.requires_grad]


class _Block:
    """Runs the block on its captured inputs: forward, then backward from fixed output gradients."""

    def __init__(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.module = module
        self.kwargs = kwargs
        # the block's input needs a gradient in training (it comes from the block before)
        self.args = tuple(
            a.detach().requires_grad_(True) if isinstance(a, torch.Tensor) and a.is_floating_point() else a
            for a in args
        )
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.grads: list[torch.Tensor] | None = None  # output gradients, made at the first run

    def run(
        self,
        clock: DeviceClock,
        forward: Callable[[], Any],
        before_backward: Callable[[], object] | None = None,
    ) -> tuple[float, float]:
        """Forward and backward seconds on `clock`; the window ends synchronised (sections' marks readable)."""
        for p in self.params:
            p.grad = None
        for a in self.args:
            if isinstance(a, torch.Tensor):
                a.grad = None
        t0 = clock.mark()
        with torch.enable_grad():
            out = forward()
        t1 = clock.mark()
        if before_backward is not None:
            before_backward()
        outs = _outputs(out)
        if self.grads is None:
            self.grads = [torch.ones_like(t) for t in outs]
        if not outs:
            raise _NotProbed("the block's output needs no gradient")
        torch.autograd.backward(outs, self.grads)
        t2 = clock.mark()
        clock.synchronize()
        del out, outs
        return clock.seconds(t0, t1), clock.seconds(t1, t2)


def probe_block(
    module: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    device: torch.device,
    index: int,
    optimizer: torch.optim.Optimizer | None = None,
    rounds: int = 2,
) -> RuntimeProbe | None:
    """Run the block in every mode (see the module docstring); None when the block cannot be probed
    (no trainable parameters, mixed parameter dtypes, no differentiable output)."""

    params = [p for p in module.parameters() if p.requires_grad]
    if not params or len({p.dtype for p in params}) != 1 or any(p.device != device for p in params):
        return None
    block = _Block(module, args, kwargs)
    saved_grads = [p.grad for p in params]
    rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    state = {p.untyped_storage().data_ptr() for p in module.parameters()}
    state |= {b.untyped_storage().data_ptr() for b in module.buffers()}
    store = SwapStore(device, lambda t: t.untyped_storage().data_ptr() in state)
    # one clock for the plain, checkpointed and swapped runs: compute plus the store's copy streams (events on
    # CUDA when the store takes its CUDA paths)
    clock = DeviceClock.with_side_streams(device, (store.out_stream, store.in_stream), cuda=store.is_cuda)
    # the store's timing hook: copies out (pack), copies in (unpack, prefetch), outermost calls only
    swap_spans = SectionSpans(clock, frozenset({SWAP_OUT, SWAP_IN, SWAP_PREFETCH}))
    store.timing.add_marks(clock, swap_spans)

    def swapped() -> Any:
        with store.swapping(index):
            return module(*block.args, **block.kwargs)

    def checkpointed() -> Any:

        return checkpoint(module, *block.args, use_reentrant=False, preserve_rng_state=True, **block.kwargs)

    def plain() -> Any:
        return module(*block.args, **block.kwargs)

    plain_t: list[tuple[float, float]] = []
    ckpt_s: list[float] = []
    swap_t: list[tuple[float, float]] = []
    swap_direct: list[tuple[float, float]] = []
    offload: _OffloadedChunk | None = None
    try:
        # no separate warm-up: the first round's swap run makes the store's host buffers (as the runtime's first
        # iteration does) and the fastest round, a later one, has them (one block run less of profile time)
        for _ in range(rounds):  # interleaved: differences to the plain block are the modes' costs
            plain_t.append(block.run(clock, plain))
            ckpt_s.append(sum(block.run(clock, checkpointed)))
            swap_spans.clear()
            swap_t.append(block.run(clock, swapped, lambda: store.prefetch(index)))
            swap_direct.append((swap_spans.seconds(SWAP_OUT), swap_spans.seconds(SWAP_IN, SWAP_PREFETCH)))
        store.end_iteration()
        # the chunk runtime hooks the module while it is installed: its runs come after the others
        offload = _OffloadedChunk(module, params, device, optimizer)
        offload.run(block, plain)  # warm-up
        runs: list[_OffloadRun] = []
        for _ in range(OFFLOAD_RUNS):
            offload.reset()
            fwd_s, bwd_s = offload.run(block, plain)
            runs.append(
                _OffloadRun(
                    fwd_s + bwd_s,
                    fwd_s - offload.forward_moves_s,
                    offload.entries.seconds(STEP),
                    offload.resident_s(),
                    offload.resident_fb_s(),
                    offload.move_s(),
                )
            )
    except _NotProbed:
        return None
    finally:
        if offload is not None:
            offload.close()
        for p, g in zip(params, saved_grads, strict=True):
            p.grad = g
        torch.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state(cuda_rng, device)

    fastest = min(runs, key=lambda r: r.resident_s)
    plain_s = min(sum(t) for t in plain_t)
    outside = forward = step = 0.0
    if not clock.cuda:
        outside = max(0.0, min(r.block_s - r.resident_fb_s for r in runs) - plain_s)
        forward = max(0.0, min(r.forward_s for r in runs) - min(t[0] for t in plain_t))
        step = min(r.step_s for r in runs)

    # the fastest of the rounds: other work on the machine only ever adds time
    def best(xs: list[tuple[float, float]], i: int) -> float:
        return min(x[i] for x in xs)

    # swap: the difference to the plain block (it includes what happens outside the store's own code: the
    # hook calls from autograd, allocation effects), never less than the time measured inside the store
    swap_out = max(best(swap_direct, 0), best(swap_t, 0) - best(plain_t, 0))
    swap_in = max(best(swap_direct, 1), best(swap_t, 1) - best(plain_t, 1))
    return RuntimeProbe(
        plain_s=plain_s,
        checkpoint_s=min(ckpt_s),
        swap_out_s=swap_out,
        swap_in_s=swap_in,
        offload_s=fastest.resident_s,
        upload_s=fastest.move_s,
        offload_outside_s=outside,
        offload_forward_s=forward,
        offload_step_s=step,
        offload_params=len(params),
        offload_bytes=sum(p.numel() * p.element_size() for p in params),
        offload_stepped=offload.optimizer is not None,
    )


class _OffloadedChunk:
    """The block's parameters in one offloaded chunk of the chunk runtime (one device buffer)."""

    def __init__(
        self,
        module: nn.Module,
        params: list[nn.Parameter],
        device: torch.device,
        optimizer: torch.optim.Optimizer | None,
    ) -> None:

        names = {id(p): n for n, p in module.named_parameters()}
        spec = ChunkSpec(index=0, placement=Placement.offloaded)
        by_param: dict[int, ParamEntry] = {}
        offset = 0
        for p in params:
            e = ParamEntry(name=names[id(p)], param=p, chunk=0, offset=offset, numel=p.numel(), shape=p.shape)
            spec.entries.append(e)
            by_param[id(p)] = e
            offset += p.numel()
        layout = ChunkLayout(
            chunk_numel=offset, compute_dtype=params[0].dtype, chunks=[spec], n_buffers=1, by_param=by_param
        )
        self.params = params
        # the parameters' own storages: the runtime copies them into its chunk and never writes them, so
        # giving them back on close restores the values from before the probe (the probe's host steps
        # change the chunk's copy only)
        self.data = [p.data for p in params]
        context = DeviceContext(device)
        self.manager: Any = ModelStateManager(module, layout, context, RuntimeOptions(device=device))
        # the runtime's timing hook, on a clock over compute and the runtime's upload and offload streams:
        # entry points (hooks torch calls, `optimizer.step()`'s settling of the chunk's speculative step,
        # `zero_grad`) not inside another section make the runtime's time; uploads, releases and gradient
        # flushes, wherever they run, what moving costs
        self.clock = DeviceClock.with_side_streams(
            device, (context.upload_stream, context.offload_stream), cuda=context.is_cuda
        )
        self.entries = SectionSpans(self.clock, ENTRY_POINTS)
        self.moves = SectionSpans(self.clock, frozenset({UPLOAD, EVICT, FLUSH}), outermost=False)
        self.manager.timing.add_marks(self.clock, self.entries)
        self.manager.timing.add_marks(self.clock, self.moves)
        self._counts = (0, 0)
        self.forward_moves_s = 0.0  # the last run's moves inside its forward (`_forward_ended`)
        self.optimizer: ChunkedOptimizer | None = None
        if optimizer is not None and optimizer.param_groups:
            # the user's optimizer class and first group's hyper-parameters, over the probed parameters:
            # the chunk's host step runs inside the gradient hook that completes the chunk, as in training
            # (None: the optimizer class cannot be rebuilt from its defaults: probed without a step)
            inner = fresh_optimizer(optimizer, params)
            if inner is not None:
                try:
                    self.optimizer = ChunkedOptimizer(inner, layout, self.manager)
                    self.manager.attach_optimizer(self.optimizer)
                except UnsupportedOptimizerError:
                    self.optimizer = None

    def reset(self) -> None:
        self.entries.clear()
        self.moves.clear()
        c = self.manager.counters
        self._counts = (c.uploads, c.evictions)

    def resident_s(self) -> float:
        """Seconds in the runtime's entry points over the timed run (read after its window synchronised)."""
        return self.entries.seconds()

    def resident_fb_s(self) -> float:
        """Of `resident_s`, the entry points inside the block's forward and backward (not the settling
        `optimizer.step()` and `zero_grad` that follow them)."""
        return self.entries.seconds() - self.entries.seconds(STEP, ZERO_GRAD)

    def move_s(self) -> float:
        """One upload plus one release without gradients to copy (what a re-upload in backward costs), from
        the timed run's uploads and releases (a release's gradient copy is charged once per chunk)."""

        c = self.manager.counters
        n_up, n_ev = c.uploads - self._counts[0], c.evictions - self._counts[1]
        if not n_up or not n_ev:
            return 0.0
        upload, evict, flush = (self.moves.seconds(k) for k in (UPLOAD, EVICT, FLUSH))
        return upload / n_up + (evict - flush) / n_ev

    def _forward_ended(self) -> None:
        """At the block's forward's end (wall clock: its marks readable now): the moves inside the forward, the
        upload and any release, which the cost model charges per upload, not as the forward's part of the
        per-chunk cost."""
        self.forward_moves_s = self.moves.seconds(UPLOAD, EVICT) - self.moves.seconds(FLUSH)

    def run(self, block: _Block, forward: Callable[[], Any]) -> tuple[float, float]:
        """The block's forward and backward, then the settling step and `zero_grad` (all inside the window)."""
        self.forward_moves_s = 0.0
        t = block.run(self.clock, forward, None if self.clock.cuda else self._forward_ended)
        if self.optimizer is not None:
            # the chunk was stepped in backward: step() settles the iteration (validates the speculative step),
            # a per-chunk cost of every managed step (0.4-1.2 ms per iteration over 5-6 chunks on the CPU, not in
            # the prediction before). Its host work is waited for first, so on CUDA the timed section holds the
            # settling alone, not the worker's step (charged by throughput)
            self.manager.synchronize()
            self.optimizer.step()
        self.manager.zero_grad()
        self.clock.synchronize()  # zero_grad is an entry point of the timed run: its marks readable
        return t

    def close(self) -> None:
        manager, self.manager = self.manager, None
        if manager is None:
            return
        manager.detach()  # parameters are ordinary tensors again (holding the probe's stepped values)
        for p, d in zip(self.params, self.data, strict=True):
            p.data = d
