"""/v1/traces: upload (JSON or gzip, idempotent by content hash), fetch, list by model and hardware."""

from __future__ import annotations

import time
from typing import Annotated

from fastapi import APIRouter, Query, Request, Response
from starlette.concurrency import run_in_threadpool

from client.contract import Page, TraceCreated, TraceRecord, TraceSummary
from planner_service.api import links
from planner_service.api.bodies import read_body
from planner_service.api.deps import PrincipalDep, SessionDep, SettingsDep
from planner_service.api.errors import ERROR_RESPONSES, ApiError, validation_detail
from planner_service.api.params import (
    HardwareFilter,
    ModelFilter,
    RanksPerNodeFilter,
    TraceId,
    WorldSizeFilter,
)
from planner_service.api.present import trace_summary
from planner_service.db.keyset_cursor import BadCursor
from planner_service.db.repositories import TraceRepository, UnreadableStoredTrace, decompress_trace
from planner_service.ingest import (
    BadGzip,
    GzipTooLarge,
    Ingestor,
    IngestUnavailable,
    InvalidJson,
    InvalidTrace,
)

router = APIRouter(prefix="/v1/traces", tags=["traces"], responses=ERROR_RESPONSES)


@router.post(
    "",
    status_code=201,
    response_model=TraceCreated,
    responses={
        201: {"links": links.TRACE_CREATED},
        200: {
            "model": TraceCreated,
            "description": "identical content already stored",
            "links": links.TRACE_CREATED,
        },
    },
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Trace"}}},
        }
    },
)
async def upload_trace(
    request: Request, response: Response, session: SessionDep, settings: SettingsDep, principal: PrincipalDep
) -> TraceCreated:
    t0 = time.perf_counter()
    body = await read_body(request, settings)
    t1 = time.perf_counter()
    ingestor: Ingestor = request.app.state.ingestor
    try:
        inspection = await ingestor.inspect(body.data, body.gzipped, settings.max_decompressed_bytes)
    except BadGzip as exc:
        raise ApiError(400, str(exc)) from exc
    except GzipTooLarge as exc:
        raise ApiError(413, str(exc)) from exc
    except InvalidJson as exc:
        raise ApiError(400, str(exc)) from exc
    except InvalidTrace as exc:
        raise ApiError(422, "validation failed", validation_detail(exc.errors, ("body",))) from exc
    except IngestUnavailable as exc:
        raise ApiError(503, str(exc), headers={"Retry-After": "1"}) from exc
    repo = TraceRepository(session)  # database work off the event loop too
    t2 = time.perf_counter()
    row, created = await run_in_threadpool(repo.add, inspection.facts, principal.project_id)
    t3 = time.perf_counter()
    response.status_code = 201 if created else 200
    # Where the time went (the commit follows, before the response): read the body; validate and hash it
    # (ingest: from hand-over to result; validate: its wall time and CPU in the process that ran it, so
    # ingest - validate is the queue for an ingest process and the hand-over); store it.
    response.headers["server-timing"] = (
        f"read;dur={(t1 - t0) * 1e3:.1f}, ingest;dur={(t2 - t1) * 1e3:.1f}, "
        f"validate;dur={inspection.wall_s * 1e3:.1f}, validate-cpu;dur={inspection.cpu_s * 1e3:.1f}, "
        f"store;dur={(t3 - t2) * 1e3:.1f}"
    )
    return TraceCreated(id=row.id, content_hash=row.content_hash, created=created)


@router.get("/{trace_id}", response_model=TraceRecord)
def get_trace(
    trace_id: TraceId, session: SessionDep, settings: SettingsDep, principal: PrincipalDep
) -> TraceRecord:
    row = TraceRepository(session).get(trace_id, principal.project_id)
    if row is None:
        raise ApiError(404, f"trace {trace_id} not found")
    try:
        trace = decompress_trace(row, settings.max_decompressed_bytes)
    except UnreadableStoredTrace as exc:  # stored before uploads were checked whole: upload it again
        raise ApiError(409, f"trace {trace_id}: {exc}") from exc
    return TraceRecord(**trace_summary(row).model_dump(), trace=trace)


@router.get("", response_model=Page[TraceSummary], responses={200: {"links": links.TRACE_PAGE}})
def list_traces(
    session: SessionDep,
    settings: SettingsDep,
    principal: PrincipalDep,
    model: ModelFilter = None,
    hardware: HardwareFilter = None,
    world_size: WorldSizeFilter = None,
    ranks_per_node: RanksPerNodeFilter = None,
    id_prefix: Annotated[
        str | None,
        Query(
            pattern="^[0-9a-f]{1,32}$", description="traces whose id starts with this (the CLI's short ids)"
        ),
    ] = None,
    sort: Annotated[str, Query(pattern="^-?created_at$")] = "-created_at",
    limit: Annotated[int, Query(ge=1, le=1000)] = 50,
    cursor: str | None = None,
) -> Page[TraceSummary]:
    try:
        page = TraceRepository(session).list(
            project_id=principal.project_id,
            model=model,
            hardware=hardware,
            limit=min(limit, settings.list_limit_max),
            cursor=cursor,
            descending=sort.startswith("-"),
            id_prefix=id_prefix,
            world_size=world_size,
            ranks_per_node=ranks_per_node,
        )
    except BadCursor as exc:
        raise ApiError(400, str(exc)) from exc
    return Page[TraceSummary](items=[trace_summary(r) for r in page.items], next_cursor=page.next_cursor)
