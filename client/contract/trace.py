"""Trace: what the agent measured about one training job (hardware, model, workload, per-block costs)."""

from __future__ import annotations

from enum import StrEnum
from functools import cached_property
from itertools import compress
from operator import le
from typing import Annotated, Any, Literal

from pydantic import Field, Strict, ValidationError, model_validator

from client.contract.common import (
    MAX_ALLOCATION_EVENTS,
    MAX_BANDWIDTH_SAMPLES,
    MAX_BLOCKS,
    MAX_PARAMETERS,
    SCHEMA_VERSION,
    Bool,
    Bytes,
    BytesPerSecond,
    ContractModel,
    Count,
    Int,
    Name,
    PositiveBytes,
    Seconds,
)


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
_CATEGORY = {c.value: c for c in AllocationCategory}
_PHASE = {p.value: p for p in Phase}


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

    @model_validator(mode="after")
    def _sorted_unique(self) -> BandwidthCurves:
        for name in ("h2d_pinned", "d2h_pinned", "h2d_pageable", "d2h_pageable"):
            sizes = [s.size_bytes for s in getattr(self, name)]
            if sizes != sorted(set(sizes)):
                raise ValueError(f"{name}: samples must be sorted by size_bytes with no repeated size")
        return self


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

    @property
    def key(self) -> str:
        """Stable identity used to group traces and plans by hardware."""
        gib = self.device_memory_bytes // 2**30
        return f"{self.device_type.value}:{self.device_name}:{gib}GiB:x{self.device_count}"


class Software(ContractModel):
    torch_version: Name
    cuda_version: str | None = Field(default=None, max_length=64)
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


class ModelInfo(ContractModel):
    name: Name = Field(description="human name, e.g. 'llama-12L-1024H'")
    architecture: Name = Field(description="model class, e.g. 'LlamaForCausalLM'")
    fingerprint: Name = Field(description="hash of the architecture: classes, parameter names and shapes")
    parameter_count: Count
    dtype: Name
    blocks: list[BlockInfo] = Field(min_length=1, max_length=MAX_BLOCKS)
    parameters: list[ParameterInfo] = Field(max_length=MAX_PARAMETERS)

    @model_validator(mode="after")
    def _consistent(self) -> ModelInfo:
        for i, b in enumerate(self.blocks):
            if b.index != i:
                raise ValueError(f"blocks[{i}].index: is {b.index}, must equal its position {i}")
        per_block = [0] * len(self.blocks)
        seen: set[str] = set()
        for i, p in enumerate(self.parameters):
            if p.block >= len(self.blocks):
                raise ValueError(f"parameters[{i}].block: {p.block} names no block (there are {len(self.blocks)})")
            if p.name in seen:
                raise ValueError(f"parameters[{i}].name: {p.name!r} appears twice")
            seen.add(p.name)
            per_block[p.block] += p.bytes
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
        default=0, ge=0, le=16, description="extra fp32 master copy per parameter in mixed precision (4), else 0"
    )
    gradient_bytes_per_param: Int = Field(ge=1, le=16, description="bytes of one gradient element")

    @property
    def key(self) -> str:
        return f"b{self.batch_size}:s{self.sequence_length}:{self.precision.value}:{self.optimizer.value}"


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
        default=0.0, description="extra forward time when this block's saved tensors are swapped out to the host "
        "(runtime swap store: host buffers, copies, hooks)")
    swap_in_s: Seconds = Field(
        default=0.0, description="extra backward time to bring this block's swapped tensors back (prefetch, "
        "unpack, release)")
    offload_overhead_s: Seconds = Field(
        default=0.0, description="extra time of one iteration when this block's parameters are in an offloaded "
        "chunk of the chunk runtime (residency hooks, gradient gather, bind/release, host step), beyond the "
        "copies of their bytes (charged by bandwidth), the host step (charged by throughput) and the uploads")
    upload_overhead_s: Seconds = Field(
        default=0.0, description="extra time of each upload of this block's parameters into a device buffer "
        "(release, buffer choice, bind), beyond the copy of their bytes (charged by bandwidth)")


class OptimizerMeasurement(ContractModel):
    device_bytes_per_s: BytesPerSecond = Field(description="real optimizer step on the device, parameter bytes/s")
    host_bytes_per_s: BytesPerSecond = Field(description="fused/foreach optimizer on the host, parameter bytes/s")


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


