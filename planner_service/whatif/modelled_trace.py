"""A modelled Trace: a model's fake iteration (memory, FLOPs, bytes) priced on a hardware catalogue entry.

`ModelledWorkload` is what the user asks about (batch, sequence, precision, optimizer); `iterate` runs the
fake iteration once (hardware-independent: memory is the same on every device); `trace_on` prices it on one
catalogue entry. So a question over several GPUs builds and runs the model once.

The trace has the profiler's shape, with these differences, all stated in `Trace.modelled`:
- per-block forward and backward seconds come from `roofline.block_seconds`; recompute = the block's forward;
- activation, input and transient bytes are the fake iteration's (the profiler's accounting, see
  fake_iteration.py); the runtime costs the profiler probes (swap, chunk runtime overheads) are 0, so the
  cost model charges copies by the catalogue's bandwidths;
- `peak_device_bytes` (the un-managed peak: everything on the device, every activation kept) is the
  resident parameters and buffers + optimizer state + the larger of the iteration's dynamic peak and what
  is live after backward plus the optimizer step's transient (PyTorch's single-tensor Adam builds two
  temporaries the size of each parameter in turn: 2 x the largest parameter; SGD none);
- optimizer state: torch's Adam/AdamW keep two moments in the parameters' dtype; SGD (no momentum) none.

Why one module over 400 lines: iterate, extrapolate from sampled blocks and price on an entry are one pipeline
from a config to a Trace over one `ModelIteration`.
"""

from __future__ import annotations

import copy
import hashlib
import sys
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, TypeVar

import torch

from client.contract import (
    BlockInfo,
    BlockKind,
    BlockMeasurement,
    CatalogEntry,
    Measurements,
    ModelInfo,
    ModelledFrom,
    OptimizerKind,
    OptimizerMeasurement,
    ParameterInfo,
    Phase,
    Precision,
    Software,
    Trace,
    Workload,
)
from client.contract.common import MAX_NAME_CHARS
from planner_service.whatif import roofline
from planner_service.whatif.architecture import (
    FAKE_RUNS,
    ArchitectureError,
    RepeatedBlocks,
    describe,
    fake_model,
    num_layers,
    repeated_blocks,
)
from planner_service.whatif.catalog import to_hardware
from planner_service.whatif.fake_iteration import IterationRecord, ParameterUse, run_iteration

if TYPE_CHECKING:
    from planner_service.whatif.calibration import Calibration

T = TypeVar("T")
METHOD = "fake-tensor iteration + roofline"
_ELT = {"fp32": 4, "bf16": 2, "fp16": 2}
_TORCH_DTYPE_NAME = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


@dataclass(frozen=True)
class ModelledWorkload:
    batch_size: int
    sequence_length: int
    dtype: str = "bf16"
    optimizer: OptimizerKind = OptimizerKind.adamw

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ValueError(f"batch: must be at least 1, got {self.batch_size}")
        if self.sequence_length < 1:
            raise ValueError(f"seq: must be at least 1, got {self.sequence_length}")
        if self.dtype not in _ELT:
            raise ValueError(f"dtype: {self.dtype!r} is not one of {', '.join(_ELT)}")


@dataclass(frozen=True)
class ModelIteration:
    """One fake iteration of a model under a workload, ready to be priced on any catalogue entry."""

    name: str
    architecture: str
    fingerprint: str
    workload: ModelledWorkload
    repeated: tuple[str, ...]
    block_classes: tuple[str, ...]
    edge_paths: tuple[tuple[str, ...], tuple[str, ...]]
    record: IterationRecord
    sampled_blocks: int | None = None  # set when the iteration ran on this many blocks and was extrapolated
    gpu_attention: bool = True


