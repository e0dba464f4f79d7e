"""Hugging Face Trainer and Accelerate: one call before `trainer.train()`.

    trainer = Trainer(model=model, args=args, train_dataset=data)
    wrapped = wrap_trainer(trainer, device_memory=8 << 30)   # profiles, plans, applies
    trainer.train()                                          # or train(resume_from_checkpoint=...)

What it does: builds the Trainer's optimizer (`trainer.create_optimizer()`, from `args.optim`, unless one was
given), takes one batch of the training set through the Trainer's collator as the sample to profile, calls
`agent.wrap` (under the Trainer's mixed-precision autocast with `bf16=True` or `fp16=True`, so that the profile
measures the activations training keeps), and hands the wrapped optimizer back to the Trainer (`trainer.optimizer`), so the Trainer's
scheduler, Accelerate's optimizer wrapper, checkpoints and resume all go through it. The random-number states
are restored after profiling (torch's, Python's and numpy's: `agent/random_states.py`), so the Trainer's data
order, dropout and numpy-drawn masks are those of a plain run.

What then works unchanged: `max_grad_norm` clipping (Accelerate calls `torch.nn.utils.clip_grad_norm_` on the
parameters, whose gradients are all exposed after backward; the logged `grad_norm` is the true one), gradient
accumulation, `model.zero_grad()`, checkpoint save (`model.state_dict()` and `optimizer.state_dict()` are the
plain-PyTorch formats) and `resume_from_checkpoint` (loading goes through the runtime's state-dict hooks).

Several processes (`torchrun` / `accelerate launch`, `trainer.args.world_size > 1`): call `wrap_trainer` on
every rank. `agent.wrap` then plans for the whole process group and averages the gradients itself, as
DistributedDataParallel does, so three hooks on this Trainer, its Accelerator and its model (instance
attributes; no library class is patched) take DDP's place:
- `trainer.accelerator.prepare_model` prepares the wrapped model as in evaluation mode: everything Accelerate's
  prepare does (device placement, the mixed-precision forward, `torch.compile`) except the DDP wrap, which
  would average the gradients a second time;
- `model.no_sync` is `wrapped.no_sync`, which Accelerate's `no_sync` looks up under distributed: gradient
  accumulation keeps the non-final micro-steps' gradients local, as with DDP;
- `trainer._save_optimizer_and_scheduler` first takes `optimizer.state_dict()` on the ranks that do not
  write (it is a collective with sharded chunks; the Trainer calls it on the writing rank only): the
  checkpoint is the Trainer's own (a full `optimizer.pt`), read back on every rank by `resume_from_checkpoint`;
- `trainer._save` (the model's save, under `save_model`: every checkpoint, `save_only_model` ones included, and a
  user's `trainer.save_model()`, which every rank calls) takes `model.state_dict()` on every rank once and hands
  it to the Trainer's own `_save`, when the plan shards persistent chunks on the device (`model.state_dict()` is
  then a collective; the Trainer would take it on the writing rank only and the others would never arrive).
The runtime's collectives go on a process group of their own (`torch.distributed.new_group()`, made by
`agent.wrap` on every rank unless `process_group=` is given, or lent by an earlier wrap's `unwrap`): some run on its host worker thread (during backward; after
`optimizer.step()` has returned with `RuntimeOptions(async_step=True)`), and collectives that two threads issue
on one group can pair up differently on different ranks; the Trainer's own (the gathers of token counts and
losses) stay on the default group.
Refused with a ValueError naming the setting: FSDP (`args.fsdp` or Accelerate's FSDP config), DeepSpeed
(`args.deepspeed`), tensor/context/sequence parallelism or sharded data parallelism (`args.parallelism_config`)
and several GPUs in one process (`args.n_gpu`, DataParallel).

Accelerate in your own loop needs no helper in one process: wrap first, then prepare what wrap returned:

    wrapped = agent.wrap(model, optimizer, sample_batch=batch, device_memory=...)
    model, optimizer, loader = accelerator.prepare(wrapped.model, wrapped.optimizer, loader)
    ... accelerator.backward(loss); accelerator.clip_grad_norm_(model.parameters(), 1.0); optimizer.step()
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Final

import torch

from agent.random_states import kept_random_states
from agent.wrapping import Wrapped, wrap

log = logging.getLogger(__name__)

LENGTH_SCAN_LIMIT: Final = 10_000
"""Largest training set whose examples `sample_batch` reads one by one for their lengths (a Hugging Face
`Dataset` is read as one `input_ids` column at any size)."""


def sample_batch(trainer: Any) -> Any:
    """The largest training batch the Trainer feeds (collated, on the Trainer's device): its batch size of the
    examples with the longest `input_ids` (`longest_examples`), which a collator padding to the batch's longest
    example (the usual one for tokenised text) makes the largest batch; read by index from the dataset
    (iterating the Trainer's dataloader would draw its shuffling seed from the global generator)."""
    dataset = trainer.train_dataset
    if dataset is None:
        raise ValueError("trainer.train_dataset: is None; wrap_trainer profiles one training batch")
    n = min(trainer.args.per_device_train_batch_size, len(dataset))
    batch = trainer.data_collator([dataset[i] for i in longest_examples(dataset, n)])
    return trainer._prepare_inputs(batch)


def longest_examples(dataset: Any, n: int) -> list[int]:
    """The indices of the `n` examples with the longest `input_ids`, in dataset order (ties: the earlier ones;
    equal lengths: the first `n`). Before (session 9 QA) the first `n` were profiled, so under a padding collator
    the plan was made for their length and a later, longer batch raised `BatchShapeError` on a GPU. The first
    `n` where lengths are not known: examples without `input_ids`, or more than `LENGTH_SCAN_LIMIT` of them in
    a dataset that is not a Hugging Face `Dataset` (reading each could tokenise the whole set), said in the log;
    pass `max_batch=` to `wrap_trainer` there."""
    size = len(dataset)
    first = list(range(n))
    lengths: list[int] = []
    if "input_ids" in (getattr(dataset, "column_names", None) or ()):
        lengths = [len(ids) for ids in dataset["input_ids"]]  # one column read
    elif size <= LENGTH_SCAN_LIMIT:
        for i in range(size):
            example = dataset[i]
            ids = example.get("input_ids") if isinstance(example, Mapping) else None
            if ids is None or not hasattr(ids, "__len__"):
                return first
            lengths.append(len(ids))
    else:
        log.info(
            "memplan: wrap_trainer profiles the first %d training examples (%d examples are too many to read "
            "for their lengths); pass max_batch= with your longest padded batch if later batches are longer",
            n,
            size,
        )
        return first
    return sorted(sorted(range(size), key=lambda i: -lengths[i])[:n])


def wrap_trainer(trainer: Any, **wrap_kwargs: Any) -> Wrapped:
    """Wrap a `transformers.Trainer`'s model and optimizer with memplan; call before `trainer.train()` (on
    every rank when the Trainer runs on several processes).

    `wrap_kwargs` go to `agent.wrap` (`device_memory`, `host_memory`, `server`, `plan`, `options`,
    `process_group`, ...); `sample_batch` defaults to a batch of the training set's longest examples. Returns what
    `agent.wrap` returns; the Trainer keeps using its own `trainer.model` (the same module, now managed) and the
    wrapped optimizer (a scheduler the Trainer already holds, `Trainer(optimizers=(opt, sched))`, drives it too: the
    wrapped optimizer's `param_groups` are the original's). Raises ValueError if the Trainer is configured for a
    parallelism memplan does not run under (FSDP, DeepSpeed, tensor/context/sequence parallelism, DataParallel)."""
    if getattr(trainer.model, "_memplan_wrapped", False):
        raise RuntimeError("trainer.model: is already wrapped")
    refuse_unsupported_parallelism(trainer)
    distributed = trainer.args.world_size > 1
    if trainer.optimizer is None:
        trainer.create_optimizer()
    optimizer = trainer.optimizer
    optimizer = getattr(optimizer, "optimizer", optimizer)  # Accelerate's wrapper, if the user prepared one
    # the Trainer clips by default (max_grad_norm=1.0): the plan counts the redo of overlapped host steps
    wrap_kwargs.setdefault(
        "clips_gradients", bool(trainer.args.max_grad_norm and trainer.args.max_grad_norm > 0)
    )
    with kept_random_states():  # the sample batch's draw and the profile leave every generator as it was
        if "sample_batch" not in wrap_kwargs and "plan" not in wrap_kwargs:
            wrap_kwargs["sample_batch"] = sample_batch(trainer)
        # profiled under the Trainer's mixed precision (`bf16=True`/`fp16=True`: Accelerate's autocast), as its
        # training steps run: the activations saved for backward are then the half-precision ones the plan must
        # hold (a no-op context in full precision)
        with trainer.accelerator.autocast():
            wrapped = wrap(trainer.model, optimizer, **wrap_kwargs)
    trainer.optimizer = wrapped.optimizer
    trainer.model_wrapped = trainer.model
    if distributed:
        keep_accelerate_from_ddp(trainer.accelerator, wrapped)
        save_optimizer_on_every_rank(trainer, wrapped)
        save_model_on_every_rank(trainer, wrapped)
    return wrapped


def refuse_unsupported_parallelism(trainer: Any) -> None:
    """A ValueError naming the Trainer setting for a parallelism the runtime does not run under: it manages
    every parameter whole on every rank (replicated data parallelism, the gradients averaged by the runtime)."""
    args = trainer.args
    # the argument, else the Accelerator's state (Accelerate's own config: `accelerate launch --use_fsdp`)
    for name, configured, engine, why in (
        ("fsdp", getattr(trainer, "is_fsdp_enabled", False), "FSDP", "would shard the parameters it manages"),
        (
            "deepspeed",
            getattr(trainer, "is_deepspeed_enabled", False),
            "DeepSpeed",
            "would own the optimizer and the parameters it manages",
        ),
    ):
        value = getattr(args, name)
        if value or configured:
            setting = f"trainer.args.{name}: {value!r}" if value else f"Accelerate's {engine} config: set"
            raise ValueError(
                f"{setting}; wrap_trainer runs under plain data parallelism only: memplan offloads and shards "
                f"the model state itself, {engine} {why}. Drop the {engine} setting and launch the same way "
                "(torchrun / accelerate launch): the runtime averages the gradients across the ranks"
            )
    if getattr(trainer, "is_distributed_loading_by_transformers", False):
        raise ValueError(
            "trainer.model: sharded at load time (from_pretrained(distributed_config=...)); wrap_trainer needs "
            "every parameter whole on every rank: load the model without a distributed_config"
        )
    pc = getattr(trainer.accelerator, "parallelism_config", None)
    if pc is not None and (pc.tp_enabled or pc.cp_enabled or pc.sp_enabled or pc.dp_shard_enabled):
        raise ValueError(
            f"trainer.args.parallelism_config: {pc!r}; wrap_trainer runs under replicated data parallelism "
            "only (no tensor, context or sequence parallelism, no sharded data parallelism)"
        )
    if args.n_gpu > 1:
        raise ValueError(
            f"trainer.args.n_gpu: {args.n_gpu}; the Trainer would replicate the model over the GPUs of one "
            "process (DataParallel), which memplan's runtime does not follow. Launch one process per GPU "
            "(torchrun / accelerate launch), or make one GPU visible"
        )


def keep_accelerate_from_ddp(accelerator: Any, wrapped: Wrapped) -> None:
    """This Accelerator prepares the wrapped model without DistributedDataParallel (the runtime averages the
    gradients itself), and Accelerate's `no_sync` finds the runtime's: hooks on these instances only."""
    model = wrapped.model
    prepare_model = accelerator.prepare_model  # bound to this accelerator

    def prepare_without_ddp(
        module: torch.nn.Module, device_placement: bool | None = None, evaluation_mode: bool = False
    ) -> Any:
        # evaluation mode skips exactly the distributed wrap (DDP, FSDP, XLA); placement, the mixed-precision
        # forward and torch.compile happen as in training
        return prepare_model(
            module, device_placement=device_placement, evaluation_mode=evaluation_mode or module is model
        )

    accelerator.prepare_model = prepare_without_ddp
    # Accelerate's no_sync: `getattr(model, "no_sync", nullcontext)` under distributed
    model.no_sync = wrapped.no_sync  # type: ignore[assignment]


def save_optimizer_on_every_rank(trainer: Any, wrapped: Wrapped) -> None:
    """The Trainer's checkpoint saves `optimizer.state_dict()` on the writing rank (`args.should_save`) only;
    with sharded chunks that call is a collective: the other ranks make it too, just before, and drop it."""
    save = trainer._save_optimizer_and_scheduler  # bound to this Trainer (or its subclass's override)

    def save_on_every_rank(output_dir: str) -> None:
        if not trainer.args.should_save:
            wrapped.optimizer.state_dict()  # the writing rank gathers the same state inside `save`
        save(output_dir)

    trainer._save_optimizer_and_scheduler = save_on_every_rank


def save_model_on_every_rank(trainer: Any, wrapped: Wrapped) -> None:
    """The Trainer's model save (`_save`, which `save_model` calls on every rank) takes `model.state_dict()` on the
    writing rank only; with device-sharded persistent chunks that call is a collective: every rank takes it once
    here and hands it to the Trainer's `_save` (which returns at once on the other ranks)."""
    save = trainer._save  # bound to this Trainer (or its subclass's override)

    def save_on_every_rank(output_dir: str | None = None, state_dict: dict[str, Any] | None = None) -> None:
        if state_dict is None and wrapped.runtime.device_shards is not None:
            state_dict = trainer.model.state_dict()  # a collective: gathers every device-sharded chunk
        save(output_dir, state_dict=state_dict)

    trainer._save = save_on_every_rank
