"""/v1/plans: request (queued for a worker, identical requests reuse), fetch with long-poll, list, feedback, and
the managed iteration's allocation (`PUT /{id}/allocation`)."""

from __future__ import annotations

import asyncio
import time
from typing import Annotated

from fastapi import APIRouter, Header, Query, Request, Response
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from client.contract import (
    FINAL_PLAN_STATUSES,
    AllocationTrace,
    Feedback,
    FeedbackRecord,
    Page,
    PlanRecord,
    PlanRequest,
    PlanStatus,
)
from planner_service.api import links
from planner_service.api.deps import PrincipalDep, SessionDep, SettingsDep
from planner_service.api.errors import ERROR_RESPONSES, ApiError
from planner_service.api.params import (
    HardwareFilter,
    ModelFilter,
    PlanId,
    PlanSort,
    RanksPerNodeFilter,
    SearchFilter,
    WorldSizeFilter,
)
from planner_service.api.poll_shortcut import etag_matches
from planner_service.api.present import (
    MeasuredErrors,
    feedback_record,
    plan_record,
    plan_record_body,
    plan_record_json,
)
from planner_service.db.change_feed import ChangeFeed
from planner_service.db.keyset_cursor import BadCursor
from planner_service.db.repositories import PlanRepository, plan_etag, plan_version
from planner_service.db.session import Database
from planner_service.observability import POLL_ANSWERS
from planner_service.plans import service as plans
from planner_service.settings import Settings

router = APIRouter(prefix="/v1/plans", tags=["plans"], responses=ERROR_RESPONSES)


@router.post(
    "",
    status_code=202,
    response_model=PlanRecord,
    responses={
        202: {"links": links.PLAN_RECORD},
        200: {
            "model": PlanRecord,
            "description": "an identical earlier request's plan, reused",
            "links": links.PLAN_RECORD,
        },
    },
)
def request_plan(
    body: PlanRequest, request: Request, response: Response, session: SessionDep, principal: PrincipalDep
) -> PlanRecord:
    try:
        found = plans.request_plan(session, principal.project_id, body, request.app.state.solve_queue.enqueue)
    except plans.TraceNotFound as exc:
        raise ApiError(404, str(exc)) from exc
    if found.reused:
        response.status_code = 200
        return plan_record(found.plan, reused=True)
    return plan_record(found.plan, with_feedback=False)


def _version(db: Database, plan_id: str, project_id: str) -> str | None:
    with db.reader() as conn:
        return plan_version(conn, plan_id, project_id)


def _load(db: Database, plan_id: str, project_id: str) -> tuple[str, str, bytes] | None:
    """(status, etag, body) of the plan record, from one consistent read."""
    with db.session() as s:
        found = PlanRepository(s).get_raw(plan_id, project_id)
        if found is None:
            return None
        row, raw = found
        etag = plan_etag(
            row.id, row.status, row.attempts, row.started_at, row.finished_at, len(row.feedback), row.revision
        )
        return row.status, etag, plan_record_body(row, raw)


async def _current_tag(db: Database, feed: ChangeFeed | None, plan_id: str, project_id: str) -> str | None:
    """The plan's entity tag: from memory when the plan-change listener vouches for it, else one narrow query."""
    generation = 0
    if feed is not None:
        tag = feed.tag(plan_id, project_id)
        if tag is not None:
            POLL_ANSWERS.labels("memory").inc()
            return tag
        generation = feed.generation
    POLL_ANSWERS.labels("database").inc()
    tag = await run_in_threadpool(_version, db, plan_id, project_id)
    if feed is not None and tag is not None:
        feed.remember(plan_id, project_id, tag, generation)
    return tag


async def _until_changed(feed: ChangeFeed | None, plan_id: str, seconds: float) -> None:
    """Wait for the plan to (maybe) change: its notification, or a short sleep where there is no listener."""
    if feed is not None and feed.listening:
        await feed.changed(plan_id, min(seconds, 5.0))  # and re-read now and then regardless
    else:
        await asyncio.sleep(min(0.1, seconds))


