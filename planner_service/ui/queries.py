"""What each history page reads (plans, plan, catalog), through the repositories: one function per page.

Tenancy: each takes the caller's project (`Principal.project_id`) and passes it to the repositories,
so a page never shows another project's plans, models or hardware; the router only calls these.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from pydantic import ValidationError
from sqlalchemy.orm import Session

from client.contract import PlanRecord, PlanStatus, Predictions, SolverReport, Trace
from planner_service.api.present import MeasuredErrors, plan_record
from planner_service.db.models import HardwareRow, ModelRow
from planner_service.db.repositories import (
    CatalogRepository,
    FeedbackRepository,
    PlanRepository,
    read_stored_trace,
)

PLAN_STATUSES: tuple[PlanStatus, ...] = tuple(PlanStatus)
MAX_COMPARED = 8


@dataclass(frozen=True)
class PlanFilters:
    """The list page's query: already checked by the router."""

    model: str | None = None
    hardware: str | None = None
    status: str | None = None
    search: str | None = None
    sort: str = "-created_at"  # a repositories.PLAN_SORT_KEYS key, "-" first for descending
    world_size: int | None = None  # ranks of the job (issue 20); None: any
    limit: int = 25
    cursor: str | None = None

    @property
    def sort_key(self) -> str:
        return self.sort.lstrip("-")

    @property
    def descending(self) -> bool:
        return self.sort.startswith("-")


@dataclass(frozen=True)
class PlanListItem:
    """One row of the plans table (read from the stored JSON without parsing the whole plan)."""

    id: str
    status: str
    model_name: str
    model_fingerprint: str
    hardware_key: str
    workload_key: str
    solver: str
    device_limit_bytes: int
    created_at: datetime
    predictions: Predictions | None
    report: SolverReport | None
    feedback_count: int
    iteration_error: float | None  # the latest feedback's measured / predicted - 1
    peak_device_error: float | None


@dataclass(frozen=True)
class PlanListPage:
    items: list[PlanListItem]
    next_cursor: str | None
    models: list[tuple[str, str]]  # (fingerprint, label) for the filter
    hardware: list[str]
    world_sizes: list[int] = field(default_factory=list)  # of the project's jobs with plans, for the filter


@dataclass(frozen=True)
class Catalog:
    """What the project's history holds, by model and by hardware, with trace and plan counts."""

    models: list[tuple[ModelRow, int, int]]
    hardware: list[tuple[HardwareRow, int, int]]


@dataclass(frozen=True)
class StoredTrace:
    """A plan's trace as stored (gzip of the canonical JSON); parsed only when a chart needs it."""

    content_hash: str
    payload_gzip: bytes

    def parse(self) -> Trace:
        return read_stored_trace(self.payload_gzip)


@dataclass(frozen=True)
class PlanDetail:
    record: PlanRecord
    trace: StoredTrace


def _part(result: dict[str, Any] | None, key: str, model: type[Any]) -> Any:
    """One validated sub-object of a stored plan, or None when absent (or from an older schema)."""
    if not result or result.get(key) is None:
        return None
    try:
        return model.model_validate(result[key])
    except ValidationError:
        return None


def load_plan_list(session: Session, project_id: str, filters: PlanFilters) -> PlanListPage:
    """A page of the project's plans (newest first unless asked), the filter choices, feedback counts."""
    page = PlanRepository(session).list(
        project_id=project_id,
        model=filters.model,
        hardware=filters.hardware,
        status=filters.status,
        limit=filters.limit,
        cursor=filters.cursor,
        descending=filters.descending,
        sort_key=filters.sort_key,
        search=filters.search,
        world_size=filters.world_size,
    )
    counts = FeedbackRepository(session).counts([r.plan.id for r in page.items])
    items = [
        PlanListItem(
            id=r.id,
            status=r.status,
            model_name=r.model.name if r.model else r.model_fingerprint,
            model_fingerprint=r.model_fingerprint,
            hardware_key=r.hardware_key,
            workload_key=r.workload_key,
            solver=r.solver,
            device_limit_bytes=int(r.constraints.get("device_memory_bytes", 0)),
            created_at=r.created_at,
            predictions=_part(r.headline, "predictions", Predictions),
            report=_part(r.headline, "solver", SolverReport),
            feedback_count=counts.get(r.id, 0),
            iteration_error=found.iteration_error,
            peak_device_error=found.peak_device_error,
        )
        for found in page.items
        for r in (found.plan,)
    ]
    catalog = CatalogRepository(session)
    models = [
        (m.fingerprint, f"{m.name} ({m.fingerprint[:8]})")
        for m, _, plans in catalog.models(project_id)
        if plans
    ]
    with_plans = [h for h, _, plans in catalog.hardware(project_id) if plans]
    hardware = [h.key for h in with_plans]
    world_sizes = sorted({h.world_size for h in with_plans})
    return PlanListPage(
        items=items, next_cursor=page.next_cursor, models=models, hardware=hardware, world_sizes=world_sizes
    )


def load_plan_detail(session: Session, project_id: str, plan_id: str) -> PlanDetail | None:
    """The plan with its feedback and its stored trace (for the fallback charts); None if not the project's."""
    row = PlanRepository(session).get(plan_id, project_id)
    if row is None:
        return None
    return PlanDetail(
        record=plan_record(row), trace=StoredTrace(row.trace.content_hash, row.trace.payload_gzip)
    )


def load_compared(
    session: Session, project_id: str, plan_ids: list[str]
) -> tuple[list[PlanRecord], list[str]]:
    """The records (with their plans and feedback) of the project's plans `plan_ids`, in that order, and the ids
    that name none of its plans."""
    repo = PlanRepository(session)
    found: list[PlanRecord] = []
    missing: list[str] = []
    for plan_id in plan_ids:
        row = repo.get(plan_id, project_id)
        if row is None:
            missing.append(plan_id)
        else:
            latest = row.feedback[-1] if row.feedback else None
            measured = MeasuredErrors(latest.iteration_error, latest.peak_device_error) if latest else None
            found.append(plan_record(row, measured=measured))
    return found, missing


def load_catalog(session: Session, project_id: str) -> Catalog:
    catalog = CatalogRepository(session)
    return Catalog(models=catalog.models(project_id), hardware=catalog.hardware(project_id))
