"""Trace: what the agent measured about one training job (hardware, model, workload, per-block costs).

Why one module over 400 lines: the Trace is one versioned wire schema (v1), one pydantic model tree with its
cross-field validators.
"""

from __future__ import annotations

import base64
import math
from enum import StrEnum
from functools import cached_property
from typing import Annotated, Any, Final, Literal

import numpy as np
from pydantic import (
    BeforeValidator,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    Strict,
    ValidationError,
    ValidationInfo,
    model_serializer,
    model_validator,
)

from client.contract.common import (
    MAX_ALLOCATION_EVENTS,
    MAX_BANDWIDTH_SAMPLES,
    MAX_BLOCKS,
    MAX_CALIBRATION_MODELS,
    MAX_MODEL_CONFIG_KEYS,
    MAX_PARAMETERS,
    TRACE_SCHEMA_VERSION,
    Bool,
    Bytes,
    BytesPerSecond,
    ContractModel,
    Count,
    Float,
    Int,
    Name,
    PositiveBytes,
    Seconds,
    Text,
)
from client.contract.distributed import Distributed


class DeviceType(StrEnum):
    cuda = "cuda"
    cpu = "cpu"


class Precision(StrEnum):
    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"


class OptimizerKind(StrEnum):
    adamw = "adamw"
    adam = "adam"
    sgd = "sgd"


class BlockKind(StrEnum):
    prologue = "prologue"  # embeddings and whatever runs before the first repeated block
    block = "block"  # one of the repeated transformer blocks
    epilogue = "epilogue"  # final norm, head, loss


class AllocationCategory(StrEnum):
    param = "param"
    grad = "grad"
    optimizer = "optimizer"
    activation = "activation"
    temp = "temp"


class Phase(StrEnum):
    forward = "forward"
    backward = "backward"
    optimizer = "optimizer"


# The same names as plain strings, for the event columns: 10^5-long lists of enum members cost pydantic a
# Python call per element to serialise (~14 ms per column of 77k); these are validated and serialised in Rust.
# A test checks they name the enums' values exactly.
CategoryName = Literal["param", "grad", "optimizer", "activation", "temp"]
PhaseName = Literal["forward", "backward", "optimizer"]


# --------------------------------------------------------------------------------------------- hardware
class BandwidthSample(ContractModel):
    """One measured copy: `size_bytes` moved at `bytes_per_s` (median of repetitions)."""

    size_bytes: PositiveBytes
    bytes_per_s: BytesPerSecond


