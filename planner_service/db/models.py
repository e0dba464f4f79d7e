"""ORM models: hardware, model, trace, plan, feedback. The schema itself is made only by migrations."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Float,
    ForeignKey,
    ForeignKeyConstraint,
    Index,
    Integer,
    LargeBinary,
    String,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.orm import Mapped, mapped_column, relationship

from client.contract import PlanStatus
from planner_service.db.base import Base, UTCDateTime, utcnow


def new_id() -> str:
    return uuid.uuid4().hex


DEFAULT_PROJECT = "default"

REUSABLE_WHERE = "status <> 'failed'"
"""The plans a request reuses (`repositories.REUSABLE_STATUSES`: every status but failed): at most one per
project and request key (migration 0011)."""


class ProjectRow(Base):
    """A tenant: every trace and plan belongs to one; tokens are scoped to one."""

    __tablename__ = "project"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class ApiTokenRow(Base):
    """An API token, stored as a SHA-256 digest (tokens are 256-bit random strings; the clear text is shown once)."""

    __tablename__ = "api_token"

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    project_id: Mapped[str] = mapped_column(ForeignKey("project.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(200))
    prefix: Mapped[str] = mapped_column(String(16), doc="first characters, to recognise a token in listings")
    digest: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)


class HardwareRow(Base):
    """A device kind a project has traces from. Per project: another project's row with the same key is
    another row (the key is what the client sends; nothing of one project shows in another's)."""

    __tablename__ = "hardware"

    project_id: Mapped[str] = mapped_column(ForeignKey("project.id", ondelete="CASCADE"), primary_key=True)
    key: Mapped[str] = mapped_column(String(600), primary_key=True)
    device_type: Mapped[str] = mapped_column(String(16))
    device_name: Mapped[str] = mapped_column(String(512))
    device_memory_bytes: Mapped[int] = mapped_column(BigInteger)
    device_count: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    # the job's process group (issue 20; 1 and 1 for a single-process job); also named by the key
    world_size: Mapped[int] = mapped_column(Integer, default=1, server_default="1")
    ranks_per_node: Mapped[int] = mapped_column(Integer, default=1, server_default="1")


class ModelRow(Base):
    """A model a project has traces of, by the fingerprint its agent computed. Per project, like HardwareRow:
    a fingerprint is the client's word, so two projects naming one fingerprint each keep their own name."""

    __tablename__ = "model"

    project_id: Mapped[str] = mapped_column(ForeignKey("project.id", ondelete="CASCADE"), primary_key=True)
    fingerprint: Mapped[str] = mapped_column(String(512), primary_key=True)
    name: Mapped[str] = mapped_column(String(512))
    architecture: Mapped[str] = mapped_column(String(512))
    parameter_count: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class TraceRow(Base):
    __tablename__ = "trace"

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    project_id: Mapped[str] = mapped_column(ForeignKey("project.id", ondelete="CASCADE"))
    content_hash: Mapped[str] = mapped_column(String(64))
    model_fingerprint: Mapped[str] = mapped_column(String(512))
    hardware_key: Mapped[str] = mapped_column(String(600))
    workload_key: Mapped[str] = mapped_column(String(200))
    schema_version: Mapped[int] = mapped_column(Integer)
    payload_gzip: Mapped[bytes] = mapped_column(
        LargeBinary, doc="gzip of the trace JSON in the current schema (as uploaded, or canonical)"
    )
    payload_bytes: Mapped[int] = mapped_column(BigInteger, doc="uncompressed size")
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)

    model: Mapped[ModelRow] = relationship(viewonly=True)

    __table_args__ = (
        ForeignKeyConstraint(["project_id", "model_fingerprint"], ["model.project_id", "model.fingerprint"]),
        ForeignKeyConstraint(["project_id", "hardware_key"], ["hardware.project_id", "hardware.key"]),
        Index("ix_trace_model_created", "model_fingerprint", "created_at", "id"),
        Index("ix_trace_hardware_created", "hardware_key", "created_at", "id"),
        Index("ix_trace_created", "created_at", "id"),
        UniqueConstraint("project_id", "content_hash", name="uq_trace_project_content"),
    )