def iterate(
    config: object,
    workload: ModelledWorkload,
    *,
    name: str | None = None,
    exact: bool = False,
    gpu_attention: bool = True,
) -> ModelIteration:
    """Build `config`'s causal LM on fake tensors and run one training iteration of `workload` on it.

    A model of more than `SAMPLED_BLOCKS` (4) repeated blocks is run twice, truncated to 3 and to 4 blocks,
    and the rest extrapolated (as the profiler's `max_blocks`): blocks 5..L copy block 4's figures (block 1
    holds the tensors every block shares, e.g. rotary tables), and the resident bytes, the dynamic peak and
    what survives backward grow by the difference between the two runs per extra block. (From 2 to 3
    blocks the peak can still move to another place in the iteration; from 3 blocks on it grew by the same
    amount per block on every model tried.) This assumes the
    repeated blocks are identical (one class, one config); `exact=True` runs every block instead.
    `gpu_attention` runs attention as CUDA's fused kernels do (see fake_iteration.py); False keeps this CPU's
    kernel choice (what the profiler measures here).
    """
    layers = num_layers(config)
    if exact or layers is None or layers <= SAMPLED_BLOCKS or varied_layers(config, layers):
        return _iterate_built(config, workload, name, gpu_attention)
    small = _iterate_built(_with_layers(config, SAMPLED_BLOCKS - 1), workload, name, gpu_attention)
    big = _iterate_built(_with_layers(config, SAMPLED_BLOCKS), workload, name, gpu_attention)
    return _extrapolate(small, big, layers, name or describe(config))  # type: ignore[arg-type]


SAMPLED_BLOCKS = 4


def varied_layers(config: object, layers: int) -> bool:
    """Whether the config says its layers differ (then every block is run: the sampled runs assume the blocks
    after the fourth repeat it): a per-layer list with more than one value (`layer_types` of OLMo-hybrid or
    Gemma 3, `layers_block_type` of Zamba2) or a period of layer kinds (Jamba's `attn_layer_period`)."""
    for key, value in vars(config).items():
        if isinstance(value, list | tuple) and len(value) == layers and len({repr(v) for v in value}) > 1:
            return True
        if key.endswith("_period") and isinstance(value, int) and not isinstance(value, bool) and value > 1:
            return True
    return False


def _with_layers(config: object, k: int) -> object:
    c = copy.deepcopy(config)
    c.num_hidden_layers = k  # type: ignore[attr-defined]
    for attr in ("layer_types",):  # per-layer lists must match the layer count
        v = getattr(c, attr, None)
        if isinstance(v, list):
            setattr(c, attr, v[:k])
    return c


def _iterate_built(
    config: object, workload: ModelledWorkload, name: str | None, gpu_attention: bool
) -> ModelIteration:
    with FAKE_RUNS:  # one fake model at a time: building one switches the process's default dtype
        return _iterate_locked(config, workload, name, gpu_attention)


def _iterate_locked(
    config: object, workload: ModelledWorkload, name: str | None, gpu_attention: bool
) -> ModelIteration:
    model, mode = fake_model(config, workload.dtype)  # type: ignore[arg-type]
    rb: RepeatedBlocks = repeated_blocks(model)
    vocab = int(getattr(config, "vocab_size", 0) or 2)
    with mode:
        ids = torch.randint(0, vocab, (workload.batch_size, workload.sequence_length))
    try:
        record = run_iteration(
            model, rb, {"input_ids": ids, "labels": ids}, mode, gpu_attention=gpu_attention
        )
    except Exception as exc:  # the model's forward does something fake tensors cannot (e.g. reads a value)
        raise ArchitectureError(
            f"{type(model).__name__}: one training iteration could not run on fake tensors "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); profile it instead and "
            "retarget the measured trace (memplan whatif --trace)"
        ) from exc
    return ModelIteration(
        name=name or describe(config),  # type: ignore[arg-type]
        architecture=type(model).__name__,
        fingerprint=_fingerprint(type(model).__name__, record.parameters),
        workload=workload,
        repeated=rb.names,
        block_classes=tuple(type(m).__name__ for m in rb.modules),
        edge_paths=_edge_paths(record),
        record=record,
        gpu_attention=gpu_attention,
    )