class BandwidthCurves(ContractModel):
    """Host<->device copy bandwidth by transfer size; each curve sorted by size, sizes unique."""

    h2d_pinned: list[BandwidthSample] = Field(min_length=1, max_length=MAX_BANDWIDTH_SAMPLES)
    d2h_pinned: list[BandwidthSample] = Field(min_length=1, max_length=MAX_BANDWIDTH_SAMPLES)
    h2d_pageable: list[BandwidthSample] = Field(default_factory=list, max_length=MAX_BANDWIDTH_SAMPLES)
    d2h_pageable: list[BandwidthSample] = Field(default_factory=list, max_length=MAX_BANDWIDTH_SAMPLES)
    # pinned copies in each direction while a copy of the same size runs the other way at the same time (two
    # streams on CUDA, two threads on CPU): what the runtime gets when uploads and offloads overlap. Optional
    # (traces from before they were measured have neither); both or neither.
    duplex_h2d_pinned: list[BandwidthSample] = Field(
        default_factory=list,
        max_length=MAX_BANDWIDTH_SAMPLES,
        description="pinned H2D while a D2H copy runs concurrently",
    )
    duplex_d2h_pinned: list[BandwidthSample] = Field(
        default_factory=list,
        max_length=MAX_BANDWIDTH_SAMPLES,
        description="pinned D2H while an H2D copy runs concurrently",
    )

    @model_validator(mode="after")
    def _sorted_unique(self) -> BandwidthCurves:
        for name in (
            "h2d_pinned",
            "d2h_pinned",
            "h2d_pageable",
            "d2h_pageable",
            "duplex_h2d_pinned",
            "duplex_d2h_pinned",
        ):
            sizes = [s.size_bytes for s in getattr(self, name)]
            if sizes != sorted(set(sizes)):
                raise ValueError(f"{name}: samples must be sorted by size_bytes with no repeated size")
        if bool(self.duplex_h2d_pinned) != bool(self.duplex_d2h_pinned):
            missing = "duplex_d2h_pinned" if self.duplex_h2d_pinned else "duplex_h2d_pinned"
            raise ValueError(f"{missing}: the concurrent curves come as a pair (both or neither)")
        return self

    @property
    def has_duplex(self) -> bool:
        """Both directions were also measured running at the same time."""
        return bool(self.duplex_h2d_pinned)

    @model_serializer(mode="wrap")
    def _without_absent_duplex(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """Absent concurrent curves are left out of the JSON, so a trace without them (every older one)
        serialises, and hashes, exactly as before they existed."""
        data: dict[str, Any] = handler(self)
        if not self.duplex_h2d_pinned and not self.duplex_d2h_pinned:
            data.pop("duplex_h2d_pinned", None)
            data.pop("duplex_d2h_pinned", None)
        return data


class Hardware(ContractModel):
    """The machine the trace was measured on."""

    device_type: DeviceType
    device_name: Name = Field(description="e.g. 'NVIDIA H100 80GB HBM3', or the CPU model for cpu")
    device_count: Int = Field(ge=1, le=4096, description="devices per node that the job uses")
    device_memory_bytes: PositiveBytes = Field(description="capacity of one device")
    host_memory_bytes: PositiveBytes = Field(description="host RAM of the node")
    pinned_memory_limit_bytes: Bytes | None = Field(default=None, description="page-locked limit, if known")
    cpu_cores: Int = Field(ge=1, le=100_000)
    bandwidth: BandwidthCurves
    # Left out of the JSON when absent, so single-process traces keep their content hashes (issue 20).
    distributed: Distributed | None = Field(
        default=None,
        exclude_if=lambda v: v is None,
        description="the job's process group (world size, ranks per node, interconnect, collectives); "
        "absent for a single-process job",
    )

    @property
    def world_size(self) -> int:
        """Ranks in the job (1 for a single-process job)."""
        return self.distributed.world_size if self.distributed is not None else 1

    @property
    def ranks_per_node(self) -> int:
        """Ranks sharing one node's host RAM (1 for a single-process job)."""
        return self.distributed.ranks_per_node if self.distributed is not None else 1

    @property
    def machine_device_memory_bytes(self) -> int:
        """The memory of one device as the machine has it: a CPU "device" is the host itself, so its memory is
        the host RAM (its `device_memory_bytes` is the limit a job planned under, which names no machine)."""
        return self.host_memory_bytes if self.device_type == DeviceType.cpu else self.device_memory_bytes

    @property
    def key(self) -> str:
        """Stable identity used to group traces and plans by hardware: device type, name, memory, count, and
        for a multi-rank job `:w<world size>r<ranks per node>` (a single-process job's key is unchanged).
        Memory under 1 GiB is written in MiB, never as 0GiB."""
        memory = self.machine_device_memory_bytes
        size = f"{memory // 2**30}GiB" if memory >= 2**30 else f"{memory // 2**20}MiB"
        group = f":w{self.world_size}r{self.ranks_per_node}" if self.world_size > 1 else ""
        return f"{self.device_type.value}:{self.device_name}:{size}:x{self.device_count}{group}"


class Software(ContractModel):
    torch_version: Name
    cuda_version: Text | None = Field(default=None, max_length=64)
    python_version: Name
    memplan_version: Name


# ------------------------------------------------------------------------------------------------ model
class BlockInfo(ContractModel):
    """A unit of execution: the prologue, one repeated block, or the epilogue, in execution order."""

    index: Int = Field(ge=0, description="position in `ModelInfo.blocks`; equals the list index")
    name: Name = Field(description="module path, e.g. 'transformer.h.3'")
    kind: BlockKind
    module_class: Name
    parameter_bytes: Bytes = Field(description="sum of `bytes` of the parameters mapped to this block")


class ParameterInfo(ContractModel):
    """One parameter, listed in execution order (first use); a shared parameter appears once."""

    name: Name = Field(description="qualified name as in `model.named_parameters()`")
    block: Int = Field(ge=0, description="index of the block that uses it first")
    shape: list[Int] = Field(max_length=16)
    dtype: Name = Field(description="torch dtype name of the training copy, e.g. 'float32'")
    numel: Count
    bytes: Bytes = Field(description="numel * element size of `dtype`")
    aliases: list[Name] = Field(default_factory=list, description="other names of a shared (tied) parameter")
    # Left out of the JSON when True (the default), so traces of all-trainable jobs keep their content hashes.
    trainable: Bool = Field(
        default=True,
        exclude_if=lambda v: v is True,
        description="the job trains it (`requires_grad` and held by the optimizer); a frozen parameter has no "
        "gradient and no optimizer state, so the planner counts neither for it",
    )
    # Left out of the JSON when False (the default): traces without it load, and keep their content hashes.
    used_outside_owner: Bool = Field(
        default=False,
        exclude_if=lambda v: v is False,
        description="an op in the profiled forward used it while no module owning it was in its forward (a "
        "parent's `hidden @ self.embed.weight.T`); the planner never shards its chunk on the device, where it "
        "would read a released placeholder",
    )
    # Left out of the JSON when empty (the default), so traces without it keep their content hashes; traces
    # from before session 9 lack it, and the planner then falls back to the aliases' module paths.
    use_blocks: list[Int] = Field(
        default_factory=list,
        max_length=MAX_BLOCKS,
        exclude_if=lambda v: not v,
        description="the blocks whose forward calls a module holding this parameter (under any of its names), "
        "ascending, the first being `block`; recorded for a tied parameter (one with `aliases`) and for one used "
        "by more than one block, empty otherwise. Autograd holds the gradient of a later use until the first "
        "use's backward, so the planner counts it in the backward peaks of the blocks in between",
    )

    @model_validator(mode="after")
    def _shape_holds_numel(self) -> ParameterInfo:
        """Every dimension non-negative and their product `numel` (session 19 probe: `[-3, 7]` was accepted)."""
        if any(d < 0 for d in self.shape):
            raise ValueError(f"shape: {self.shape} has a negative dimension")
        if math.prod(self.shape) != self.numel:
            raise ValueError(
                f"shape: {self.shape} holds {math.prod(self.shape)} elements, numel says {self.numel}"
            )
        return self


class ModelInfo(ContractModel):
    name: Name = Field(description="human name, e.g. 'llama-12L-1024H'")
    architecture: Name = Field(description="model class, e.g. 'LlamaForCausalLM'")
    fingerprint: Name = Field(description="hash of the architecture: classes, parameter names and shapes")
    parameter_count: Count
    dtype: Name
    blocks: list[BlockInfo] = Field(min_length=1, max_length=MAX_BLOCKS)
    parameters: list[ParameterInfo] = Field(max_length=MAX_PARAMETERS)
    # Left out of the JSON when absent, so traces without it keep their content hashes.
    config: dict[str, Any] | None = Field(
        default=None,
        max_length=MAX_MODEL_CONFIG_KEYS,
        exclude_if=lambda v: v is None,
        description="the model's Hugging Face config (`config.to_dict()`, `model_type` included) when it has "
        "one: what the what-if calibration needs to price this trace's blocks (FLOPs and bytes per operation) "
        "and fit the hardware's efficiency from it, whatever model is asked about",
    )

    @model_validator(mode="after")
    def _consistent(self) -> ModelInfo:
        for i, b in enumerate(self.blocks):
            if b.index != i:
                raise ValueError(f"blocks[{i}].index: is {b.index}, must equal its position {i}")
        per_block = [0] * len(self.blocks)
        seen: set[str] = set()
        for i, p in enumerate(self.parameters):
            if p.block >= len(self.blocks):
                raise ValueError(
                    f"parameters[{i}].block: {p.block} names no block (there are {len(self.blocks)})"
                )
            if p.name in seen:
                raise ValueError(f"parameters[{i}].name: {p.name!r} appears twice")
            seen.add(p.name)
            per_block[p.block] += p.bytes
            if p.use_blocks:
                uses = p.use_blocks
                if uses[0] != p.block or any(a >= b for a, b in zip(uses, uses[1:], strict=False)):
                    raise ValueError(
                        f"parameters[{i}].use_blocks: {uses} must be ascending and distinct and start with "
                        f"its block {p.block}"
                    )
                if uses[-1] >= len(self.blocks):
                    raise ValueError(
                        f"parameters[{i}].use_blocks: {uses[-1]} names no block (there are {len(self.blocks)})"
                    )
        for i, b in enumerate(self.blocks):
            if b.parameter_bytes != per_block[i]:
                raise ValueError(
                    f"blocks[{i}].parameter_bytes: is {b.parameter_bytes}, its parameters add up to {per_block[i]}"
                )
        total = sum(p.numel for p in self.parameters)
        if self.parameters and total != self.parameter_count:
            raise ValueError(f"parameter_count: is {self.parameter_count}, parameters add up to {total}")
        return self

    @property
    def repeated_blocks(self) -> list[BlockInfo]:
        return [b for b in self.blocks if b.kind == BlockKind.block]


class Workload(ContractModel):
    batch_size: Int = Field(ge=1, le=1_000_000)
    sequence_length: Int = Field(ge=1, le=100_000_000)
    precision: Precision
    optimizer: OptimizerKind
    optimizer_state_bytes_per_param: Int = Field(
        ge=0, le=64, description="optimizer state per parameter, e.g. 8 for Adam's two fp32 moments"
    )
    master_bytes_per_param: Int = Field(
        default=0,
        ge=0,
        le=16,
        description="extra fp32 master copy per parameter in mixed precision (4), else 0",
    )
    gradient_bytes_per_param: Int = Field(ge=1, le=16, description="bytes of one gradient element")
    undo_backup_bytes_per_param: Int = Field(
        default=0,
        ge=0,
        le=80,
        description="host bytes per offloaded parameter the runtime keeps to undo a "
        "speculative host optimizer step (a copy of the master and of the optimizer state); 0: none kept",
    )
    clips_gradients: Bool = Field(
        default=False,
        description="the job changes gradients after backward on most steps (clipping that "
        "scales): speculative host steps are redone at optimizer.step(), after backward, not overlapped",
    )

    @property
    def key(self) -> str:
        """Stable identity of the workload for plan reuse: shape, precision, optimizer, and `:clip` for a job
        that clips (its plan counts the redo of speculative host steps; keys of other jobs are unchanged)."""
        clip = ":clip" if self.clips_gradients else ""
        return (
            f"b{self.batch_size}:s{self.sequence_length}:{self.precision.value}:{self.optimizer.value}{clip}"
        )


# ------------------------------------------------------------------------------------------ measurement
class BlockMeasurement(ContractModel):
    """Measured costs of one block (median of repetitions, hook overhead removed)."""

    block: Int = Field(ge=0, description="index into `ModelInfo.blocks`")
    forward_s: Seconds
    backward_s: Seconds
    recompute_s: Seconds = Field(description="forward re-run under checkpointing during backward")
    activation_bytes: Bytes = Field(description="bytes saved for backward by this block (saved-tensor hooks)")
    input_bytes: Bytes = Field(description="bytes of the block's inputs: what checkpointing must keep")
    forward_transient_peak_bytes: Bytes = Field(description="peak above the resident level during forward")
    backward_transient_peak_bytes: Bytes = Field(description="peak above the resident level during backward")
    # Runtime costs measured through the agent runtime's own code paths (optional: 0.0 = not measured,
    # the cost model then charges copies by bytes over the bandwidth curves, as before).
    swap_out_s: Seconds = Field(
        default=0.0,
        description="extra forward time when this block's saved tensors are swapped out to the host "
        "(runtime swap store: host buffers, copies, hooks)",
    )
    swap_in_s: Seconds = Field(
        default=0.0,
        description="extra backward time to bring this block's swapped tensors back (prefetch, "
        "unpack, release)",
    )
    offload_overhead_s: Seconds = Field(
        default=0.0,
        description="extra time of one iteration when this block's parameters are in an offloaded "
        "chunk of the chunk runtime (residency hooks, gradient gather, bind/release, host step), beyond the "
        "copies of their bytes (charged by bandwidth), the host step (charged by throughput) and the uploads",
    )
    upload_overhead_s: Seconds = Field(
        default=0.0,
        description="extra time of each upload of this block's parameters into a device buffer "
        "(release, buffer choice, bind), beyond the copy of their bytes (charged by bandwidth)",
    )
    # Left out of the JSON when 0 (not measured: traces from before it keep their content hashes).
    offload_forward_s: Seconds = Field(
        default=0.0,
        exclude_if=lambda v: v == 0.0,
        description="the part of offload_overhead_s paid in forward (the residency hooks, and autograd's "
        "saved-tensor hooks and slower kernels around them, beyond the uploads): the cost model reports it "
        "in forward instead of backward; the iteration is the same. 0 = not measured (all of it in backward)",
    )

    offload_step_s: Seconds = Field(
        default=0.0,
        exclude_if=lambda v: v == 0.0,
        description="the part of offload_overhead_s paid in optimizer.step() (settling the chunk's speculative "
        "host step): the cost model reports it in the step instead of backward; the iteration is the same. "
        "0 = not measured",
    )

    @model_validator(mode="after")
    def _parts_of_overhead(self) -> BlockMeasurement:
        parts = self.offload_forward_s + self.offload_step_s
        if parts > self.offload_overhead_s * (1 + 1e-9):  # (1e-9: the profiler's float shares of it)
            field = (
                "offload_forward_s" if self.offload_forward_s > self.offload_overhead_s else "offload_step_s"
            )
            raise ValueError(
                f"{field}: offload_forward_s {self.offload_forward_s} + offload_step_s {self.offload_step_s} is "
                f"more than offload_overhead_s {self.offload_overhead_s}, of which they are parts"
            )
        return self


class OptimizerMeasurement(ContractModel):
    device_bytes_per_s: BytesPerSecond = Field(
        description="real optimizer step on the device, parameter bytes/s"
    )
    host_bytes_per_s: BytesPerSecond = Field(
        description="fused/foreach optimizer on the host, parameter bytes/s"
    )
    # Left out of the JSON when 0 (not measured: traces from before it keep their content hashes).
    host_step_overhead_s: Seconds = Field(
        default=0.0,
        exclude_if=lambda v: v == 0.0,
        description="per-call cost of one host optimizer step (one chunk's), beyond its bytes over "
        "host_bytes_per_s: the cost model charges each chunk's host step overhead + bytes / rate; 0 = not "
        "measured (older traces: bytes / rate alone)",
    )
    # Left out of the JSON when 0 (not measured: traces from before it keep their content hashes).
    host_copy_bytes_per_s: BytesPerSecond = Field(
        default=0.0,
        exclude_if=lambda v: v == 0.0,
        description="host memory copy rate (bytes written/s, large tensors): the runtime's copies around each "
        "offloaded chunk's host step (the undo backup of a speculative step, the exposed .grad, a mixed-precision "
        "compute copy), charged by bytes on a GPU; 0 = not measured (older traces: not charged)",
    )


class Measurements(ContractModel):
    blocks: list[BlockMeasurement] = Field(min_length=1, max_length=MAX_BLOCKS)
    optimizer: OptimizerMeasurement
    iteration_s: Seconds = Field(description="wall time of one un-hooked training iteration")
    peak_device_bytes: Bytes = Field(description="peak device memory of one un-hooked iteration")
    extrapolated: Bool = Field(
        default=False, description="true when some repeated blocks copy a representative block's figures"
    )
    profiled_blocks: list[Int] = Field(
        default_factory=list, description="indices measured directly when `extrapolated` is true"
    )


class AllocationEvent(ContractModel):
    """One buffer of a steady-state iteration: live over [alloc_index, free_index) in logical time."""

    id: Int = Field(ge=0)
    size_bytes: PositiveBytes
    alloc_index: Int = Field(ge=0, description="logical time (event index) of the allocation")
    free_index: Int | None = Field(
        default=None, ge=1, description="logical time of the free; None: lives across iterations (long-lived)"
    )
    category: AllocationCategory
    block: Int | None = Field(default=None, ge=0, description="block active at allocation, if any")
    phase: Phase

    @model_validator(mode="after")
    def _free_after_alloc(self) -> AllocationEvent:
        if self.free_index is not None and self.free_index <= self.alloc_index:
            raise ValueError(f"free_index: {self.free_index} is not after alloc_index {self.alloc_index}")
        return self


EVENT_FIELDS = ("id", "size_bytes", "alloc_index", "free_index", "category", "block", "phase")

# The packed wire form (`EventArrays`, trace schema 2): each column's little-endian numpy dtype. A long-lived
# buffer's free_index and an event outside any block's block are -1; category and phase are positions in
# the enums' member order (`CATEGORIES`, `PHASES`).
EVENT_DTYPES: Final[dict[str, str]] = {
    "id": "<i8",
    "size_bytes": "<i8",
    "alloc_index": "<i4",
    "free_index": "<i4",
    "category": "u1",
    "block": "<i2",
    "phase": "u1",
}
CATEGORIES: Final = tuple(AllocationCategory)
PHASES: Final = tuple(Phase)
MAX_HORIZON: Final = 2**31 - 1  # logical times fit the packed int32 columns
_ID_MAX = 2**63 - 1


def _base64_in_python_mode(value: Any, info: ValidationInfo) -> Any:
    """JSON input is decoded by pydantic (`val_json_bytes`); a str in Python input (e.g. `json.loads` of a
    trace) is the same base64url text, decoded here, not taken as UTF-8."""
    if info.mode == "python" and isinstance(value, str):
        try:  # either alphabet, as pydantic's JSON decoder; any other character is an error
            return base64.b64decode(
                value.replace("-", "+").replace("_", "/") + "=" * (-len(value) % 4), validate=True
            )
        except ValueError as exc:
            raise ValueError(f"not base64url: {exc}") from None
    return value


def _packed(dtype: str, meaning: str) -> Any:
    """A packed column: its length is checked against `count` (at most MAX_ALLOCATION_EVENTS) after decoding;
    the body size limit bounds the text before."""
    width = np.dtype(dtype).itemsize
    return Annotated[
        bytes,
        BeforeValidator(_base64_in_python_mode),
        Field(
            description=f"base64url of `count` little-endian {dtype} values ({width} bytes per event): {meaning}"
        ),
    ]


class AllocationColumns(ContractModel):
    """The events as Python lists (struct of arrays): event i is the i-th of every list. Trace schema 1 sent
    this on the wire (still accepted as `event_columns`); `AllocationTrace.columns` gives it for any trace.
    `category` and `phase` hold plain strings (the enums' values; `AllocationTrace.events` gives members)."""

    id: list[Annotated[int, Strict(), Field(ge=0, le=_ID_MAX)]] = Field(max_length=MAX_ALLOCATION_EVENTS)
    size_bytes: list[PositiveBytes] = Field(max_length=MAX_ALLOCATION_EVENTS)
    alloc_index: list[Annotated[int, Strict(), Field(ge=0, lt=MAX_HORIZON)]] = Field(
        max_length=MAX_ALLOCATION_EVENTS
    )
    free_index: list[Annotated[int, Strict(), Field(ge=1, le=MAX_HORIZON)] | None] = Field(
        max_length=MAX_ALLOCATION_EVENTS
    )
    category: list[CategoryName] = Field(max_length=MAX_ALLOCATION_EVENTS)
    block: list[Annotated[int, Strict(), Field(ge=0, lt=MAX_BLOCKS)] | None] = Field(
        max_length=MAX_ALLOCATION_EVENTS
    )
    phase: list[PhaseName] = Field(max_length=MAX_ALLOCATION_EVENTS)

    @model_validator(mode="after")
    def _same_length(self) -> AllocationColumns:
        n = len(self.id)
        for f in EVENT_FIELDS[1:]:
            if len(getattr(self, f)) != n:
                raise ValueError(f"event_columns.{f}: has {len(getattr(self, f))} entries, `id` has {n}")
        return self

    def packed(self) -> EventArrays:
        """The same events as packed arrays, validated (the caller's `AllocationTrace` checks them against
        its horizon)."""
        return EventArrays.from_arrays(
            id=self.id,
            size_bytes=self.size_bytes,
            alloc_index=self.alloc_index,
            free_index=[-1 if f is None else f for f in self.free_index],
            category=EventArrays.codes(self.category, CATEGORIES),
            block=[-1 if b is None else b for b in self.block],
            phase=EventArrays.codes(self.phase, PHASES),
        )


def _first(bad: np.ndarray) -> int | None:
    """The first event where `bad` holds (an array scan; messages are built only on failure)."""
    return int(np.flatnonzero(bad)[0]) if bad.any() else None


def _first_bad(field: str, bad: np.ndarray, values: np.ndarray, why: str) -> None:
    if (i := _first(bad)) is not None:
        raise ValueError(f"events[{i}].{field}: {values[i]} {why}")


class EventArrays(ContractModel):
    """The events of an allocation trace as packed little-endian arrays, one per column (trace schema 2).

    A large iteration has 10^5-10^6 events. As JSON lists they cost the service ~0.7 us per value to validate
    (pydantic builds a Python int per value: ~55 ms for 77k events); packed, they are checked with array
    operations (~1 ms) and cost about the same gzip bytes. `array(name)` gives a column as a read-only numpy
    view.
    """

    model_config = ConfigDict(ser_json_bytes="base64", val_json_bytes="base64")

    count: Int = Field(ge=0, le=MAX_ALLOCATION_EVENTS, description="number of events")
    id: _packed("<i8", "the buffer's id (>= 0, unique)")  # type: ignore[valid-type]
    size_bytes: _packed("<i8", "bytes (> 0, <= 2**53)")  # type: ignore[valid-type]
    alloc_index: _packed("<i4", "logical time of the allocation (>= 0, < horizon)")  # type: ignore[valid-type]
    free_index: _packed(  # type: ignore[valid-type]
        "<i4",
        "logical time of the free (> alloc_index, <= horizon); -1: long-lived (lives across iterations)",
    )
    category: _packed("u1", "0 param, 1 grad, 2 optimizer, 3 activation, 4 temp")  # type: ignore[valid-type]
    block: _packed("<i2", "block active at allocation (< number of blocks); -1: none")  # type: ignore[valid-type]
    phase: _packed("u1", "0 forward, 1 backward, 2 optimizer")  # type: ignore[valid-type]

    def array(self, name: str) -> np.ndarray:
        """Column `name` as a read-only numpy view of the packed bytes (dtype `EVENT_DTYPES[name]`)."""
        return np.frombuffer(getattr(self, name), dtype=EVENT_DTYPES[name])

    @classmethod
    def from_arrays(cls, **columns: Any) -> EventArrays:
        """Pack and validate columns given as arrays or sequences of numbers in the packed form (-1 for None;
        category and phase as positions in `CATEGORIES` and `PHASES`, see `codes`)."""
        if set(columns) != set(EVENT_FIELDS):
            raise ValueError(f"event_arrays: give exactly the columns {', '.join(EVENT_FIELDS)}")
        packed: dict[str, Any] = {}
        for f, dtype in EVENT_DTYPES.items():
            values = np.asarray(columns[f])
            if values.ndim != 1:
                raise ValueError(f"event_arrays.{f}: must be one-dimensional")
            cast = values.astype(dtype)
            if not np.array_equal(cast, values):
                raise ValueError(f"event_arrays.{f}: values do not fit {dtype}")
            packed[f] = cast.tobytes()
        return cls.model_validate({"count": len(np.asarray(columns["id"])), **packed})

    @staticmethod
    def codes(values: Any, members: tuple[StrEnum, ...]) -> np.ndarray:
        """Positions of enum members (or their values) in `members` (`CATEGORIES` or `PHASES`), as uint8."""
        code = {m: i for i, m in enumerate(members)} | {m.value: i for i, m in enumerate(members)}
        try:
            return np.fromiter(map(code.__getitem__, values), dtype=np.uint8)
        except KeyError as exc:
            raise ValueError(f"{exc.args[0]!r} is not one of {', '.join(m.value for m in members)}") from None

    @model_validator(mode="after")
    def _valid(self) -> EventArrays:
        n = self.count
        for f, dtype in EVENT_DTYPES.items():
            got, width = len(getattr(self, f)), np.dtype(dtype).itemsize
            if got != n * width:
                raise ValueError(
                    f"event_arrays.{f}: {got} bytes; {n} events of {dtype} are {n * width} bytes"
                )
        ids = self.array("id")
        _first_bad("id", ids < 0, ids, "is negative")
        if np.unique(ids).size != n:
            first = np.zeros(n, dtype=bool)
            first[np.unique(ids, return_index=True)[1]] = True
            _first_bad("id", ~first, ids, "appears twice")
        size = self.array("size_bytes")
        _first_bad("size_bytes", (size <= 0) | (size > 2**53), size, "is not in 1..2**53")
        if (
            n and float(size.sum(dtype=np.float64)) > 2**53
        ):  # (float: an int64 sum of 2**53-byte events wraps)
            # the planners sum sizes in int64 (offsets, bounds): a total past 2**53 wrapped them into a negative
            # lower bound and a plan failed after its retries with a raw dump (session 19 probe)
            raise ValueError(
                f"event_arrays.size_bytes: the {n} events add up to {float(size.sum(dtype=np.float64)):.4g} bytes, "
                "above 2**53 (no iteration allocates that much)"
            )
        alloc = self.array("alloc_index")
        _first_bad("alloc_index", alloc < 0, alloc, "is negative")
        free = self.array("free_index")
        _first_bad("free_index", (free < 1) & (free != -1), free, "must be -1 (long-lived) or at least 1")
        cat = self.array("category")
        _first_bad("category", cat >= len(CATEGORIES), cat, f"names no category (0..{len(CATEGORIES) - 1})")
        block = self.array("block")
        _first_bad("block", block < -1, block, "must be -1 (none) or a block index")
        phase = self.array("phase")
        _first_bad("phase", phase >= len(PHASES), phase, f"names no phase (0..{len(PHASES) - 1})")
        return self


class AllocationTrace(ContractModel):
    """Every buffer of one steady-state iteration. On the wire the events travel as `event_arrays` (packed);
    `event_columns` (lists, trace schema 1) is still accepted and packed on arrival, and Python callers may
    give `events=[AllocationEvent or dict, ...]`. Read `.columns` (lists), `.events` (objects) or
    `event_arrays.array(name)` (numpy)."""

    source: Literal["cuda_caching_allocator", "dispatch_tracker"]
    horizon: Int = Field(ge=1, le=MAX_HORIZON, description="number of logical time steps in one iteration")
    event_arrays: EventArrays | None = Field(
        default=None, description="the events (always set once validated)"
    )
    event_columns: AllocationColumns | None = Field(
        default=None, exclude=True, description="schema 1 form of the events (lists); packed on arrival"
    )

    @model_validator(mode="before")
    @classmethod
    def _rows_to_columns(cls, data: Any) -> Any:
        if not isinstance(data, dict) or "events" not in data:
            return data
        if "event_columns" in data or "event_arrays" in data:
            raise ValueError("events: give one of `events`, `event_columns` or `event_arrays`")
        data = dict(data)
        rows = data.pop("events")
        if not isinstance(rows, list | tuple):
            raise ValueError("events: must be a list of allocation events")
        if len(rows) > MAX_ALLOCATION_EVENTS:
            raise ValueError(f"events: {len(rows)} events, more than the limit {MAX_ALLOCATION_EVENTS}")
        cols: dict[str, list[Any]] = {f: [] for f in EVENT_FIELDS}
        for i, row in enumerate(rows):
            if not isinstance(row, AllocationEvent):
                try:
                    row = AllocationEvent.model_validate(row)
                except ValidationError as exc:
                    first = exc.errors()[0]
                    where = "".join(f".{p}" for p in first["loc"])
                    raise ValueError(
                        f"events[{i}]{where}: {first['msg'].removeprefix('Value error, ')}"
                    ) from None
            for f in EVENT_FIELDS:
                value = getattr(row, f)
                cols[f].append(value.value if f in ("category", "phase") else value)
        data["event_columns"] = cols
        return data

    @model_validator(mode="after")
    def _pack(self) -> AllocationTrace:
        if self.event_columns is not None:
            if self.event_arrays is not None:
                raise ValueError("event_arrays: give `event_arrays` or `event_columns`, not both")
            self.event_arrays = self.event_columns.packed()
            self.event_columns = None
        elif self.event_arrays is None:
            raise ValueError("event_arrays: required (the events; or `event_columns` in trace schema 1)")
        a = self.arrays
        horizon = self.horizon
        alloc, free = a.array("alloc_index"), a.array("free_index")
        _first_bad("alloc_index", alloc >= horizon, alloc, f"is not below horizon {horizon}")
        if (i := _first((free != -1) & (free <= alloc))) is not None:
            raise ValueError(f"events[{i}].free_index: {free[i]} is not after alloc_index {alloc[i]}")
        _first_bad("free_index", free > horizon, free, f"is beyond horizon {horizon}")
        return self

    @property
    def arrays(self) -> EventArrays:
        """The events, packed (`event_arrays`, which validation always sets)."""
        assert self.event_arrays is not None, "AllocationTrace built without validation"
        return self.event_arrays

    @cached_property
    def columns(self) -> AllocationColumns:
        """The events as Python lists (built once, unvalidated: the arrays were validated)."""
        a = self.arrays
        free = a.array("free_index").tolist()
        block = a.array("block").tolist()
        return AllocationColumns.model_construct(
            id=a.array("id").tolist(),
            size_bytes=a.array("size_bytes").tolist(),
            alloc_index=a.array("alloc_index").tolist(),
            free_index=[None if f < 0 else f for f in free],
            category=[CATEGORIES[c].value for c in a.array("category").tolist()],
            block=[None if b < 0 else b for b in block],
            phase=[PHASES[p].value for p in a.array("phase").tolist()],
        )

    @cached_property
    def events(self) -> list[AllocationEvent]:
        """The events as objects (built once, unvalidated: the arrays were validated)."""
        a = self.arrays
        return [
            AllocationEvent.model_construct(
                id=i,
                size_bytes=s,
                alloc_index=al,
                free_index=None if f < 0 else f,
                category=CATEGORIES[c],
                block=None if b < 0 else b,
                phase=PHASES[ph],
            )
            for i, s, al, f, c, b, ph in zip(*(a.array(name).tolist() for name in EVENT_FIELDS), strict=True)
        ]

    def __len__(self) -> int:
        return self.arrays.count


# ------------------------------------------------------------------------------------------------ trace
class ModelledFrom(ContractModel):
    """Where a modelled trace's numbers come from: an architecture and a hardware catalogue entry, not a run.

    Memory figures come from one training iteration of the model executed on fake tensors (no data); times
    from FLOPs and bytes of each operation over the entry's throughput, scaled by `factors`.
    """

    source: Literal["modelled"] = "modelled"
    hardware_key: Name = Field(description="the catalogue entry the times and bandwidths come from")
    method: Name = Field(description="how the numbers were derived, e.g. 'fake-tensor iteration + roofline'")
    factors: dict[Name, Float] = Field(
        default_factory=dict, description="efficiency factors used (name -> value)"
    )
    calibrated: Bool = Field(
        default=False, description="true when the factors were fitted to measured traces"
    )
    calibration_models: list[Name] = Field(
        default_factory=list,
        max_length=MAX_CALIBRATION_MODELS,
        exclude_if=lambda v: not v,
        description="the models of the measured traces the factors were fitted to (any model: the factors are "
        "the hardware's, per precision)",
    )


class Trace(ContractModel):
    """Everything the planner needs about one job. Every number in it was measured by the agent, unless
    `modelled` is set (a what-if trace: computed from the architecture and a hardware catalogue entry)."""

    schema_version: Literal[1, 2] = Field(
        default=TRACE_SCHEMA_VERSION,
        description="2; a schema 1 trace (events as `event_columns` lists) is read as 2",
    )
    hardware: Hardware
    software: Software
    model: ModelInfo
    workload: Workload
    measurements: Measurements
    allocation_trace: AllocationTrace | None = None
    # Left out of the JSON when absent, so measured traces keep their content hashes.
    modelled: ModelledFrom | None = Field(
        default=None,
        exclude_if=lambda v: v is None,
        description="set on modelled (what-if) traces: the catalogue entry, method and factors used",
    )

    @property
    def source(self) -> Literal["measured", "modelled"]:
        return "measured" if self.modelled is None else "modelled"

    @model_validator(mode="after")
    def _current_schema(self, info: ValidationInfo) -> Trace:
        """Schema 1 differs only in the events' form, packed by now: the trace is read as the current schema.
        Validated with `context={}`, the context's `received_schema_version` says what was given."""
        if isinstance(info.context, dict):
            info.context["received_schema_version"] = self.schema_version
        self.schema_version = TRACE_SCHEMA_VERSION
        return self

    @model_validator(mode="after")
    def _measured_every_block(self) -> Trace:
        n = len(self.model.blocks)
        got = [m.block for m in self.measurements.blocks]
        if got != list(range(n)):
            raise ValueError(
                f"measurements.blocks: must list blocks 0..{n - 1} in order once each, got indices {got[:8]}..."
            )
        for i, b in enumerate(self.measurements.profiled_blocks):
            if b >= n:
                raise ValueError(f"measurements.profiled_blocks[{i}]: {b} names no block")
        if self.allocation_trace is not None:
            blocks = self.allocation_trace.arrays.array("block")
            if (at := _first(blocks >= n)) is not None:
                raise ValueError(f"allocation_trace.events[{at}].block: {blocks[at]} names no block")
        return self

    @property
    def model_state_bytes_per_param_element(self) -> int:
        w = self.workload
        return w.gradient_bytes_per_param + w.optimizer_state_bytes_per_param + w.master_bytes_per_param
