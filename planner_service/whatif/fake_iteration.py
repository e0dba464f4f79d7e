"""One training iteration of a model on fake tensors: its memory, FLOPs and bytes, block by block, with no data.

The model's parameters are `FakeTensor`s (see `architecture.fake_model`): every ATen op runs its meta kernel,
so shapes, dtypes, storages and their lifetimes are real, but nothing is allocated and nothing is computed.
Fake tensors keep the device they claim (cpu), so PyTorch picks the same kernels a real run on that device
picks (e.g. SDPA's fused flash kernel, which saves the output and log-sum-exp, where the `meta` device would
take the math path and save the b*h*s^2 attention weights).

What one iteration records, with the profiler's own accounting (agent/profiler: hooks.py, storage_tracker.py,
cursor.py; reimplemented here because the planner must not import the agent, and checked against it in
tests/planner_service/whatif/test_memory_vs_profiler.py):
- a cursor moved by forward hooks on the repeated blocks and gradient hooks on their outputs and inputs
  (prologue = 0, blocks 1..L, epilogue = L+1), and the order in which parameters are first used;
- a dispatch mode that sees every op: storages allocated (outputs that the op's schema does not declare as
  aliases) and freed (a `weakref.finalize` on the storage), so live and peak bytes at every mark; and each
  op's FLOPs (`torch.utils.flop_counter`'s formulas) and bytes read and written, per block and phase;
- saved-tensor hooks: the bytes each block saves for backward (a storage counts once, in the first block
  that saves it; parameters, buffers and the batch are excluded), and each block's input bytes.
Attention: with `gpu_attention` (the default for pricing on a catalogue entry), every
`F.scaled_dot_product_attention` call runs the CUDA fused kernels' ops instead of whatever the CPU would pick
(their meta kernels run on fake tensors of any device): flash attention without a mask, memory-efficient
attention with one (a boolean mask becomes an additive bias of the query's dtype, as PyTorch's CUDA path
does), both saving the output and log-sum-exp rather than attention weights. The CPU picks its own flash
kernel only without a mask (GPT-2, for one, passes a mask and gets the math path: b*h*s^2 fp32 weights);
`gpu_attention=False` keeps the CPU's choice, which is what the profiler measures on this machine.

Packed sequences: the library's check for several sequences packed in one row reads the position ids'
values, which fake tensors lack, so it would assume packing and build a causal mask (and repeat grouped k/v
heads) that a real run of an unpacked batch never builds; `_UnpackedSequences` answers "not packed" for the
fake run's own tensors, the true answer for a modelled batch.

The optimizer step is not run (its scalar `step` reads a value, which fake tensors do not have): its state
and its transient are added from the optimizer's definition (`optimizer_state`).

Why one module over 400 lines: the dispatch-mode tracker, the attention stand-in and the block hooks observe
one fake iteration together and share its marks.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from client.contract import Phase
from planner_service.whatif.architecture import RepeatedBlocks

_aten = torch.ops.aten
# CPU spellings of the fused attention kernels, counted with the CUDA kernels' formulas (same arguments first)
_FLOP_ALIASES: dict[Any, Any] = {
    _aten._scaled_dot_product_flash_attention_for_cpu: _aten._scaled_dot_product_flash_attention,
    _aten._scaled_dot_product_flash_attention_for_cpu_backward: _aten._scaled_dot_product_flash_attention_backward,
}


@dataclass
class OpCosts:
    """FLOPs and bytes moved of the ops of one (block, phase); `matmul` marks ops with a FLOP formula."""

    flops: list[float] = field(default_factory=list)
    bytes: list[float] = field(default_factory=list)
    matmul: list[bool] = field(default_factory=list)

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return (
            np.asarray(self.flops, dtype=np.float64),
            np.asarray(self.bytes, dtype=np.float64),
            np.asarray(self.matmul, dtype=bool),
        )


@dataclass
class ParameterUse:
    """A distinct parameter in first-use order, the block it belongs to and its other (tied) names."""

    name: str
    module_path: str
    block: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    numel: int
    nbytes: int
    aliases: tuple[str, ...]


@dataclass
class IterationRecord:
    """What one fake iteration showed (bytes are storage bytes; indices are contract block indices)."""

    n_blocks: int
    parameters: list[ParameterUse]
    resident_bytes: int  # parameters and buffers
    activation_bytes: list[int]
    input_bytes: list[int]
    forward_transient_bytes: list[int]
    backward_transient_bytes: list[int]
    dynamic_peak_bytes: int  # peak of storages allocated during forward and backward (above the resident)
    live_after_backward_bytes: int  # gradients and whatever else survives backward
    forward: list[OpCosts]
    backward: list[OpCosts]
    # the iteration's segments between cursor moves: (block, phase, peak live bytes within the segment), and
    # the live bytes where each block's forward starts (for growing the timeline to more blocks)
    segments: list[tuple[int | None, Phase, int]] = field(default_factory=list)
    forward_start_live: dict[int, int] = field(default_factory=dict)


# --------------------------------------------------------------------------------------------- cursor
@dataclass(frozen=True)
class _Mark:
    block: int | None
    phase: Phase
    live: int
    peak_before: int
    # the same less the gradients landed in `.grad` by then (agent/profiler/block_marks.py `Mark`)
    net_live: int = 0
    net_peak_before: int = 0


class _Cursor:
    def __init__(self, tracker: _Tracker) -> None:
        self.tracker = tracker
        self.block: int | None = None
        self.phase = Phase.forward
        self.marks: list[_Mark] = []
        self.landed = 0
        self._peak = 0
        self._net_peak = 0

    def land(self, nbytes: int) -> None:
        """A gradient landed in its parameter's `.grad` (agent/profiler/block_marks.py `BlockTracker.land`)."""
        sub = self.tracker.take_peak()
        self._peak = max(self._peak, sub)
        self._net_peak = max(self._net_peak, sub - self.landed)
        self.landed += nbytes

    def move(self, block: int | None, phase: Phase) -> None:
        sub = self.tracker.take_peak()
        peak, net_peak = max(self._peak, sub), max(self._net_peak, sub - self.landed)
        self._peak = self._net_peak = 0
        self.block, self.phase = block, phase
        live = self.tracker.live
        self.marks.append(_Mark(block, phase, live, peak, max(0, live - self.landed), max(0, net_peak)))


