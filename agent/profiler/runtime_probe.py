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
  class, release) is timed directly, after a warm-up run, and within it each upload and release.

Timing the chunk runtime's own code directly (rather than as a difference of two block runs) keeps its
small figures out of the noise of the block's compute. `profile` turns them into per-block trace fields
(swap_out_s, swap_in_s, recompute_s, offload_overhead_s) for every block, scaled by each block's own
activation bytes, forward re-run time or parameter count (the repeated blocks are modules of one class:
the assumption the `max_blocks` extrapolation makes). Parameters, gradients and RNG state are restored.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from agent.profiler.device_clock import DeviceClock
from agent.profiler.tensors import iter_tensors


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

    @property
    def checkpoint_extra_s(self) -> float:
        """What checkpointing adds to the block's forward + backward (its recompute, machinery included)."""
        return max(0.0, self.checkpoint_s - self.plain_s)


@dataclass
class _Timer:
    """Wall seconds summed from the runtime's timing hook (`agent.runtime.timing`)."""

    total: float = 0.0


class _NotProbed(Exception):
    pass


def _outputs(value: Any) -> list[torch.Tensor]:
    return [t for t in iter_tensors(value) if t.requires_grad]


class _Block:
    """Runs the block on its captured inputs: forward, then backward from fixed output gradients."""

    def __init__(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], clock: DeviceClock
    ) -> None:
        self.module = module
        self.kwargs = kwargs
        self.clock = clock
        # the block's input needs a gradient in training (it comes from the block before)
        self.args = tuple(
            a.detach().requires_grad_(True) if isinstance(a, torch.Tensor) and a.is_floating_point() else a
            for a in args
        )
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.grads: list[torch.Tensor] | None = None  # output gradients, made at the first run

    def run(
        self, forward: Callable[[], Any], before_backward: Callable[[], object] | None = None
    ) -> tuple[float, float]:
        for p in self.params:
            p.grad = None
        for a in self.args:
            if isinstance(a, torch.Tensor):
                a.grad = None
        t0 = self.clock.now()
        with torch.enable_grad():
            out = forward()
        t1 = self.clock.now()
        if before_backward is not None:
            before_backward()
        outs = _outputs(out)
        if self.grads is None:
            self.grads = [torch.ones_like(t) for t in outs]
        if not outs:
            raise _NotProbed("the block's output needs no gradient")
        torch.autograd.backward(outs, self.grads)
        t2 = self.clock.now()
        del out, outs
        return t1 - t0, t2 - t1


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
    from agent.runtime.swap import SwapStore
    from agent.runtime.timing import SWAP_IN, SWAP_OUT, SWAP_PREFETCH

    clock = DeviceClock(device)
    params = [p for p in module.parameters() if p.requires_grad]
    if not params or len({p.dtype for p in params}) != 1 or any(p.device != device for p in params):
        return None
    block = _Block(module, args, kwargs, clock)
    saved_grads = [p.grad for p in params]
    rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    state = {p.untyped_storage().data_ptr() for p in module.parameters()}
    state |= {b.untyped_storage().data_ptr() for b in module.buffers()}
    out_timer, in_timer = _Timer(), _Timer()

    store = SwapStore(device, lambda t: t.untyped_storage().data_ptr() in state)

    def on_swap_section(name: str, seconds: float, depth: int) -> None:
        """The store's timing hook: copies out (pack), copies in (unpack, prefetch), outermost calls only."""
        if depth == 0:
            timer = out_timer if name == SWAP_OUT else in_timer if name in (SWAP_IN, SWAP_PREFETCH) else None
            if timer is not None:
                timer.total += seconds

    store.timing.add_listener(on_swap_section)

    def swapped() -> Any:
        with store.swapping(index):
            return module(*block.args, **block.kwargs)

    def checkpointed() -> Any:
        from torch.utils.checkpoint import checkpoint

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
            plain_t.append(block.run(plain))
            ckpt_s.append(sum(block.run(checkpointed)))
            out_timer.total = in_timer.total = 0.0
            swap_t.append(block.run(swapped, lambda: store.prefetch(index)))
            swap_direct.append((out_timer.total, in_timer.total))
        store.end_iteration()
        # the chunk runtime hooks the module while it is installed: its runs come after the others
        offload = _OffloadedChunk(module, params, device, optimizer)
        for _ in range(2):  # warm-up, then timed
            offload.reset()
            offload.run(block, plain)
        resident = offload.timer.total
        reupload = offload.move_s()
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

    # the fastest of the rounds: other work on the machine only ever adds time
    def best(xs: list[tuple[float, float]], i: int) -> float:
        return min(x[i] for x in xs)

    # swap: the difference to the plain block (it includes what happens outside the store's own code: the
    # hook calls from autograd, allocation effects), never less than the time measured inside the store
    swap_out = max(best(swap_direct, 0), best(swap_t, 0) - best(plain_t, 0))
    swap_in = max(best(swap_direct, 1), best(swap_t, 1) - best(plain_t, 1))
    return RuntimeProbe(
        plain_s=min(sum(t) for t in plain_t),
        checkpoint_s=min(ckpt_s),
        swap_out_s=swap_out,
        swap_in_s=swap_in,
        offload_s=resident,
        upload_s=reupload,
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
        from agent.runtime.device import DeviceContext
        from agent.runtime.layout import ChunkLayout, ChunkSpec, ParamEntry
        from agent.runtime.manager import ModelStateManager
        from agent.runtime.optimizer import ChunkedOptimizer, UnsupportedOptimizerError
        from agent.runtime.options import RuntimeOptions
        from agent.runtime.timing import ENTRY_POINTS, EVICT, FLUSH, STEP, UPLOAD
        from client.contract import Placement

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
        timer = self.timer = _Timer()
        moves = self.moves = dict.fromkeys((UPLOAD, EVICT, FLUSH), 0.0)

        def on_section(name: str, seconds: float, depth: int) -> None:
            """The runtime's timing hook: entry points (hooks torch calls, `zero_grad`; not `optimizer.step()`,
            run outside the timed block) not inside another section make the runtime's time; uploads, releases
            and gradient flushes, wherever they run, what moving costs."""
            if name in ENTRY_POINTS and name != STEP and depth == 0:
                timer.total += seconds
            elif name in moves:
                moves[name] += seconds

        self.params = params
        # the parameters' own storages: the runtime copies them into its chunk and never writes them, so
        # giving them back on close restores the values from before the probe (the probe's host steps
        # change the chunk's copy only)
        self.data = [p.data for p in params]
        self.manager: Any = ModelStateManager(
            module, layout, DeviceContext(device), RuntimeOptions(device=device)
        )
        self.manager.timing.add_listener(on_section)
        self._counts = (0, 0)
        self.optimizer: ChunkedOptimizer | None = None
        if optimizer is not None and optimizer.param_groups:
            # the user's optimizer class and first group's hyper-parameters, over the probed parameters:
            # the chunk's host step runs inside the gradient hook that completes the chunk, as in training
            group = optimizer.param_groups[0]
            accepted = inspect.signature(type(optimizer).__init__).parameters
            hyper = {
                k: group[k] for k in optimizer.defaults if k in group and k in accepted and k != "params"
            }
            try:
                inner: torch.optim.Optimizer | None = type(optimizer)(params, **hyper)
            except (TypeError, ValueError):
                inner = None  # the optimizer class cannot be rebuilt from its defaults: probed without a step
            if inner is not None:
                try:
                    self.optimizer = ChunkedOptimizer(inner, layout, self.manager)
                    self.manager.attach_optimizer(self.optimizer)
                except UnsupportedOptimizerError:
                    self.optimizer = None

    def reset(self) -> None:
        self.timer.total = 0.0
        self.moves.update(dict.fromkeys(self.moves, 0.0))
        c = self.manager.counters
        self._counts = (c.uploads, c.evictions)

    def move_s(self) -> float:
        """One upload plus one release without gradients to copy (what a re-upload in backward costs), from
        the timed run's uploads and releases (a release's gradient copy is charged once per chunk)."""
        c = self.manager.counters
        n_up, n_ev = c.uploads - self._counts[0], c.evictions - self._counts[1]
        if not n_up or not n_ev:
            return 0.0
        upload, evict, flush = (self.moves[k] for k in ("upload", "evict", "flush"))  # timing.UPLOAD, ...
        return upload / n_up + (evict - flush) / n_ev

    def run(self, block: _Block, forward: Callable[[], Any]) -> tuple[float, float]:
        t = block.run(forward)
        if self.optimizer is not None:
            self.optimizer.step()  # the chunk was stepped in backward: this settles the iteration
        self.manager.zero_grad()
        return t

    def close(self) -> None:
        manager, self.manager = self.manager, None
        if manager is None:
            return
        manager.detach()  # parameters are ordinary tensors again (holding the probe's stepped values)
        for p, d in zip(self.params, self.data, strict=True):
            p.data = d
