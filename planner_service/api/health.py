"""/healthz (process alive) and /readyz (database reachable, schema current)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from sqlalchemy import text

from planner_service.api.deps import DatabaseDep
from planner_service.db.migrate import current_revision, head_revision

router = APIRouter(tags=["health"])
READY = {200: {"description": "ready"}, 503: {"description": "database unreachable or schema out of date"}}


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz", responses=READY)
def readyz(db: DatabaseDep) -> JSONResponse:
    try:
        with db.engine.connect() as conn:
            conn.execute(text("SELECT 1"))
        current = current_revision(db.engine)
    except Exception as exc:
        return JSONResponse({"status": "unavailable", "error": type(exc).__name__}, status_code=503)
    head = head_revision()
    if current != head:
        return JSONResponse({"status": "schema out of date", "current": current, "head": head}, status_code=503)
    return JSONResponse({"status": "ready", "schema": current})