def _fingerprint(architecture: str, params: list[ParameterUse]) -> str:
    """SHA-256 of the architecture class name and every parameter's name, shape and dtype."""
    h = hashlib.sha256(f"{architecture}\n".encode())
    for p in params:
        h.update(f"{p.name}:{p.shape}:{str(p.dtype).removeprefix('torch.')}\n".encode())
    return h.hexdigest()


def _edge_paths(record: IterationRecord) -> tuple[tuple[str, ...], tuple[str, ...]]:
    paths: list[list[str]] = [[], []]
    for p in record.parameters:
        side = 0 if p.block == 0 else 1 if p.block == record.n_blocks - 1 else None
        if side is not None and p.module_path not in paths[side]:
            paths[side].append(p.module_path)
    return tuple(paths[0]), tuple(paths[1])


def _grown_peak(r: IterationRecord, s: IterationRecord, extra: int) -> int:
    """The dynamic peak of `r` (k blocks) with `extra` more blocks, segment by segment.

    Per extra block, the live level grows by `df` (what one block keeps from its forward: the growth between
    the starts of blocks k-1 and k) through the forward of the added blocks, the epilogue and the backward of
    the added blocks, and by `dg` (what survives one block's backward, mostly its gradients: the growth of
    the post-backward level between the (k-1)- and k-block runs) through the backward of the first blocks.
    Block k's backward stands for every block from k to L: its level is linear in the block's position, so
    its maximum is at an end, grown by `df` or by `dg`. Segments before block k's forward do not grow.
    """
    k = r.n_blocks - 2
    df = r.forward_start_live.get(k, 0) - r.forward_start_live.get(k - 1, 0)
    dg = r.live_after_backward_bytes - s.live_after_backward_bytes
    if not r.segments:  # no timeline: the peaks' difference per block
        return r.dynamic_peak_bytes + extra * max(0, r.dynamic_peak_bytes - s.dynamic_peak_bytes)
    best = 0
    for block, phase, peak in r.segments:
        if block is None:
            grow = 0
        elif phase == Phase.forward:
            grow = df if block >= k else 0
        elif block == k + 1:  # epilogue backward: every block's activations are still alive
            grow = df
        elif block == k:
            grow = max(df, dg)
        else:
            grow = dg
        best = max(best, peak + extra * max(0, grow))
    return best


def _extrapolate(small: ModelIteration, big: ModelIteration, layers: int, name: str) -> ModelIteration:
    """`big` (k blocks) grown to `layers` blocks, using `small` (k - 1 blocks) for the per-block growth."""
    k = len(big.repeated)
    if len(small.repeated) != k - 1 or big.block_classes[-1] != big.block_classes[0]:
        raise ValueError("extrapolation: the truncated runs do not differ by one block of the same class")
    r, s = big.record, small.record
    extra = layers - k
    container = big.repeated[-1].rsplit(".", 1)[0] if "." in big.repeated[-1] else ""

    def prefix_of(j: int) -> str:
        return f"{container}.{j}" if container else str(j)

    last = big.repeated[-1]

    def renamed(text: str, j: int) -> str:
        return prefix_of(j) + text[len(last) :] if text == last or text.startswith(last + ".") else text

    head = [p for p in r.parameters if p.block < k]
    sample = [p for p in r.parameters if p.block == k]
    tail = [p for p in r.parameters if p.block == k + 1]
    params = head + sample
    for j in range(k, layers):
        params += [
            ParameterUse(
                renamed(p.name, j),
                renamed(p.module_path, j),
                j + 1,
                p.shape,
                p.dtype,
                p.numel,
                p.nbytes,
                tuple(renamed(a, j) for a in p.aliases),
            )
            for p in sample
        ]
    params += [
        ParameterUse(p.name, p.module_path, layers + 1, p.shape, p.dtype, p.numel, p.nbytes, p.aliases)
        for p in tail
    ]

    def grow(per_block: list[T]) -> list[T]:
        return per_block[: k + 1] + [per_block[k]] * extra + [per_block[k + 1]]

    record = IterationRecord(
        n_blocks=layers + 2,
        parameters=params,
        resident_bytes=r.resident_bytes + extra * (r.resident_bytes - s.resident_bytes),
        activation_bytes=grow(r.activation_bytes),
        input_bytes=grow(r.input_bytes),
        forward_transient_bytes=grow(r.forward_transient_bytes),
        backward_transient_bytes=grow(r.backward_transient_bytes),
        dynamic_peak_bytes=_grown_peak(r, s, extra),
        live_after_backward_bytes=r.live_after_backward_bytes
        + extra * max(0, r.live_after_backward_bytes - s.live_after_backward_bytes),
        forward=grow(r.forward),
        backward=grow(r.backward),
    )
    names = big.repeated + tuple(prefix_of(j) for j in range(k, layers))
    return ModelIteration(
        name=name,
        architecture=big.architecture,
        fingerprint=_fingerprint(big.architecture, params),
        workload=big.workload,
        repeated=names,
        block_classes=big.block_classes + (big.block_classes[-1],) * extra,
        edge_paths=(big.edge_paths[0], big.edge_paths[1]),
        record=record,
        sampled_blocks=k,
        gpu_attention=big.gpu_attention,
    )