def _transients(marks: list[_Mark], n_blocks: int, phase: Phase) -> list[int]:
    """Per block: its peak in `phase` above the live level where its run starts (backward) or the higher of
    the levels where it starts and ends (forward), net of landed gradients (agent/profiler/block_marks.py
    `transient_peaks`, over the same segments)."""
    segs = [
        (a.block, a.phase, a.net_live, b.net_live, max(b.net_peak_before, a.net_live, b.net_live))
        for a, b in zip(marks, marks[1:], strict=False)
    ]
    out = [0] * n_blocks
    i = 0
    while i < len(segs):
        block, ph, start, _, peak = segs[i]
        if block is None or ph != phase:
            i += 1
            continue
        j = i
        while j + 1 < len(segs) and segs[j + 1][0] == block and segs[j + 1][1] == phase:
            j += 1
            peak = max(peak, segs[j][4])
        out[block] = max(out[block], peak - (start if phase == Phase.backward else max(start, segs[j][3])))
        i = j + 1
    return out


# --------------------------------------------------------------------------------------------- tracker
class _Tracker(TorchDispatchMode):
    """Storages allocated and freed during the window (live and peak bytes), and each op's FLOPs and bytes."""

    def __init__(self, n_blocks: int) -> None:
        super().__init__()
        self.cursor = _Cursor(self)
        self.live = 0
        self._peak = 0
        self.overall_peak = 0
        self._ids: dict[int, int] = {}  # StorageImpl address -> bytes, while alive
        self._known: set[int] = set()  # storages alive before the window (never counted)
        self._finalizers: list[weakref.finalize] = []
        self._aliasing: dict[Any, tuple[bool, ...]] = {}
        self.open = True
        self.costs = {
            Phase.forward: [OpCosts() for _ in range(n_blocks)],
            Phase.backward: [OpCosts() for _ in range(n_blocks)],
        }

    def register_existing(self, t: torch.Tensor) -> None:
        self._known.add(t.untyped_storage()._cdata)

    def take_peak(self) -> int:
        peak, self._peak = self._peak, self.live
        return peak

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not self.open:
            return out
        aliasing = self._aliasing.get(func)
        if aliasing is None:
            aliasing = tuple(r.alias_info is not None for r in func._schema.returns)
            self._aliasing[func] = aliasing
        outs = out if isinstance(out, (tuple, list)) else (out,)
        new_bytes = 0
        for i, t in enumerate(outs):
            if i < len(aliasing) and aliasing[i]:
                continue
            for u in t if isinstance(t, (tuple, list)) else (t,):
                if isinstance(u, torch.Tensor):
                    new_bytes += self._maybe_new(u)
        self._count(func, args, kwargs, out, new_bytes, aliasing)
        return out

    def _count(
        self, func: Any, args: Any, kwargs: Any, out: Any, out_bytes: int, aliasing: tuple[bool, ...]
    ) -> None:
        c = self.cursor
        if c.block is None or c.phase not in self.costs:
            return
        if aliasing and all(
            aliasing
        ):  # views and in-place ops on views: metadata only (in-place still moves)
            if not func._schema.is_mutable:
                return
        packet = func.overloadpacket
        formula = flop_registry.get(packet)
        if formula is None and func in _FLOP_ALIASES:
            formula = flop_registry.get(_FLOP_ALIASES[func].overloadpacket)
        flops = 0.0
        if formula is not None:
            try:
                flops = float(formula(*args, **kwargs, out_val=out))
            except Exception:  # a formula that does not take these arguments: count the bytes only
                flops = 0.0
        seen: set[int] = set()
        in_bytes = 0
        for a in _tensors((args, kwargs)):
            key = id(a)
            if key not in seen:
                seen.add(key)
                in_bytes += a.numel() * a.element_size()
        if aliasing and all(aliasing):
            out_bytes = 0  # in-place: the write is the read of the same elements again
            in_bytes *= 2
        costs = self.costs[c.phase][c.block]
        costs.flops.append(flops)
        costs.bytes.append(float(in_bytes + out_bytes))
        costs.matmul.append(formula is not None)

    def _maybe_new(self, t: torch.Tensor) -> int:
        if t.layout != torch.strided:
            return 0
        st = t.untyped_storage()
        key = st._cdata
        nbytes = int(st.nbytes())
        if key in self._ids or key in self._known or nbytes == 0:
            return nbytes if key in self._ids else 0
        self._ids[key] = nbytes
        self._finalizers.append(weakref.finalize(st, self._freed, key))
        self.live += nbytes
        if self.live > self._peak:
            self._peak = self.live
            self.overall_peak = max(self.overall_peak, self.live)
        return nbytes

    def _freed(self, key: int) -> None:
        nbytes = self._ids.pop(key, 0)
        if self.open:
            self.live -= nbytes

    def close(self) -> None:
        self.open = False
        for f in self._finalizers:
            f.detach()
        self._finalizers.clear()


