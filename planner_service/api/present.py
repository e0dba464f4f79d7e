"""ORM rows -> wire envelopes (client.contract.api)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from client.contract import (
    Feedback,
    FeedbackRecord,
    MeasuredPhases,
    Plan,
    PlanHeadline,
    PlanRecord,
    TraceSummary,
)
from planner_service.db.models import FeedbackRow, PlanRow, TraceRow


@dataclass(frozen=True)
class MeasuredErrors:
    """A plan's latest feedback's relative errors (measured / predicted - 1; None: not measured)."""

    iteration_error: float | None
    peak_device_error: float | None


def trace_summary(row: TraceRow) -> TraceSummary:
    return TraceSummary(
        id=row.id,
        content_hash=row.content_hash,
        model_name=row.model.name,
        model_fingerprint=row.model_fingerprint,
        hardware_key=row.hardware_key,
        workload_key=row.workload_key,
        created_at=row.created_at,
    )


def feedback_record(row: FeedbackRow) -> FeedbackRecord:
    return FeedbackRecord(
        id=row.id,
        plan_id=row.plan_id,
        feedback=Feedback(
            iteration_s=row.iteration_s,
            peak_device_bytes=row.peak_device_bytes,
            peak_host_bytes=row.peak_host_bytes,
            steps_measured=row.steps_measured,
            notes=row.notes,
            phases=MeasuredPhases.model_validate(row.phases) if row.phases else None,
        ),
        iteration_error=row.iteration_error,
        peak_device_error=row.peak_device_error,
        phase_errors=row.phase_errors,
        created_at=row.created_at,
    )


def plan_record_json(
    row: PlanRow,
    *,
    with_feedback: bool = True,
    with_plan: bool = True,
    measured: MeasuredErrors | None = None,
) -> dict[str, Any]:
    """The PlanRecord as JSON-ready data, with the stored plan (`with_plan`) passed through unparsed (it was
    validated before it was stored): a plan with 10^5 buffer offsets costs a copy, not a re-validation.
    `measured`: the latest feedback's errors, as a list query read them (else from the feedback loaded)."""
    out = plan_record(row, with_feedback=with_feedback, with_plan=False, measured=measured).model_dump(
        mode="json"
    )
    out["plan"] = row.result if with_plan else None
    return out


def plan_record_body(row: PlanRow, raw_plan: str | None) -> bytes:
    """The PlanRecord's JSON bytes with the stored Plan text spliced in as it is (validated before it was
    stored): serving a plan costs a copy of its text, not a parse and a re-encoding."""
    head = plan_record(row, with_plan=False).model_dump_json(exclude={"plan"}).encode()
    return head[:-1] + b',"plan":' + (raw_plan.encode() if raw_plan is not None else b"null") + b"}"


def plan_record(
    row: PlanRow,
    *,
    reused: bool = False,
    with_feedback: bool = True,
    with_plan: bool = True,
    measured: MeasuredErrors | None = None,
) -> PlanRecord:
    if measured is None and with_feedback and row.feedback:
        latest = row.feedback[-1]
        measured = MeasuredErrors(latest.iteration_error, latest.peak_device_error)
    return PlanRecord(
        id=row.id,
        trace_id=row.trace_id,
        status=row.status,
        reused=reused,
        solver=row.solver,
        constraints=row.constraints,
        objective=row.objective,
        model_name=row.model.name if row.model else row.model_fingerprint,
        model_fingerprint=row.model_fingerprint,
        hardware_key=row.hardware_key,
        workload_key=row.workload_key,
        plan=Plan.model_validate(row.result) if with_plan and row.result else None,
        headline=PlanHeadline.model_validate(row.headline) if row.headline else None,
        error=row.error,
        attempts=row.attempts,
        created_at=row.created_at,
        started_at=row.started_at,
        finished_at=row.finished_at,
        feedback=[feedback_record(f) for f in row.feedback] if with_feedback else [],
        iteration_error=measured.iteration_error if measured else None,
        peak_device_error=measured.peak_device_error if measured else None,
    )
