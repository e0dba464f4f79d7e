"""PyTorch Lightning: one callback.

    trainer = L.Trainer(max_steps=1000, gradient_clip_val=1.0,
                        callbacks=[MemplanCallback(device_memory=8 << 30)])
    trainer.fit(module, train_loader)                       # or fit(..., ckpt_path=...)

What it does, at `on_fit_start` (after Lightning has moved the module and built its optimizer and schedulers,
before it restores a checkpoint's optimizer state): takes the first batch of the training dataloader as the
sample to profile (the random-number state is restored afterwards, so data order and dropout are those of a
plain run), calls `agent.wrap(pl_module, optimizer, ...)`, and hands the wrapped optimizer to the strategy
(`trainer.strategy.optimizers`); the schedulers keep the original, an alias of the wrapped one until unwrap
(`agent/runtime/optimizer_alias.py`: one `param_groups` list, so they drive the steps). Lightning then
drives it as any optimizer: `optimizer.step(closure)` with the forward and backward in the closure,
`gradient_clip_val` clipping (`torch.nn.utils.clip_grad_norm_` over the optimizer's parameters: every gradient
is exposed after backward, so the norm is torch's), gradient accumulation, checkpoint save (plain-PyTorch
state dicts) and resume (`ckpt_path`: the optimizer state is loaded into the wrapped optimizer).
At `on_train_end` (and on an exception) the module is unwrapped: ordinary parameters again, the original
optimizer holds the trained state and is handed back to the strategy, so Lightning's teardown, test and
predict see a plain module. `callback.wrapped` is what `agent.wrap` returned (its `report()`), and
`callback.report` the report taken just before unwrapping.

The module is profiled by calling it on the batch as `agent.wrap` does (`module(**batch)` for a dict,
`module(*batch)` for a tuple, else `module(batch)`) and taking `.loss` of the output, or `loss_fn(output,
batch)`: a LightningModule whose `forward` takes the batch works as is; otherwise pass `loss_fn` (and
`sample_batch` if the first training batch is not what `forward` takes).

Several processes (`strategy="ddp"`; tested under `torchrun`, Lightning's own launcher sets up the same): the
same callback. Lightning has put the module in DistributedDataParallel before `on_fit_start` (whose constructor
made every rank start from rank 0's weights); the callback takes the module back out of it (memplan averages
the gradients itself, and DDP's reducer on top of it would train wrong, see `agent/model_guards.py`; dropping
it also frees its gradient buckets before the profile), wraps the module under Lightning's process group
(every rank profiles, rank 0 plans, offloaded chunks may be sharded across the ranks), and points the
strategy's `block_backward_sync` (the `no_sync` Lightning enters on a non-final accumulation micro-step) at
the runtime's `no_sync`. Checkpoints: Lightning calls `state_dict()` on every rank and writes rank 0's, which
is the full, plain-PyTorch one. Buffers: rank 0's at wrap, and its persistent ones (BatchNorm's running
statistics) again at the end of each synchronising backward (`RuntimeOptions.broadcast_buffers`), where DDP's
`broadcast_buffers` sends them before the next forward: the same values for that forward. Differences from
Lightning's DDP: on an exception each rank undoes only its own guards (`unwrap` is a
collective the failed rank's peers may never join) and the module is left to the launcher; under
`ddp_spawn`/`ddp_notebook` the callback is a pickled copy in each process, so the launching process's
`callback.wrapped` and `callback.report` stay None.

Supported: one optimizer, one process or Lightning's DDP strategy, `precision="32-true"` or `"bf16-true"` (the
runtime keeps the module's own dtype) or `"bf16-mixed"` (Lightning's autocast around each training step; the
profile runs under the same autocast, `precision_plugin.forward_context()`, so the plan holds the bf16
activations training keeps). Refused with a ValueError naming the setting: several optimizers, other
multi-process strategies (FSDP, DeepSpeed, ...) and DDP communication hooks (memplan shards and averages the
gradients itself), `16-mixed` (fp16 with Lightning's GradScaler: the scaler itself works with the runtime,
`tests/agent/wrap/test_grad_scaler.py`, but Lightning turns `16-mixed` into `bf16-mixed` on a CPU, so its
path through the callback cannot be exercised here).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.callbacks import Callback
from torch.nn.parallel import DistributedDataParallel

from agent.applied import remove_guards
from agent.random_states import RandomStates, kept_random_states
from agent.wrapping import unwrap, wrap

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from agent.report import WrapReport
    from agent.wrapping import Wrapped

SUPPORTED_PRECISION = ("32-true", "bf16-true", "bf16-mixed")


def first_training_batch(trainer: pl.Trainer) -> Any:
    """The first batch of the training dataloader, on the module's device, drawn without moving the global
    random-number state (a shuffling DataLoader draws its seed from it when iterated)."""
    source = trainer.fit_loop._data_source  # the dataloaders or datamodule given to fit (no public accessor)
    if not source.is_defined():
        raise ValueError("sample_batch: the trainer has no training dataloader to take one from; pass one")
    loaders = source.dataloader()
    loader = loaders[0] if isinstance(loaders, list | tuple) else loaders
    with kept_random_states():
        batch = next(iter(loader))
    return trainer.strategy.batch_to_device(batch)


def check_supported(trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
    """Raise ValueError naming the Trainer setting memplan does not handle yet."""
    if trainer.world_size > 1:
        check_data_parallel(trainer, pl_module)
    if str(trainer.precision) not in SUPPORTED_PRECISION:
        raise ValueError(
            f"trainer.precision: {trainer.precision!r} is not supported; use one of {', '.join(SUPPORTED_PRECISION)}"
        )
    if len(trainer.strategy.optimizers) != 1:
        raise ValueError(
            f"configure_optimizers: returned {len(trainer.strategy.optimizers)} optimizers; memplan manages one"
        )


def check_data_parallel(trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
    """Several processes: only Lightning's DDP strategy, whose model is plain DistributedDataParallel around
    this module and without a communication hook (memplan replaces DDP; a hook's compression or averaging
    would be silently dropped)."""
    strategy = trainer.strategy
    model = strategy.model
    if not (isinstance(model, DistributedDataParallel) and model.module is pl_module):
        raise ValueError(
            f"trainer.strategy: {type(strategy).__name__} (world size {trainer.world_size}) is not supported; "
            "under several processes the callback takes Lightning's DDP strategy (strategy='ddp'): memplan "
            "replaces DistributedDataParallel, sharding chunks and averaging the gradients itself"
        )
    hook = getattr(strategy, "_ddp_comm_hook", None)
    if hook is not None:
        raise ValueError(
            f"DDPStrategy(ddp_comm_hook=...): {getattr(hook, '__name__', hook)!r} is not supported; memplan "
            "averages the gradients itself and would drop the hook's effect"
        )


class MemplanCallback(Callback):
    """Wrap the LightningModule and its optimizer with memplan for the duration of `trainer.fit`.

    `wrap_kwargs` go to `agent.wrap` (`device_memory`, `host_memory`, `server`, `plan`, `options`, `loss_fn`,
    `max_batch`, ...); `sample_batch` defaults to the first training batch; `clips_gradients` defaults to whether
    the Trainer clips (`gradient_clip_val`)."""

    def __init__(self, **wrap_kwargs: Any) -> None:
        self.wrap_kwargs = wrap_kwargs
        self.wrapped: Wrapped | None = None
        self.report: WrapReport | None = None
        self._original: torch.optim.Optimizer | None = None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        check_supported(trainer, pl_module)
        strategy = trainer.strategy
        optimizer = strategy.optimizers[0]
        kwargs = copy.copy(self.wrap_kwargs)
        clip = trainer.gradient_clip_val
        kwargs.setdefault("clips_gradients", bool(clip is not None and float(clip) > 0))
        if "sample_batch" not in kwargs and "plan" not in kwargs:
            kwargs["sample_batch"] = first_training_batch(trainer)
        rng = RandomStates.capture()
        ddp = strategy.model if trainer.world_size > 1 else None
        if ddp is not None:
            strategy.model = pl_module  # DDP's reducer and its gradient buckets go with it
        try:
            # `bf16-mixed`: profiled under the precision plugin's forward context (its autocast), as the training
            # steps run: the plan holds the activations they keep. Not for `bf16-true`, whose context sets the
            # default dtype for everything `wrap` builds (its module is bf16 already)
            mixed = str(trainer.precision).endswith("-mixed")
            with trainer.precision_plugin.forward_context() if mixed else contextlib.nullcontext():
                wrapped = wrap(pl_module, optimizer, **kwargs)
        except BaseException:
            if ddp is not None:
                strategy.model = ddp
            raise
        finally:
            rng.restore()
        del ddp
        self.wrapped, self._original = wrapped, optimizer
        strategy.optimizers = [wrapped.optimizer]
        if trainer.world_size > 1:
            # what Lightning enters on a non-final accumulation micro-step (its own looks for a DDP model)
            strategy.block_backward_sync = wrapped.no_sync  # type: ignore[attr-defined]

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._unwrap(trainer)

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        if trainer.world_size > 1:
            # this rank may have raised alone: `unwrap` is a collective (with sharded chunks) that would wait for
            # ranks that are not coming, or replace the user's error with a RankArrivalError; undo this rank's
            # part only (the guards; Lightning's teardown may move the module), and let the launcher stop the job
            self._restore(trainer, remove_guards)
        else:
            self._unwrap(trainer)

    def _unwrap(self, trainer: pl.Trainer) -> None:
        """Give Lightning a plain module and the original optimizer (with the trained state) back."""

        def undo(wrapped: Wrapped) -> None:
            self.report = wrapped.report()
            unwrap(wrapped)

        self._restore(trainer, undo)

    def _restore(self, trainer: pl.Trainer, undo: Callable[[Wrapped], object]) -> None:
        """`undo` the wrapping, then (whatever it raised) hand the strategy its original optimizer and its own
        `block_backward_sync` back."""
        wrapped, original = self.wrapped, self._original
        if wrapped is None or wrapped.unwrapped or original is None:
            return
        try:
            undo(wrapped)
        finally:
            trainer.strategy.__dict__.pop("block_backward_sync", None)
            trainer.strategy.optimizers = [original]
            self._original = None
