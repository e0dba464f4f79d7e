"""/v1/whatif: will a model fit on catalogued hardware, which limit binds, how fast (planner_service/whatif/)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request
from starlette.concurrency import run_in_threadpool

from client.contract import (
    CatalogEntry,
    SweepRecord,
    SweepRequest,
    WhatIfAnswer,
    WhatIfRequest,
    WhatIfResponse,
)
from planner_service.api.deps import PrincipalDep, SessionDep
from planner_service.api.errors import ERROR_RESPONSES, ApiError
from planner_service.api.params import SweepId
from planner_service.whatif.catalog import CatalogError, load_catalog
from planner_service.whatif.service import WhatIfError, answer_request
from planner_service.whatif.sweep import create_sweep as create
from planner_service.whatif.sweep import read_sweep

router = APIRouter(prefix="/v1", tags=["whatif"], responses=ERROR_RESPONSES)

# Solver seconds per question (per entry and, for a limit that binds, per bisection step): the request runs
# while the client waits, so it is short; `memplan whatif --time-limit` takes longer ones locally.
WHATIF_TIME_LIMIT_S = 1.0


@router.post("/whatif", response_model=WhatIfResponse)
async def ask_whatif(body: WhatIfRequest, session: SessionDep, principal: PrincipalDep) -> WhatIfResponse:
    """Each `hardware` entry's answer for a config (modelled on fake tensors, calibrated by the project's
    measured traces of the model on that device) or a stored measured trace (retargeted)."""
    catalog = _catalog()
    try:
        answers = await run_in_threadpool(
            answer_request,
            body,
            session=session,
            project_id=principal.project_id,
            catalog=catalog,
            time_limit_s=WHATIF_TIME_LIMIT_S,
        )
    except WhatIfError as exc:
        raise ApiError(exc.status, exc.message) from exc
    return WhatIfResponse(answers=[WhatIfAnswer.model_validate(a.to_json()) for a in answers])


def _catalog() -> dict[str, CatalogEntry]:
    try:
        return load_catalog()
    except CatalogError as exc:
        raise ApiError(500, f"the service's catalogue: {exc}") from exc


@router.post("/sweeps", status_code=202, response_model=SweepRecord)
async def create_sweep(
    body: SweepRequest, request: Request, session: SessionDep, principal: PrincipalDep
) -> SweepRecord:
    """Fan a sweep out into one plan (one solve job) per point; poll `GET /v1/sweeps/{id}` for progress."""
    catalog = _catalog()
    queue = request.app.state.solve_queue

    def work() -> SweepRecord:
        row = create(session, principal.project_id, body, catalog, queue.enqueue)
        record = read_sweep(session, principal.project_id, row.id)
        assert record is not None
        return record

    try:
        return await run_in_threadpool(work)
    except WhatIfError as exc:
        raise ApiError(exc.status, exc.message) from exc


@router.get("/sweeps/{sweep_id}", response_model=SweepRecord)
async def get_sweep(
    sweep_id: SweepId,
    session: SessionDep,
    principal: PrincipalDep,
    limit: Annotated[int, Query(ge=1, le=500, description="points per page")] = 100,
    cursor: Annotated[
        str | None, Query(max_length=32, description="next_cursor of the previous page")
    ] = None,
) -> SweepRecord:
    """A sweep's progress (its plans by status) and one page of its points with their results."""
    try:
        record = await run_in_threadpool(
            read_sweep, session, principal.project_id, sweep_id, limit=limit, cursor=cursor
        )
    except WhatIfError as exc:
        raise ApiError(exc.status, exc.message) from exc
    if record is None:
        raise ApiError(404, f"sweep_id: sweep {sweep_id[:64]!r} not found")
    return record
