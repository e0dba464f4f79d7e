"""Request and response envelopes of the HTTP API (`/v1`)."""

from __future__ import annotations

from datetime import datetime
from typing import Generic, Literal, TypeVar

from pydantic import BaseModel, Field

from client.contract.common import ContractModel, Name
from client.contract.feedback import Feedback
from client.contract.plan import Constraints, Objective, Plan, PlanStatus, Predictions, SolverReport
from client.contract.trace import Trace

T = TypeVar("T")


class Page(BaseModel, Generic[T]):
    items: list[T]
    next_cursor: str | None = None


class TraceCreated(BaseModel):
    id: str
    content_hash: str
    created: bool = Field(description="false when identical content was already stored")


class TraceSummary(BaseModel):
    id: str
    content_hash: str
    model_name: str
    model_fingerprint: str
    hardware_key: str
    workload_key: str
    created_at: datetime


class TraceRecord(TraceSummary):
    trace: Trace


class PlanRequest(ContractModel):
    trace_id: Name
    constraints: Constraints
    objective: Objective = Objective.min_iteration_time
    solver: Literal["cpsat", "protrain"] = Field(default="cpsat", description="policy solver")


class FeedbackRecord(BaseModel):
    id: str
    plan_id: str
    feedback: Feedback
    iteration_error: float | None = Field(description="measured / predicted - 1 for iteration seconds")
    peak_device_error: float | None = Field(description="measured / predicted - 1 for peak device bytes")
    phase_errors: dict[str, float] | None = Field(
        default=None,
        description="measured / predicted - 1 per phase (`forward_s`, `backward_s`, `step_s`, as "
        "`Predictions.phases` predicts them) and of `uploads_per_iteration`; None: the feedback has no phases "
        "(an older agent) or the plan no predictions; a phase predicted 0 is left out",
    )
    created_at: datetime


class PlanHeadline(BaseModel):
    """What a list shows of a finished plan: its predictions (without the memory timeline and the cost
    breakdown) and the solver's report. A whole Plan with an allocation is megabytes; this is a few hundred
    bytes."""

    predictions: Predictions | None = None
    solver: SolverReport | None = None


class PlanRecord(BaseModel):
    id: str
    trace_id: str
    status: PlanStatus
    reused: bool = Field(
        default=False, description="true when an identical earlier request's plan was returned"
    )
    solver: str
    constraints: Constraints
    objective: Objective
    model_name: str
    model_fingerprint: str
    hardware_key: str
    workload_key: str
    plan: Plan | None = Field(
        default=None, description="the whole plan (in lists only with `with_plan=true`)"
    )
    headline: PlanHeadline | None = Field(
        default=None, description="predictions and solver report, once solved"
    )
    error: str | None = None
    attempts: int = 0
    created_at: datetime
    started_at: datetime | None = None
    finished_at: datetime | None = None
    feedback: list[FeedbackRecord] = Field(default_factory=list)
    iteration_error: float | None = Field(
        default=None,
        description="the latest feedback's measured / predicted - 1 of the iteration time (None: no feedback)",
    )
    peak_device_error: float | None = Field(default=None, description="the same of the peak device memory")


class ModelSummary(BaseModel):
    fingerprint: str
    name: str
    architecture: str
    parameter_count: int
    traces: int
    plans: int


class HardwareSummary(BaseModel):
    key: str
    device_type: str
    device_name: str
    device_memory_bytes: int
    device_count: int
    traces: int
    plans: int
    world_size: int = Field(default=1, description="ranks of the job's process group (1: one process)")
    ranks_per_node: int = Field(default=1, description="ranks sharing one node's host RAM")


class FieldError(BaseModel):
    field: str = Field(description="path of the offending field, e.g. 'body.model.blocks[3].index'")
    message: str
    type: str


class ErrorBody(BaseModel):
    error: str = Field(description="what went wrong, in one sentence")
    detail: list[FieldError] | None = Field(
        default=None, description="per-field problems (validation errors)"
    )