@router.get(
    "/{plan_id}",
    response_model=PlanRecord,
    responses={
        200: {"links": links.PLAN_RECORD},
        304: {"description": "not modified: the plan still has the entity tag sent in If-None-Match"},
    },
)
async def get_plan(
    plan_id: PlanId,
    request: Request,
    principal: PrincipalDep,
    wait: Annotated[
        float,
        Query(
            ge=0,
            description="long-poll up to this many seconds for a final "
            "status (or, with If-None-Match, any change)",
        ),
    ] = 0.0,
    if_none_match: Annotated[
        str | None, Header(description="entity tag of a copy the client holds: 304 while it is current")
    ] = None,
) -> Response:
    """The plan record. Polling is cheap: send the ETag back in If-None-Match and an unchanged plan costs a
    304 with no body, answered from memory on PostgreSQL (`db.change_feed`) or after one narrow query;
    long-polls wait for the plan's change notification (or re-check the narrow state)."""
    db: Database = request.app.state.db  # the hot path: app state read directly, not through dependencies
    settings: Settings = request.app.state.settings
    feed: ChangeFeed | None = request.app.state.change_feed
    deadline = time.monotonic() + min(wait, settings.max_wait_s)
    known = if_none_match  # a copy whose tag is known: wait on the narrow state while it stays current
    while True:
        if known is not None:
            tag = await _current_tag(db, feed, plan_id, principal.project_id)
            if tag is None:
                raise ApiError(404, f"plan {plan_id} not found")
            remaining = deadline - time.monotonic()
            if etag_matches(known, tag) and remaining > 0:
                await _until_changed(feed, plan_id, remaining)
                continue
            if etag_matches(if_none_match, tag):  # the deadline passed and the client's copy is still current
                return Response(status_code=304, headers={"etag": tag})
        generation = feed.generation if feed is not None else 0
        loaded = await run_in_threadpool(_load, db, plan_id, principal.project_id)
        if loaded is None:
            raise ApiError(404, f"plan {plan_id} not found")
        status, etag, body = loaded
        if feed is not None:
            feed.remember(plan_id, principal.project_id, etag, generation)
        if status in FINAL_PLAN_STATUSES or time.monotonic() >= deadline or if_none_match is not None:
            if etag_matches(if_none_match, etag):
                return Response(status_code=304, headers={"etag": etag})
            return Response(body, media_type="application/json", headers={"etag": etag})
        known = etag  # not final yet: wait for the next change, then read the record again


@router.get("", response_model=Page[PlanRecord], responses={200: {"links": links.PLAN_PAGE}})
def list_plans(
    session: SessionDep,
    settings: SettingsDep,
    principal: PrincipalDep,
    model: ModelFilter = None,
    hardware: HardwareFilter = None,
    world_size: WorldSizeFilter = None,
    ranks_per_node: RanksPerNodeFilter = None,
    status: PlanStatus | None = None,
    id_prefix: Annotated[
        str | None,
        Query(
            pattern="^[0-9a-f]{1,32}$", description="plans whose id starts with this (the CLI's short ids)"
        ),
    ] = None,
    search: SearchFilter = None,
    sort: PlanSort = "-created_at",
    limit: Annotated[int, Query(ge=1, le=1000)] = 50,
    cursor: str | None = None,
    with_plan: Annotated[
        bool,
        Query(
            description="include each whole plan (megabytes with an "
            "allocation); by default items carry the headline"
        ),
    ] = False,
) -> JSONResponse:
    try:
        page = PlanRepository(session).list(
            project_id=principal.project_id,
            model=model,
            hardware=hardware,
            status=status,
            limit=min(limit, settings.list_limit_max),
            cursor=cursor,
            descending=sort.startswith("-"),
            with_result=with_plan,
            id_prefix=id_prefix,
            sort_key=sort.lstrip("-"),
            search=search,
            world_size=world_size,
            ranks_per_node=ranks_per_node,
        )
    except BadCursor as exc:
        raise ApiError(400, str(exc)) from exc
    except ValueError as exc:  # the search's words (repositories.search_terms), named
        raise ApiError(422, str(exc)) from exc
    return JSONResponse(
        {
            "items": [
                plan_record_json(
                    r.plan,
                    with_feedback=False,
                    with_plan=with_plan,
                    measured=MeasuredErrors(r.iteration_error, r.peak_device_error),
                )
                for r in page.items
            ],
            "next_cursor": page.next_cursor,
        }
    )


@router.post("/{plan_id}/feedback", status_code=201, response_model=FeedbackRecord)
def post_feedback(
    plan_id: PlanId, body: Feedback, request: Request, session: SessionDep, principal: PrincipalDep
) -> FeedbackRecord:
    try:
        row = plans.add_feedback(session, principal.project_id, plan_id, body, request.app.state.change_feed)
    except plans.PlanNotFound as exc:
        raise ApiError(404, str(exc)) from exc
    except plans.FeedbackNotAccepted as exc:
        raise ApiError(409, str(exc)) from exc
    return feedback_record(row)


@router.put("/{plan_id}/allocation", response_model=PlanRecord)
def put_managed_allocation(
    plan_id: PlanId, body: AllocationTrace, request: Request, session: SessionDep, principal: PrincipalDep
) -> PlanRecord:
    """The allocation of one iteration run under the plan (the agent records it): placed, validated and stored
    as the plan's allocation (`iteration: managed`), replacing the placement of the profiled iteration."""
    try:
        row = plans.store_managed_allocation(
            session, principal.project_id, plan_id, body, request.app.state.change_feed
        )
    except plans.PlanNotFound as exc:
        raise ApiError(404, str(exc)) from exc
    except plans.AllocationNotAccepted as exc:
        raise ApiError(409, str(exc)) from exc
    except plans.AllocationInvalid as exc:
        raise ApiError(422, str(exc)) from exc
    return plan_record(row)