class PlanRow(Base):
    __tablename__ = "plan"

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    trace_id: Mapped[str] = mapped_column(ForeignKey("trace.id", ondelete="CASCADE"))
    project_id: Mapped[str] = mapped_column(ForeignKey("project.id", ondelete="CASCADE"), index=True)
    # Denormalised from the trace so history can be browsed by model and hardware without a join.
    model_fingerprint: Mapped[str] = mapped_column(String(512))
    hardware_key: Mapped[str] = mapped_column(String(600))
    workload_key: Mapped[str] = mapped_column(String(200))
    request_key: Mapped[str] = mapped_column(
        String(64), doc="hash of trace, constraints, objective, solver, version"
    )
    solver: Mapped[str] = mapped_column(String(64))
    solver_version: Mapped[str] = mapped_column(String(64))
    status: Mapped[str] = mapped_column(String(16), default=PlanStatus.queued.value)  # a PlanStatus value
    constraints: Mapped[dict[str, Any]] = mapped_column(JSON)
    objective: Mapped[str] = mapped_column(String(64))
    # Deferred: a Plan with an allocation is megabytes; lists read `headline`, a GET splices the stored text.
    result: Mapped[dict[str, Any] | None] = mapped_column(
        JSON, nullable=True, deferred=True, doc="the Plan, JSON"
    )
    headline: Mapped[dict[str, Any] | None] = mapped_column(
        JSON, nullable=True, doc="the Plan's predictions (no timeline) and solver report: what lists show"
    )
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    revision: Mapped[int] = mapped_column(
        Integer,
        default=0,
        server_default="0",
        doc="changes of the stored Plan after it finished (the managed allocation, migration 0008)",
    )
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)

    trace: Mapped[TraceRow] = relationship()
    model: Mapped[ModelRow] = relationship(
        primaryjoin="and_(foreign(PlanRow.project_id) == ModelRow.project_id, "
        "foreign(PlanRow.model_fingerprint) == ModelRow.fingerprint)",
        viewonly=True,
    )
    feedback: Mapped[list[FeedbackRow]] = relationship(
        back_populates="plan", order_by="FeedbackRow.created_at"
    )

    __table_args__ = (
        Index("ix_plan_status_created", "status", "created_at"),
        Index("ix_plan_request_key", "request_key"),
        # one plan per request that did not fail: identical requests at once make one plan (migration 0011)
        Index(
            "uq_plan_request",
            "project_id",
            "request_key",
            unique=True,
            sqlite_where=text(REUSABLE_WHERE),
            postgresql_where=text(REUSABLE_WHERE),
        ),
        Index("ix_plan_model_created", "model_fingerprint", "created_at", "id"),
        Index("ix_plan_hardware_created", "hardware_key", "created_at", "id"),
        Index("ix_plan_created", "created_at", "id"),
    )


class FeedbackRow(Base):
    __tablename__ = "feedback"

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    plan_id: Mapped[str] = mapped_column(ForeignKey("plan.id", ondelete="CASCADE"), index=True)
    iteration_s: Mapped[float] = mapped_column(Float)
    peak_device_bytes: Mapped[int] = mapped_column(BigInteger)
    peak_host_bytes: Mapped[int] = mapped_column(BigInteger)
    steps_measured: Mapped[int] = mapped_column(Integer)
    notes: Mapped[str] = mapped_column(Text, default="")
    iteration_error: Mapped[float | None] = mapped_column(Float, nullable=True)
    peak_device_error: Mapped[float | None] = mapped_column(Float, nullable=True)
    phases: Mapped[dict[str, Any] | None] = mapped_column(
        JSON,
        nullable=True,
        doc="the feedback's MeasuredPhases, JSON (None: an agent before phases were measured)",
    )
    phase_errors: Mapped[dict[str, float] | None] = mapped_column(
        JSON, nullable=True, doc="measured / predicted - 1 per phase and of the uploads (FeedbackRecord)"
    )
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)

    plan: Mapped[PlanRow] = relationship(back_populates="feedback")


class SweepRow(Base):
    """A what-if sweep (planner_service/whatif/sweep.py): one request fanned out into one plan per point.

    `points` lists every point in order: its batch, sequence length, catalogue key, device and host limits, and
    the stored modelled trace and plan that answer it; progress and results are read from the plans."""

    __tablename__ = "sweep"

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    project_id: Mapped[str] = mapped_column(
        String(64), ForeignKey("project.id", ondelete="CASCADE"), index=True
    )
    request: Mapped[dict[str, Any]] = mapped_column(JSON, doc="the SweepRequest, JSON")
    points: Mapped[list[dict[str, Any]]] = mapped_column(JSON)
    n_points: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
