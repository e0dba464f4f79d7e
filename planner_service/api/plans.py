"""/v1/plans: request (queued for a worker, identical requests reuse), fetch with long-poll, list, feedback."""

from __future__ import annotations

import asyncio
import time
from typing import Annotated, Any

from fastapi import APIRouter, Query, Response
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from client.contract import Feedback, FeedbackRecord, Page, PlanRecord, PlanRequest
from planner_service.api.deps import DatabaseDep, PrincipalDep, SessionDep, SettingsDep
from planner_service.api.errors import ERROR_RESPONSES, ApiError
from planner_service.api.present import feedback_record, plan_record, plan_record_json
from planner_service.db.cursor import BadCursor
from planner_service.db.repositories import (
    FINAL_STATUSES,
    FeedbackRepository,
    PlanRepository,
    TraceRepository,
    request_key,
)
from planner_service.db.session import Database

router = APIRouter(prefix="/v1/plans", tags=["plans"], responses=ERROR_RESPONSES)


def _solver_version() -> str:
    from planner_service.solver import SOLVER_VERSION

    return SOLVER_VERSION


@router.post("", status_code=202, response_model=PlanRecord,
             responses={200: {"model": PlanRecord, "description": "an identical earlier request's plan, reused"}})
def request_plan(body: PlanRequest, response: Response, session: SessionDep, principal: PrincipalDep) -> PlanRecord:
    trace = TraceRepository(session).get(body.trace_id, principal.project_id)
    if trace is None:
        raise ApiError(404, f"trace_id: trace {body.trace_id} not found")
    repo = PlanRepository(session)
    version = _solver_version()
    existing = repo.reusable(principal.project_id, request_key(trace.content_hash, body.constraints, body.objective, body.solver, version))
    if existing is not None:
        response.status_code = 200
        return plan_record(existing, reused=True)
    row = repo.create(trace, body.constraints, body.objective, body.solver, version)
    return plan_record(row, with_feedback=False)


def _load(db: Database, plan_id: str, project_id: str) -> dict[str, Any] | None:
    with db.session() as s:
        row = PlanRepository(s).get(plan_id, project_id)
        return None if row is None else plan_record_json(row)


@router.get("/{plan_id}", response_model=PlanRecord)
async def get_plan(plan_id: str, db: DatabaseDep, settings: SettingsDep, principal: PrincipalDep,
                   wait: Annotated[float, Query(ge=0, description="long-poll up to this many seconds")] = 0.0,
                   ) -> JSONResponse:
    deadline = time.monotonic() + min(wait, settings.max_wait_s)
    while True:
        record = await run_in_threadpool(_load, db, plan_id, principal.project_id)
        if record is None:
            raise ApiError(404, f"plan {plan_id} not found")
        if record["status"] in FINAL_STATUSES or time.monotonic() >= deadline:
            return JSONResponse(record)
        await asyncio.sleep(min(0.1, max(0.0, deadline - time.monotonic())))


@router.get("", response_model=Page[PlanRecord])
def list_plans(session: SessionDep, settings: SettingsDep, principal: PrincipalDep,
               model: Annotated[str | None, Query(description="model fingerprint or name")] = None,
               hardware: Annotated[str | None, Query(description="hardware key")] = None,
               status: Annotated[str | None, Query(pattern="^(queued|running|done|failed|infeasible)$")] = None,
               sort: Annotated[str, Query(pattern="^-?created_at$")] = "-created_at",
               limit: Annotated[int, Query(ge=1, le=1000)] = 50,
               cursor: str | None = None) -> JSONResponse:
    try:
        page = PlanRepository(session).list(project_id=principal.project_id, model=model, hardware=hardware, status=status,
                                            limit=min(limit, settings.list_limit_max), cursor=cursor,
                                            descending=sort.startswith("-"))
    except BadCursor as exc:
        raise ApiError(400, str(exc)) from exc
    return JSONResponse({"items": [plan_record_json(r, with_feedback=False) for r in page.items],
                         "next_cursor": page.next_cursor})


@router.post("/{plan_id}/feedback", status_code=201, response_model=FeedbackRecord)
def post_feedback(plan_id: str, body: Feedback, session: SessionDep, principal: PrincipalDep) -> FeedbackRecord:
    plan = PlanRepository(session).get(plan_id, principal.project_id)
    if plan is None:
        raise ApiError(404, f"plan {plan_id} not found")
    if plan.status != "done":
        raise ApiError(409, f"plan {plan_id} is {plan.status}: feedback is for plans that were applied (done)")
    return feedback_record(FeedbackRepository(session).add(plan, body))