def _edge_name(kind: str, paths: tuple[str, ...]) -> str:
    inner = ",".join(p if p else "<root>" for p in paths) or "-"
    name = f"{kind}[{inner}]"
    return name if len(name) <= MAX_NAME_CHARS else name[: MAX_NAME_CHARS - 4] + "...]"


def method_of(it: ModelIteration) -> str:
    attention = "CUDA fused attention" if it.gpu_attention else "this CPU's attention kernels"
    if it.sampled_blocks is None:
        return f"{METHOD} ({attention})"
    return (
        f"fake-tensor iteration ({it.sampled_blocks} of {len(it.repeated)} blocks run, rest extrapolated; "
        f"{attention}) + roofline"
    )


def unmanaged_peak_bytes(it: ModelIteration) -> int:
    """Device bytes of the plain iteration (no offload, no checkpointing): see the module docstring."""
    rec = it.record
    state = optimizer_state_bytes_per_element(it.workload) * sum(p.numel for p in rec.parameters)
    step_transient = 2 * max((p.nbytes for p in rec.parameters), default=0) if state else 0
    return (
        rec.resident_bytes
        + state
        + max(rec.dynamic_peak_bytes, rec.live_after_backward_bytes + step_transient)
    )


def optimizer_state_bytes_per_element(w: ModelledWorkload) -> int:
    return 0 if w.optimizer == OptimizerKind.sgd else 2 * _ELT[w.dtype]


