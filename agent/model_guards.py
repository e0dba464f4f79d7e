"""Checks and guards `wrap` puts around the user's arguments and model.

* `byte_size`: a memory limit given as bytes (int, or a float with no fraction such as 80e9) or as the
  CLI's size strings ("80GiB", "24GB"; `client.units.parse_bytes`); anything else is an error naming the
  argument.
* `check_not_compiled`: a model (or block) already compiled with `torch.compile` is refused with one
  message saying what works: wrap the uncompiled model, then compile it or its blocks (the runtime's
  hooks then run eagerly between compiled regions, `agent/runtime/eager.py`; docs/architecture/wrap.md).
* `check_dense_gradients`: an embedding built with `sparse=True` (`nn.Embedding`, `nn.EmbeddingBag`) is refused
  naming it: its gradient is a sparse tensor, and every chunk holds its gradients dense (a device gradient area,
  the host gradient the host optimizer steps, the all-reduce); before session 22 profiling failed deep inside with
  "Cannot access storage of SparseTensorImpl". (The profiler also refuses any other sparse `.grad`, naming the
  parameter.)
* `MoveGuard`: after `wrap`, the parameters are views into the runtime's chunk buffers. `model.to(...)`
  to the device and dtype the model already has (what Hugging Face Trainer does after the model is
  wrapped) returns the model unchanged; a real move or cast, and `.cuda()` / `.half()` / ... (any
  `_apply`), raise `WrappedModelMoveError` instead of being silently undone by the runtime.
  `copy.deepcopy(wrapped.model)` raises `WrappedModelCopyError`: the copy took the runtime's hooks along, and its
  forward ran on the training model's chunk buffers (a "frozen" reference model that followed training, no
  error; session 19 probe). Copy the model before `wrap`, or build one from `wrapped.model.state_dict()`.
  `torch.save(wrapped.model)` (pickle, `copy.copy`) raises it too, saying to save the state dict (it failed with
  a PicklingError naming one of the runtime's hook functions; session 22 probe).
* `DDPGuard`: `DistributedDataParallel(wrapped.model)` (a DDP user's habit, and what Accelerate's or
  Lightning's multi-process `prepare` does) raises `WrappedModelDDPError` in DDP's constructor, before any
  collective: memplan averages the gradients itself, and DDP's reducer on top of it trained silently wrong
  (parameters 0.33 relative off plain DDP's after 4 steps, 2 gloo ranks). DDP reads the module's
  `_ddp_params_and_buffers_to_ignore` (its documented way to leave parameters to another mechanism) with
  `set(...)`; the guard puts there an iterable that raises.
* `SyncedGenerate`: with chunks sharded on the device under several processes, the wrapped Hugging Face model's
  `generate` defaults to `synced_gpus=True`, as transformers' does for DeepSpeed ZeRO-3 and FSDP models.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn

from client.units import parse_bytes


def byte_size(name: str, value: object) -> int | None:
    """`value` as a byte count (None stays None); ValueError/TypeError naming `name` otherwise."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise TypeError(
            f"{name}: expected bytes (int), a whole float or a size string such as '24GiB', got {value!r}"
        )
    # int, and numpy's integer scalars (`np.int64(2**30)`)
    if isinstance(value, numbers.Integral):
        n = int(value)
    elif isinstance(value, float):
        if not math.isfinite(value) or value != int(value):
            raise ValueError(
                f"{name}: {value!r} is not a whole number of bytes (use an int or a size such as '24GiB')"
            )
        n = int(value)
    elif isinstance(value, str):
        if value.strip().startswith("-"):
            raise ValueError(f"{name}: must be positive, got {value!r}")
        try:
            n = parse_bytes(value)
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from None
    else:
        raise TypeError(
            f"{name}: expected bytes (int), a whole float or a size string such as '24GiB', got {type(value).__name__}"
        )
    if n <= 0:
        raise ValueError(f"{name}: must be positive, got {value!r}")
    return n