class AllocationColumns(ContractModel):
    """The events of an allocation trace as columns (struct of arrays): event i is the i-th of every list.

    The wire form is columnar because a large iteration has 10^5 events: as columns they validate about
    15x faster and take a third of the bytes of one JSON object per event. `category` and `phase` hold plain
    strings (the enums' values; `AllocationTrace.events` gives enum members).
    """

    id: list[Annotated[int, Strict(), Field(ge=0)]] = Field(max_length=MAX_ALLOCATION_EVENTS)
    size_bytes: list[PositiveBytes] = Field(max_length=MAX_ALLOCATION_EVENTS)
    alloc_index: list[Annotated[int, Strict(), Field(ge=0)]] = Field(max_length=MAX_ALLOCATION_EVENTS)
    free_index: list[Annotated[int, Strict(), Field(ge=1)] | None] = Field(max_length=MAX_ALLOCATION_EVENTS)
    category: list[CategoryName] = Field(max_length=MAX_ALLOCATION_EVENTS)
    block: list[Annotated[int, Strict(), Field(ge=0)] | None] = Field(max_length=MAX_ALLOCATION_EVENTS)
    phase: list[PhaseName] = Field(max_length=MAX_ALLOCATION_EVENTS)


class AllocationTrace(ContractModel):
    """Every buffer of one steady-state iteration. Build it with `events=[AllocationEvent, ...]` (or dicts);
    read `.events`. On the wire the events travel as `event_columns` (see `AllocationColumns`)."""

    source: Literal["cuda_caching_allocator", "dispatch_tracker"]
    horizon: Int = Field(ge=1, description="number of logical time steps in one iteration")
    event_columns: AllocationColumns

    @model_validator(mode="before")
    @classmethod
    def _rows_to_columns(cls, data: Any) -> Any:
        if not isinstance(data, dict) or "events" not in data:
            return data
        if "event_columns" in data:
            raise ValueError("events: give `events` or `event_columns`, not both")
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
                    raise ValueError(f"events[{i}]{where}: {first['msg'].removeprefix('Value error, ')}") from None
            for f in EVENT_FIELDS:
                cols[f].append(getattr(row, f))
        data["event_columns"] = cols
        return data

    @model_validator(mode="after")
    def _consistent(self) -> AllocationTrace:
        c = self.event_columns
        n = len(c.id)
        for f in EVENT_FIELDS[1:]:
            if len(getattr(c, f)) != n:
                raise ValueError(f"event_columns.{f}: has {len(getattr(c, f))} entries, `id` has {n}")
        if len(set(c.id)) != n:
            seen: set[int] = set()
            for i, event_id in enumerate(c.id):
                if event_id in seen:
                    raise ValueError(f"events[{i}].id: {event_id} appears twice")
                seen.add(event_id)
        # Checked with C-level iteration (an upload of 10^5 events validates on the request path); only a
        # failing trace walks the rows in Python, to name the first bad one.
        horizon = self.horizon
        freed = [f is not None for f in c.free_index]
        free = list(compress(c.free_index, freed))
        if n and (max(c.alloc_index) >= horizon or (free and max(free) > horizon)
                  or any(map(le, free, compress(c.alloc_index, freed)))):
            for i, (a, f) in enumerate(zip(c.alloc_index, c.free_index, strict=True)):
                if a >= horizon:
                    raise ValueError(f"events[{i}].alloc_index: {a} is not below horizon {horizon}")
                if f is not None and (f <= a or f > horizon):
                    why = f"is not after alloc_index {a}" if f <= a else f"is beyond horizon {horizon}"
                    raise ValueError(f"events[{i}].free_index: {f} {why}")
        return self

    @cached_property
    def events(self) -> list[AllocationEvent]:
        """The events as objects (built once, unvalidated: the columns were validated)."""
        c = self.event_columns
        return [AllocationEvent.model_construct(id=i, size_bytes=s, alloc_index=a, free_index=f,
                                                category=_CATEGORY[cat], block=b, phase=_PHASE[ph])
                for i, s, a, f, cat, b, ph in zip(c.id, c.size_bytes, c.alloc_index, c.free_index, c.category,
                                                  c.block, c.phase, strict=True)]

    def __len__(self) -> int:
        return len(self.event_columns.id)


# ------------------------------------------------------------------------------------------------ trace
class Trace(ContractModel):
    """Everything the planner needs about one job. Every number in it was measured by the agent."""

    schema_version: Literal[1] = SCHEMA_VERSION
    hardware: Hardware
    software: Software
    model: ModelInfo
    workload: Workload
    measurements: Measurements
    allocation_trace: AllocationTrace | None = None

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
            blocks = self.allocation_trace.event_columns.block
            if max(filter(None, blocks), default=0) >= n:  # C-level scan; the loop only names the row
                for i, b in enumerate(blocks):
                    if b is not None and b >= n:
                        raise ValueError(f"allocation_trace.events[{i}].block: {b} names no block")
        return self

    @property
    def model_state_bytes_per_param_element(self) -> int:
        w = self.workload
        return w.gradient_bytes_per_param + w.optimizer_state_bytes_per_param + w.master_bytes_per_param