def trace_on(
    it: ModelIteration,
    entry: CatalogEntry,
    *,
    host_memory_bytes: int | None = None,
    cpu_cores: int | None = None,
    eff: roofline.Efficiency = roofline.DEFAULT_EFFICIENCY,
    calibration: Calibration | None = None,
) -> Trace:
    """The modelled Trace of iteration `it` on one device of catalogue entry `entry`.

    With a `calibration` (calibrate.py) of this entry and precision, its factors replace `eff` and the trace
    says it is calibrated, from how many measured traces and with which residual (in `modelled.factors`), and of
    which models (`modelled.calibration_models`)."""
    if calibration is not None:
        if (calibration.hardware_key, calibration.precision) != (entry.key, it.workload.dtype):
            raise ValueError(
                f"calibration: fitted for {calibration.hardware_key} in {calibration.precision}, "
                f"not {entry.key} in {it.workload.dtype}"
            )
        eff = calibration.efficiency
    rec, w = it.record, it.workload
    hardware = to_hardware(entry, host_memory_bytes=host_memory_bytes, cpu_cores=cpu_cores)
    n = rec.n_blocks
    per_block = [0] * n
    params: list[ParameterInfo] = []
    for p in rec.parameters:
        per_block[p.block] += p.nbytes
        params.append(
            ParameterInfo(
                name=p.name,
                block=p.block,
                shape=list(p.shape),
                dtype=str(p.dtype).removeprefix("torch."),
                numel=p.numel,
                bytes=p.nbytes,
                aliases=list(p.aliases),
            )
        )
    blocks = [
        BlockInfo(
            index=0,
            name=_edge_name("prologue", it.edge_paths[0]),
            kind=BlockKind.prologue,
            module_class="prologue",
            parameter_bytes=per_block[0],
        )
    ]
    for i, (bname, cls) in enumerate(zip(it.repeated, it.block_classes, strict=True)):
        blocks.append(
            BlockInfo(
                index=i + 1,
                name=bname,
                kind=BlockKind.block,
                module_class=cls,
                parameter_bytes=per_block[i + 1],
            )
        )
    blocks.append(
        BlockInfo(
            index=n - 1,
            name=_edge_name("epilogue", it.edge_paths[1]),
            kind=BlockKind.epilogue,
            module_class="epilogue",
            parameter_bytes=per_block[n - 1],
        )
    )
    meas: list[BlockMeasurement] = []
    for b in range(n):
        fwd = roofline.block_seconds(rec.forward[b], entry, w.dtype, eff)
        bwd = roofline.block_seconds(rec.backward[b], entry, w.dtype, eff)
        meas.append(
            BlockMeasurement(
                block=b,
                forward_s=fwd,
                backward_s=bwd,
                recompute_s=fwd,
                activation_bytes=rec.activation_bytes[b],
                input_bytes=rec.input_bytes[b],
                forward_transient_peak_bytes=rec.forward_transient_bytes[b],
                backward_transient_peak_bytes=rec.backward_transient_bytes[b],
            )
        )
    param_bytes = sum(p.nbytes for p in rec.parameters)
    dev_opt = roofline.device_optimizer_bytes_per_s(entry, w.optimizer, eff)
    host_opt = roofline.host_optimizer_bytes_per_s(hardware.cpu_cores, eff)
    iteration_s = sum(m.forward_s + m.backward_s for m in meas) + param_bytes / dev_opt
    state = optimizer_state_bytes_per_element(w)
    elt = _ELT[w.dtype]
    return Trace(
        hardware=hardware,
        software=Software(
            torch_version=_torch_version(),
            cuda_version=None,
            python_version=sys.version.split()[0],
            memplan_version=_memplan_version(),
        ),
        model=ModelInfo(
            name=it.name,
            architecture=it.architecture,
            fingerprint=it.fingerprint,
            parameter_count=sum(p.numel for p in rec.parameters),
            dtype=_TORCH_DTYPE_NAME[w.dtype],
            blocks=blocks,
            parameters=params,
        ),
        workload=Workload(
            batch_size=w.batch_size,
            sequence_length=w.sequence_length,
            precision=Precision(w.dtype),
            optimizer=w.optimizer,
            optimizer_state_bytes_per_param=state,
            master_bytes_per_param=0,
            gradient_bytes_per_param=elt,
        ),
        measurements=Measurements(
            blocks=meas,
            extrapolated=it.sampled_blocks is not None,
            profiled_blocks=list(range(it.sampled_blocks + 1)) + [n - 1]
            if it.sampled_blocks is not None
            else [],
            optimizer=OptimizerMeasurement(device_bytes_per_s=dev_opt, host_bytes_per_s=host_opt),
            iteration_s=iteration_s,
            peak_device_bytes=unmanaged_peak_bytes(it),
        ),
        modelled=ModelledFrom(
            hardware_key=entry.key,
            method=method_of(it),
            factors=calibration.factors() if calibration is not None else eff.as_factors(),
            calibrated=calibration is not None and calibration.calibrated,
            calibration_models=list(calibration.models) if calibration is not None else [],
        ),
    )


def _torch_version() -> str:
    return str(torch.__version__)


def _memplan_version() -> str:
    try:
        return version("memplan")
    except PackageNotFoundError:
        return "unknown"