def check_seconds(name: str, value: object) -> None:
    """A duration argument: a finite number of seconds, at least 0; ValueError/TypeError naming `name`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: expected seconds (a number), got {type(value).__name__}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name}: must be a finite number of seconds, at least 0, got {value!r}")


class CompiledModelError(TypeError):
    """The model or one of its modules was compiled with torch.compile before `wrap`."""


_COMPILE_ADVICE = (
    "memplan's runtime must hook the uncompiled modules to move their parameters between "
    "device buffers and the host: wrap the uncompiled model, then compile the wrapped model or "
    "its blocks (e.g. `for b in wrapped.model.model.layers: b.compile()`, or "
    "`torch.compile(wrapped.model)`; see 'Limits' in README.md)"
)


def check_not_compiled(model: nn.Module) -> None:
    """Raise CompiledModelError when `model` or any submodule is a torch.compile result or compiled in place."""
    for name, module in model.named_modules():
        where = f"model.{name}" if name else "model"
        if hasattr(module, "_orig_mod") and type(module).__name__ == "OptimizedModule":
            raise CompiledModelError(
                f"{where}: is a torch.compile result (OptimizedModule); {_COMPILE_ADVICE}"
            )
        if getattr(module, "_compiled_call_impl", None) is not None:
            raise CompiledModelError(f"{where}: was compiled in place (module.compile()); {_COMPILE_ADVICE}")


def check_dense_gradients(model: nn.Module) -> None:
    """Raise ValueError naming the first embedding built with `sparse=True` (its gradients are sparse tensors)."""
    for name, module in model.named_modules():
        if isinstance(module, nn.Embedding | nn.EmbeddingBag) and module.sparse:
            where = f"model.{name}" if name else "model"
            raise ValueError(
                f"{where}: {type(module).__name__}(sparse=True) gives sparse gradients; memplan keeps every "
                "parameter's gradient dense (in its chunk's gradient area, on the host for the host optimizer). "
                "Build it with sparse=False (the default; dense gradients of the same values)"
            )


def check_one_dtype_and_device(model: nn.Module) -> None:
    """Raise ValueError when the parameters are of several dtypes or on several devices, naming each with its count
    and first parameter. memplan keeps each chunk's parameters in one flat tensor of the model's dtype on one
    device; before session 23 a T5 loaded in fp16 (its `_keep_in_fp32_modules` keep `wo` in fp32) failed in
    `wrap` with a `PlanMismatchError` asking whether the plan was solved for another precision."""
    kinds: dict[tuple[torch.dtype, torch.device], tuple[int, str]] = {}
    for name, p in model.named_parameters():
        key = (p.dtype, p.device)
        count, first = kinds.get(key, (0, name))
        kinds[key] = (count + 1, first)
    if len(kinds) <= 1:
        return
    listed = "; ".join(
        f"{n} in {str(dtype).removeprefix('torch.')} on {device} (first {first!r})"
        for (dtype, device), (n, first) in sorted(kinds.items(), key=lambda kv: -kv[1][0])
    )
    kept = list(getattr(model, "_keep_in_fp32_modules", None) or [])
    why = (
        f" (the model's _keep_in_fp32_modules {kept} stay fp32 when it loads in half precision)"
        if kept
        else ""
    )
    raise ValueError(
        f"model: parameters of several dtypes or devices: {listed}{why}. memplan manages one dtype on one device "
        "per model (each chunk is one flat tensor); cast or move the whole model first (e.g. "
        "model.to(torch.bfloat16), or load it in one dtype), then wrap"
    )


class WrappedModelMoveError(RuntimeError):
    """A wrapped model was asked to move to another device or dtype."""


class WrappedModelCopyError(RuntimeError):
    """`copy.deepcopy` of a wrapped model (its copy would run on the runtime's buffers)."""


class MoveGuard:
    """Installed on a wrapped model: `.to()` to where it already is is a no-op, anything else raises; so does
    `copy.deepcopy`."""

    def __init__(self, model: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
        self.model, self.device, self.dtype = model, device, dtype
        model.to = self._to  # type: ignore[method-assign]
        model._apply = self._apply  # type: ignore[method-assign]
        model.__dict__["__deepcopy__"] = self._deepcopy  # copy.deepcopy looks it up on the instance
        model.__dict__["__reduce_ex__"] = self._reduce_ex  # so do pickle (torch.save) and copy.copy

    def remove(self) -> None:
        for name in ("to", "_apply", "__deepcopy__", "__reduce_ex__"):
            if name in self.model.__dict__:
                del self.model.__dict__[name]

    def _same_device(self, device: torch.device | None) -> bool:
        if device is None:
            return True
        if device.type != self.device.type:
            return False
        if device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
            return index == self.device.index
        return device.index in (None, self.device.index, 0)

    def _to(self, *args: Any, **kwargs: Any) -> nn.Module:
        device, dtype, _non_blocking, _memory_format = torch._C._nn._parse_to(*args, **kwargs)
        if self._same_device(device) and dtype in (None, self.dtype):
            return self.model
        raise WrappedModelMoveError(
            f"model.to({', '.join([*map(repr, args), *(f'{k}={v!r}' for k, v in kwargs.items())])}): the model is "
            f"wrapped by memplan on {self.device} in {self.dtype}; moving or casting it would be undone by the "
            "runtime. Move or cast the model before agent.wrap (or agent.unwrap, move, wrap again)"
        )

    def _deepcopy(self, memo: dict[int, Any]) -> nn.Module:
        raise WrappedModelCopyError(
            "copy.deepcopy(wrapped.model): the copy would keep memplan's hooks and run on the training model's "
            "chunk buffers (a reference or teacher model that silently follows training). Copy the model before "
            "agent.wrap, or build a plain one from the wrapped model's weights, e.g. for a Hugging Face model "
            "ref = type(m)(m.config); ref.load_state_dict(wrapped.model.state_dict())"
        )

    def _reduce_ex(self, protocol: object) -> Any:
        raise WrappedModelCopyError(
            "torch.save(wrapped.model) / pickle / copy.copy: the wrapped model holds memplan's hooks and runtime "
            "(threads, device buffers), which do not pickle (before session 22 a PicklingError named a hook "
            "function). Save `wrapped.model.state_dict()` (plain PyTorch's format; `save_pretrained` works too), "
            "or agent.unwrap first and save the plain model"
        )

    def _apply(self, fn: Any, recurse: bool = True) -> nn.Module:
        raise WrappedModelMoveError(
            "model: is wrapped by memplan; .cuda()/.cpu()/.half()/.float()/... would move or cast parameters "
            "that live in the runtime's buffers. Do it before agent.wrap (or agent.unwrap first)"
        )


class WrappedModelDDPError(RuntimeError):
    """A memplan-wrapped model was handed to `DistributedDataParallel`."""


class _RefuseDDP:
    """What `DistributedDataParallel.__init__` finds as the module's parameters to ignore: iterating raises."""

    def __iter__(self) -> Any:
        raise WrappedModelDDPError(
            "DistributedDataParallel(wrapped.model): memplan averages gradients across the ranks itself (as DDP "
            "does, in the process group wrap ran in); train wrapped.model directly, with wrapped.no_sync() for "
            "accumulation. With Accelerate under several processes (its prepare() puts the model in DDP), call "
            "agent.integrations.hf.keep_accelerate_from_ddp(accelerator, wrapped) before accelerator.prepare(...); "
            "wrap_trainer does it for the Trainer. For DDP, agent.unwrap first"
        )


class _InstanceMark:
    """An attribute set on the model instance (its `__dict__`: no module registration) for a library to read,
    and put back as it was by `remove`."""

    NAME = ""

    def __init__(self, model: nn.Module, value: object) -> None:
        self.model = model
        self.previous = model.__dict__.get(self.NAME, _MISSING)
        model.__dict__[self.NAME] = value

    def remove(self) -> None:
        if self.previous is _MISSING:
            self.model.__dict__.pop(self.NAME, None)
        else:
            self.model.__dict__[self.NAME] = self.previous


class DDPGuard(_InstanceMark):
    """Installed on a wrapped model: `DistributedDataParallel(model)` raises `WrappedModelDDPError`."""

    NAME = "_ddp_params_and_buffers_to_ignore"

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model, _RefuseDDP())


class SyncedGenerate(_InstanceMark):
    """Installed on a wrapped Hugging Face model whose every forward is a collective (chunks sharded on the
    device, several ranks): its `generate` defaults to `synced_gpus=True`, as transformers' own does for a
    DeepSpeed ZeRO-3 or FSDP model, for the same reason: a rank whose sequences are finished keeps running the
    decoding forwards with the others, instead of training on while they still gather (which `DeviceShards.agree`
    turns into a `RankArrivalError` on every rank). An explicit `synced_gpus` (True or False) is passed as given.
    An instance attribute shadowing the class's method, not transformers' FSDP mark `_is_fsdp_managed_module`:
    torch.compile (Dynamo) reads that mark too, and treats the module as FSDP1 (refused with `fullgraph=True`).
    Not covered: a `generate` reached through another object (a PEFT wrapper around the wrapped model passes
    its own arguments down), and the Seq2Seq Trainer, which passes `synced_gpus=False` explicitly unless the
    model is DeepSpeed's or FSDP's (set `synced_gpus=True` in its generation config)."""

    NAME = "generate"

    def __init__(self, model: nn.Module) -> None:
        # the bound method (the class's, or an instance attribute already there)
        generate = cast("Callable[..., Any]", model.generate)

        def synced_generate(*args: Any, **kwargs: Any) -> Any:
            if kwargs.get("synced_gpus") is None:
                kwargs["synced_gpus"] = True
            return generate(*args, **kwargs)

        synced_generate.__doc__ = generate.__doc__
        synced_generate.__wrapped__ = generate  # type: ignore[attr-defined]
        super().__init__(model, synced_generate)


_MISSING = object()
