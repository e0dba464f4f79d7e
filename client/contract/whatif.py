"""What-if envelopes of the HTTP API (`POST /v1/whatif`): a model (a Hugging Face config, or a stored measured
trace to retarget) on catalogued hardware, and the answers (the JSON of `memplan whatif --json`)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, Strict, model_validator

from client.contract.common import MAX_MODEL_CONFIG_KEYS, Bool, ContractModel, Float, Int, Name, PositiveBytes
from client.contract.trace import OptimizerKind

MAX_WHATIF_HARDWARE = 16
MAX_CONFIG_KEYS = MAX_MODEL_CONFIG_KEYS


class WhatIfRequest(ContractModel):
    """Exactly one of `config` (a Hugging Face config.json object, `model_type` included) and `trace_id` (a stored
    measured trace, retargeted to each entry: it keeps its own workload, so batch, seq, dtype and optimizer must
    be left out)."""

    config: dict[str, Any] | None = Field(
        default=None,
        max_length=MAX_CONFIG_KEYS,
        description="a Hugging Face config.json object (model_type required)",
    )
    trace_id: Name | None = Field(default=None, description="a stored measured trace to retarget")
    source_hardware: Name | None = Field(
        default=None,
        description="with trace_id: the catalogue key it was measured on (default: matched by device name)",
    )
    hardware: list[Name] = Field(min_length=1, max_length=MAX_WHATIF_HARDWARE, description="catalogue keys")
    batch_size: Int | None = Field(default=None, ge=1, le=1_000_000)
    sequence_length: Int | None = Field(default=None, ge=1, le=1_000_000)
    dtype: Literal["bf16", "fp16", "fp32"] | None = None
    optimizer: OptimizerKind | None = None
    host_memory_bytes: PositiveBytes | None = Field(
        default=None, description="default: the entry's typical host"
    )
    calibrate: Bool = Field(
        default=True,
        description="fit each entry's factors to the project's measured traces taken on the entry's device, "
        "of this model or of any other whose trace records its config (configs only)",
    )

    @model_validator(mode="after")
    def _one_model(self) -> WhatIfRequest:
        if (self.config is None) == (self.trace_id is None):
            raise ValueError("give exactly one of config and trace_id")
        if self.config is not None:
            if self.batch_size is None or self.sequence_length is None:
                raise ValueError("batch_size and sequence_length: required with a config")
        else:
            given = [
                k
                for k in ("batch_size", "sequence_length", "dtype", "optimizer")
                if getattr(self, k) is not None
            ]
            if given:
                raise ValueError(f"{', '.join(given)}: a measured trace keeps its own workload; leave out")
        if self.source_hardware is not None and self.trace_id is None:
            raise ValueError("source_hardware: only with trace_id")
        return self


class WhatIfAnswer(BaseModel):
    """One entry's answer: the keys of `memplan whatif --json`."""

    hardware: str
    batch: int
    seq: int
    dtype: str
    device_memory_bytes: int
    host_memory_bytes: int
    fits: bool
    binding: Literal["device", "host", "device+host"] | None
    min_device_memory_bytes: int | None
    min_host_memory_bytes: int | None
    peak_device_bytes: int | None
    peak_host_bytes: int | None
    iteration_s: float | None
    tokens_per_s: float | None
    unmanaged_peak_device_bytes: int
    solver_status: str
    plan_summary: dict[str, Any] = Field(default_factory=dict)
    source: str
    calibrated: bool
    calibration_traces: int = 0
    calibration_residual: float | None = None
    calibration_models: list[str] = Field(
        default_factory=list, description="the models of the measured traces the factors were fitted to"
    )


class WhatIfResponse(BaseModel):
    answers: list[WhatIfAnswer]


MAX_SWEEP_POINTS = 1024
MAX_SWEEP_VALUES = 64


class SweepRequest(ContractModel):
    """A what-if sweep: every combination of batch size x sequence length x hardware x device limit x host limit,
    each point one plan solved on the workers (results kept as plans)."""

    config: dict[str, Any] = Field(
        max_length=MAX_CONFIG_KEYS, description="a Hugging Face config.json object"
    )
    hardware: list[Name] = Field(min_length=1, max_length=MAX_WHATIF_HARDWARE, description="catalogue keys")
    batch_sizes: list[Annotated[int, Strict(), Field(ge=1, le=1_000_000)]] = Field(
        min_length=1, max_length=MAX_SWEEP_VALUES
    )
    sequence_lengths: list[Annotated[int, Strict(), Field(ge=1, le=1_000_000)]] = Field(
        min_length=1, max_length=MAX_SWEEP_VALUES
    )
    device_memory_bytes: list[PositiveBytes] | None = Field(
        default=None,
        min_length=1,
        max_length=MAX_SWEEP_VALUES,
        description="default: each entry's device memory",
    )
    host_memory_bytes: list[PositiveBytes] | None = Field(
        default=None,
        min_length=1,
        max_length=MAX_SWEEP_VALUES,
        description="default: each entry's typical host",
    )
    dtype: Literal["bf16", "fp16", "fp32"] = "bf16"
    optimizer: OptimizerKind = OptimizerKind.adamw
    time_limit_s: Float = Field(default=2.0, gt=0, le=60, description="solver seconds per point")
    calibrate: Bool = Field(
        default=True,
        description="price each point with the entry's factors fitted to the project's measured traces, as "
        "POST /v1/whatif does (each point says whether it is calibrated and from what)",
    )

    def n_points(self) -> int:
        return (
            len(self.batch_sizes)
            * len(self.sequence_lengths)
            * len(self.hardware)
            * len(self.device_memory_bytes or [0])
            * len(self.host_memory_bytes or [0])
        )

    @model_validator(mode="after")
    def _bounded(self) -> SweepRequest:
        if self.n_points() > MAX_SWEEP_POINTS:
            raise ValueError(f"a sweep of {self.n_points()} points: at most {MAX_SWEEP_POINTS}")
        return self


class SweepPoint(BaseModel):
    batch_size: int
    sequence_length: int
    hardware: str
    device_memory_bytes: int
    host_memory_bytes: int
    trace_id: str
    plan_id: str
    status: str = Field(description="the plan's: queued, running, done, infeasible or failed")
    fits: bool | None = Field(default=None, description="set once solved: the plan fits the limits")
    iteration_s: float | None = None
    tokens_per_s: float | None = None
    peak_device_bytes: int | None = None
    peak_host_bytes: int | None = None
    calibrated: bool = Field(
        default=False,
        description="the point's times use factors fitted to measured traces (as POST /v1/whatif)",
    )
    calibration_traces: int = Field(default=0, description="how many measured traces (0: uncalibrated)")
    calibration_residual: float | None = None
    calibration_models: list[str] = Field(default_factory=list, description="the models of those traces")


class SweepProgress(BaseModel):
    total: int
    finished: int = Field(description="points whose plan is done, infeasible or failed")
    by_status: dict[str, int]


class SweepRecord(BaseModel):
    id: str
    created_at: datetime
    progress: SweepProgress
    points: list[SweepPoint] = Field(description="one page of the points, in request order")
    next_cursor: str | None = None