def _tensors(value: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    if depth > 8:
        return
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v, depth + 1)
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _tensors(v, depth + 1)
    elif hasattr(value, "to_tuple"):  # Hugging Face ModelOutput
        yield from _tensors(value.to_tuple(), depth + 1)


def _key(t: torch.Tensor) -> int:
    return int(t.untyped_storage()._cdata)


class _LiveKeys:
    """The keys (`_key`) of storages seen and still alive: a storage's key leaves when it is freed. StorageImpl
    addresses are reused once freed, and a key kept after its storage died made a later tensor at that address
    look already counted: a block's input of 0 bytes, about one exact run in 20 with another thread
    allocating. Twin of `agent.profiler.tensors.LiveStorageKeys` (the service may not import the agent)."""

    def __init__(self) -> None:
        self.keys: set[int] = set()
        self._finalizers: list[weakref.finalize] = []

    def add(self, t: torch.Tensor) -> None:
        key = _key(t)
        if key not in self.keys:
            self.keys.add(key)
            self._finalizers.append(weakref.finalize(t.untyped_storage(), self.keys.discard, key))

    def __contains__(self, key: object) -> bool:
        return key in self.keys

    def close(self) -> None:
        for f in self._finalizers:
            f.detach()
        self._finalizers.clear()


# --------------------------------------------------------------------------------------------- attention
class _GpuAttention(TorchFunctionMode):
    """`F.scaled_dot_product_attention` as CUDA runs it: flash without a mask, memory-efficient with one."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is not torch.nn.functional.scaled_dot_product_attention:
            return func(*args, **kwargs)
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
        a = {**dict(zip(names, args, strict=False)), **kwargs}
        q, k, v = a["query"], a["key"], a["value"]
        mask, dropout, causal, scale = (
            a.get("attn_mask"),
            a.get("dropout_p", 0.0),
            a.get("is_causal", False),
            a.get("scale"),
        )
        if q.dim() != 4:
            return func(*args, **kwargs)
        if (
            k.shape[-3] != q.shape[-3]
        ):  # grouped-query attention: the kernels take as many k/v heads as q heads
            rep = q.shape[-3] // k.shape[-3]
            k, v = k.repeat_interleave(rep, dim=-3), v.repeat_interleave(rep, dim=-3)
        if mask is None:
            return torch.ops.aten._scaled_dot_product_flash_attention(
                q, k, v, dropout, causal, False, scale=scale
            )[0]
        if mask.dtype == torch.bool:
            mask = torch.zeros(mask.shape, dtype=q.dtype).masked_fill(mask.logical_not(), float("-inf"))
        elif mask.dtype != q.dtype:
            mask = mask.to(q.dtype)
        bias = mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        return torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, bias, True, dropout, causal, scale=scale
        )[0]


# --------------------------------------------------------------------------------------------- packing
class _UnpackedSequences:
    """While entered: Hugging Face's packed-sequence check answers "not packed" for this mode's fake tensors.

    Models built on `transformers.masking_utils` (llama, mistral, qwen, gemma, gpt_neox, starcoder2, ...)
    call `find_packed_sequence_indices(position_ids)` when given no attention mask. It reads the ids' values:
    on a real batch of one sequence per row it returns None, the causal mask is skipped and SDPA runs with
    `is_causal=True` and `enable_gqa=True` (k/v keep their grouped heads). Fake tensors have no values, so
    the library assumes packing and materialises a (batch, 1, s, s) mask, which also makes it repeat k/v to
    every query head: +24576 B of saved tensors per block on tests/planner_service/whatif's GQA starcoder2 (13%), +8192 B
    on gpt_neox, for a run nobody does. The modelled workload is `batch` sequences of `seq` tokens each,
    never packed, so "not packed" is this batch's true answer.

    Only fake tensors of an entered mode get that answer (anything else, e.g. a `torch.compile` trace in
    another thread, gets the library's check); the function is replaced while at least one mode is entered
    and restored after the last leaves. A transformers without the function is left as it is (the profiler
    comparison in tests/planner_service/whatif would show the difference).
    """

    _lock = threading.Lock()
    _modes: dict[int, int] = {}  # id(FakeTensorMode) -> times entered
    _original: Callable[[torch.Tensor], torch.Tensor | None] | None = None

    def __init__(self, mode: FakeTensorMode) -> None:
        self.mode = mode

    def __enter__(self) -> _UnpackedSequences:
        try:
            from transformers import masking_utils  # local import: transformers is optional
        except ImportError:
            return self
        cls = type(self)
        with cls._lock:
            if not cls._modes:
                original = getattr(masking_utils, "find_packed_sequence_indices", None)
                if original is None:
                    return self
                cls._original = original
                setattr(masking_utils, "find_packed_sequence_indices", cls._answer)  # noqa: B010
            cls._modes[id(self.mode)] = cls._modes.get(id(self.mode), 0) + 1
        return self

    def __exit__(self, *exc: object) -> None:
        cls = type(self)
        with cls._lock:
            count = cls._modes.get(id(self.mode), 0)
            if count == 0:
                return
            if count == 1:
                del cls._modes[id(self.mode)]
            else:
                cls._modes[id(self.mode)] = count - 1
            if not cls._modes and cls._original is not None:
                from transformers import masking_utils  # local import: transformers is optional

                setattr(masking_utils, "find_packed_sequence_indices", cls._original)  # noqa: B010
                cls._original = None

    @classmethod
    def _answer(cls, position_ids: torch.Tensor) -> torch.Tensor | None:
        if isinstance(position_ids, FakeTensor) and id(position_ids.fake_mode) in cls._modes:
            return None
        original = cls._original
        if original is None:  # restored between the library's lookup and this call: answer as the library
            from transformers import masking_utils  # local import: transformers is optional

            original = masking_utils.find_packed_sequence_indices
        return original(position_ids)


# --------------------------------------------------------------------------------------------- hooks
class _Hooks:
    """Block hooks driving the cursor, first-use order, saved-tensor and input accounting."""

    def __init__(
        self, model: nn.Module, repeated: RepeatedBlocks, cursor: _Cursor, excluded: set[int]
    ) -> None:
        self.model, self.repeated, self.cursor = model, repeated, cursor
        self.n_blocks = len(repeated) + 2
        self.excluded = excluded
        self.activation = [0] * self.n_blocks
        self.inputs = [0] * self.n_blocks
        self.first_use: list[tuple[nn.Parameter, str, int]] = []
        self._seen_params: set[int] = set()
        self._saved = _LiveKeys()
        self._input_keys = _LiveKeys()
        self._bwd_started: set[int] = set()
        self._handles: list[Any] = []

    def __enter__(self) -> _Hooks:
        for i, block in enumerate(self.repeated.modules):
            self._handles.append(block.register_forward_pre_hook(self._pre(i + 1), with_kwargs=True))
            self._handles.append(block.register_forward_hook(self._post(i + 1), with_kwargs=True))
        for path, module in self.model.named_modules():
            if any(True for _ in module.parameters(recurse=False)):
                self._handles.append(module.register_forward_pre_hook(self._use(path, module)))
        self._saved_ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._saved_ctx.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._saved_ctx.__exit__(None, None, None)
        self._saved.close()
        self._input_keys.close()
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _unique_bytes(self, tensors: list[torch.Tensor], skip: set[int]) -> int:
        seen: set[int] = set()
        total = 0
        for t in tensors:
            if t.layout != torch.strided:
                continue
            k = _key(t)
            if k in seen or k in skip:
                continue
            seen.add(k)
            total += int(t.untyped_storage().nbytes())
        return total

    def _pre(self, idx: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            self.cursor.move(idx, Phase.forward)
            tensors = list(_tensors((args, kwargs)))
            self.inputs[idx] = self._unique_bytes(tensors, self.excluded | self._input_keys.keys)
            for t in tensors:
                if t.layout == torch.strided:
                    self._input_keys.add(t)
            if torch.is_grad_enabled():
                for t in tensors:
                    if t.requires_grad:
                        self._handles.append(t.register_hook(self._input_grad(idx)))

        return hook

    def _post(self, idx: int) -> Callable[..., None]:
        last = len(self.repeated)

        def hook(module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
            if idx == last:
                self.cursor.move(idx + 1, Phase.forward)
                self.inputs[idx + 1] = self._unique_bytes(list(_tensors(output)), self.excluded)
            if torch.is_grad_enabled():
                for t in _tensors(output):
                    if t.requires_grad:
                        self._handles.append(t.register_hook(self._output_grad(idx)))

        return hook

    def _use(self, path: str, module: nn.Module) -> Callable[..., None]:
        def hook(mod: nn.Module, args: Any) -> None:
            for p in module.parameters(recurse=False):
                if id(p) not in self._seen_params:
                    self._seen_params.add(id(p))
                    self.first_use.append(
                        (p, path, self.cursor.block if self.cursor.block is not None else 0)
                    )

        return hook

    def _output_grad(self, idx: int) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            if idx not in self._bwd_started:
                self._bwd_started.add(idx)
                self.cursor.move(idx, Phase.backward)

        return hook

    def _input_grad(self, idx: int) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            if self.cursor.block == idx and self.cursor.phase == Phase.backward:
                self.cursor.move(idx - 1, Phase.backward)

        return hook

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        block = self.cursor.block
        if block is None or self.cursor.phase != Phase.forward or t.layout != torch.strided:
            return t
        k = _key(t)
        if k not in self.excluded and k not in self._saved:
            self._saved.add(t)
            self.activation[block] += int(t.untyped_storage().nbytes())
        return t


# --------------------------------------------------------------------------------------------- run
def _loss_of(output: Any) -> torch.Tensor:
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, dict):
        loss = output.get("loss")
    if not isinstance(loss, torch.Tensor):
        raise ValueError("model: its output has no `loss` (a causal LM given `labels` returns one)")
    return loss


def run_iteration(
    model: nn.Module,
    repeated: RepeatedBlocks,
    batch: dict[str, torch.Tensor],
    mode: FakeTensorMode,
    *,
    gpu_attention: bool = True,
) -> IterationRecord:
    """Forward (with `batch` as keyword arguments), loss, backward of `model`, all on fake tensors of `mode`
    (the model's: tensors the forward creates, such as position ids, are fake too)."""
    n_blocks = len(repeated) + 2
    tracker = _Tracker(n_blocks)
    excluded: set[int] = set()
    resident = 0
    seen_storage: set[int] = set()
    for t in [*model.parameters(), *model.buffers()]:
        k = _key(t)
        excluded.add(k)
        tracker.register_existing(t)
        if k not in seen_storage:
            seen_storage.add(k)
            resident += int(t.untyped_storage().nbytes())
    for t in batch.values():
        excluded.add(_key(t))
        tracker.register_existing(t)
    cursor = tracker.cursor
    hooks = _Hooks(model, repeated, cursor, excluded)

    def landed(p: torch.Tensor) -> None:
        if p.grad is not None:
            cursor.land(p.grad.numel() * p.grad.element_size())

    landing: list[Any] = []
    try:
        landing.extend(
            p.register_post_accumulate_grad_hook(landed) for p in model.parameters() if p.requires_grad
        )
        with (
            _UnpackedSequences(mode),
            mode,
            hooks,
            _GpuAttention() if gpu_attention else nullcontext(),
            tracker,
        ):
            cursor.move(0, Phase.forward)
            output = model(**batch)
            loss = _loss_of(output)
            del output
            cursor.move(n_blocks - 1, Phase.backward)
            loss.backward()
            del loss
            cursor.move(None, Phase.optimizer)
            live_after = tracker.live
    finally:
        tracker.close()
        for h in landing:
            h.remove()
    params = _ordered_parameters(model, repeated, hooks.first_use)
    hooks.inputs[0] = hooks._unique_bytes(list(batch.values()), set())  # the prologue's input: the batch
    marks = cursor.marks
    segments = [
        (a.block, a.phase, max(b.peak_before, a.live, b.live)) for a, b in zip(marks, marks[1:], strict=False)
    ]
    starts: dict[int, int] = {}
    for m in marks:
        if m.phase == Phase.forward and m.block is not None and m.block not in starts:
            starts[m.block] = m.live
    return IterationRecord(
        segments=segments,
        forward_start_live=starts,
        n_blocks=n_blocks,
        parameters=params,
        resident_bytes=resident,
        activation_bytes=hooks.activation,
        input_bytes=hooks.inputs,
        forward_transient_bytes=_transients(cursor.marks, n_blocks, Phase.forward),
        backward_transient_bytes=_transients(cursor.marks, n_blocks, Phase.backward),
        dynamic_peak_bytes=tracker.overall_peak,
        live_after_backward_bytes=live_after,
        forward=tracker.costs[Phase.forward],
        backward=tracker.costs[Phase.backward],
    )


def _ordered_parameters(
    model: nn.Module, repeated: RepeatedBlocks, first_use: list[tuple[nn.Parameter, str, int]]
) -> list[ParameterUse]:
    """Distinct parameters in first-use order (then unused ones by registration), as the profiler orders them."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    canonical = {id(p): name for name, p in model.named_parameters()}
    epilogue = len(repeated) + 1
    out: list[ParameterUse] = []
    seen: set[int] = set()

    def add(p: nn.Parameter, path: str, block: int) -> None:
        seen.add(id(p))
        name = canonical[id(p)]
        out.append(
            ParameterUse(
                name,
                path,
                block,
                tuple(p.shape),
                p.dtype,
                p.numel(),
                p.numel() * p.element_size(),
                tuple(n for n in names[id(p)] if n != name),
            )
        )

    for p, path, block in first_use:
        if id(p) not in seen and id(p) in canonical:
            add(p, path, block)
    for name, p in model.named_parameters():
        if id(p) not in seen:
            path = name.rsplit(".", 1)[0] if "." in name else ""
            inside = repeated.index_of_path(path)
            add(p, path, inside + 1 if inside is not None else epilogue)
    return out
