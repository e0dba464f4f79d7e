"""Hugging Face Trainer and Accelerate: one call before `trainer.train()`.

    trainer = Trainer(model=model, args=args, train_dataset=data)
    wrapped = wrap_trainer(trainer, device_memory=8 << 30)   # profiles, plans, applies
    trainer.train()                                          # or train(resume_from_checkpoint=...)

What it does: builds the Trainer's optimizer (`trainer.create_optimizer()`, from `args.optim`, unless one was
given), takes one batch of the training set through the Trainer's collator as the sample to profile, calls
`agent.wrap`, and hands the wrapped optimizer back to the Trainer (`trainer.optimizer`), so the Trainer's
scheduler, Accelerate's optimizer wrapper, checkpoints and resume all go through it. The random-number state
is restored after profiling, so the Trainer's data order and dropout are those of a plain run.

What then works unchanged: `max_grad_norm` clipping (Accelerate calls `torch.nn.utils.clip_grad_norm_` on the
parameters, whose gradients are all exposed after backward; the logged `grad_norm` is the true one), gradient
accumulation, `model.zero_grad()`, checkpoint save (`model.state_dict()` and `optimizer.state_dict()` are the
plain-PyTorch formats) and `resume_from_checkpoint` (loading goes through the runtime's state-dict hooks).

Accelerate in your own loop needs no helper: wrap first, then prepare what wrap returned:

    wrapped = agent.wrap(model, optimizer, sample_batch=batch, device_memory=...)
    model, optimizer, loader = accelerator.prepare(wrapped.model, wrapped.optimizer, loader)
    ... accelerator.backward(loss); accelerator.clip_grad_norm_(model.parameters(), 1.0); optimizer.step()

Single process only (one device); multi-process data parallelism is not supported by the runtime yet.
"""

from __future__ import annotations

from typing import Any

import torch

from agent.wrapping import Wrapped, wrap


def sample_batch(trainer: Any) -> Any:
    """One training batch as the Trainer feeds it (collated, on the Trainer's device), read by index from the
    dataset: iterating the Trainer's dataloader would draw its shuffling seed from the global generator."""
    dataset = trainer.train_dataset
    if dataset is None:
        raise ValueError("trainer.train_dataset: is None; wrap_trainer profiles one training batch")
    n = min(trainer.args.per_device_train_batch_size, len(dataset))
    batch = trainer.data_collator([dataset[i] for i in range(n)])
    return trainer._prepare_inputs(batch)


def wrap_trainer(trainer: Any, **wrap_kwargs: Any) -> Wrapped:
    """Wrap a `transformers.Trainer`'s model and optimizer with memplan; call before `trainer.train()`.

    `wrap_kwargs` go to `agent.wrap` (`device_memory`, `host_memory`, `server`, `plan`, `options`, ...);
    `sample_batch` defaults to the first batch of the training set. Returns what `agent.wrap` returns; the
    Trainer keeps using its own `trainer.model` (the same module, now managed) and the wrapped optimizer.
    Raises ValueError if the Trainer already holds a learning-rate scheduler (it would drive the unwrapped
    optimizer) or runs on several processes."""
    if getattr(trainer.model, "_memplan_wrapped", False):
        raise RuntimeError("trainer.model: is already wrapped")
    if trainer.lr_scheduler is not None:
        raise ValueError(
            "trainer.lr_scheduler: already built on the unwrapped optimizer; pass only the optimizer "
            "(or none) to the Trainer and let it build the scheduler during train()"
        )
    if trainer.args.world_size > 1:
        # the Trainer wraps its model for distributed training itself (Accelerate's prepare: DDP, or FSDP /
        # DeepSpeed when configured); DDP would average the gradients that memplan's runtime already averages
        # (issue 20) and does not expect parameters re-pointed between host and device. `agent.wrap` under the
        # process group does the whole job: use it in a training loop of your own under torchrun
        raise ValueError(
            f"trainer.args.world_size: {trainer.args.world_size}; wrap_trainer runs on one process only: on "
            "several, the Trainer wraps the model in DistributedDataParallel itself (or FSDP / DeepSpeed when "
            "configured), which would average the gradients a second time. Call agent.wrap on every rank in a "
            "training loop of your own instead: it plans for the whole process group and averages the "
            "gradients across the ranks as DistributedDataParallel does"
        )
    if trainer.optimizer is None:
        trainer.create_optimizer()
    optimizer = trainer.optimizer
    optimizer = getattr(optimizer, "optimizer", optimizer)  # Accelerate's wrapper, if the user prepared one
    rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    # the Trainer clips by default (max_grad_norm=1.0): the plan counts the redo of overlapped host steps
    wrap_kwargs.setdefault(
        "clips_gradients", bool(trainer.args.max_grad_norm and trainer.args.max_grad_norm > 0)
    )
    try:
        if "sample_batch" not in wrap_kwargs and "plan" not in wrap_kwargs:
            wrap_kwargs["sample_batch"] = sample_batch(trainer)
        wrapped = wrap(trainer.model, optimizer, **wrap_kwargs)
    finally:
        torch.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
    trainer.optimizer = wrapped.optimizer
    trainer.model_wrapped = trainer.model
    return wrapped
