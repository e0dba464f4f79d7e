"""/healthz (process alive) and /readyz (database reachable, schema current)."""

from __future__ import annotations

from typing import Any

import anyio
import anyio.to_thread
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from planner_service.db.migrate import head_revision, probe_revision
from planner_service.db.session import Database
from planner_service.settings import Settings

router = APIRouter(tags=["health"])
READY: dict[int | str, dict[str, Any]] = {
    200: {"description": "ready"},
    503: {"description": "database unreachable, frozen, or schema out of date"},
}


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


# Its own threads: the readiness check must answer even when every request thread waits on the database.
_PROBES = anyio.CapacityLimiter(2)


@router.get("/readyz", responses=READY)
async def readyz(request: Request) -> JSONResponse:
    """Ready: the database answers, on a new connection, within `readiness_timeout_s`, at the code's schema.
    A database that is down, refuses, or is frozen (accepts and never answers) gives 503 within that bound."""
    db: Database = request.app.state.db
    settings: Settings = request.app.state.settings
    timeout_s = settings.readiness_timeout_s
    try:
        with anyio.fail_after(timeout_s + 1.0):  # the probe's own timeouts end it first; this is the backstop
            current = await anyio.to_thread.run_sync(
                probe_revision, db, timeout_s, limiter=_PROBES, abandon_on_cancel=True
            )
    except TimeoutError:
        return JSONResponse(
            {"status": "unavailable", "error": f"database did not answer within {timeout_s:g} s"},
            status_code=503,
            headers={"Retry-After": "1"},
        )
    except Exception as exc:
        return JSONResponse(
            {"status": "unavailable", "error": type(exc).__name__},
            status_code=503,
            headers={"Retry-After": "1"},
        )
    head = head_revision()
    if current != head:
        return JSONResponse(
            {"status": "schema out of date", "current": current, "head": head}, status_code=503
        )
    return JSONResponse({"status": "ready", "schema": current})
