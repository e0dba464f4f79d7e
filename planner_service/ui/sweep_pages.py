"""What-if pages: `/ui/whatif`, a form (a config pasted or asked before, hardware, batch sizes, sequence
lengths) that starts a sweep and goes to its page; `/ui/sweeps/{id}`, a sweep's points (the fit/speed table) and its plot of tokens/s and peak
device memory against batch size per hardware (sweep_chart.py; refreshes while points are being solved);
`/ui/calibration`, predicted against measured iteration time and peak over all feedback (calibration_chart.py)."""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import parse_qs

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from pydantic import ValidationError
from sqlalchemy import select
from starlette.concurrency import run_in_threadpool

from client.contract import SweepRequest
from client.contract.common import NO_NUL_MESSAGE, has_nul
from client.errors import first_problem
from planner_service.api.deps import DatabaseDep, PrincipalDep
from planner_service.db.models import FeedbackRow, PlanRow, SweepRow
from planner_service.ui.calibration_chart import FeedbackPoint, errors, render_calibration_svg
from planner_service.ui.router import _error_page, templates
from planner_service.ui.sweep_chart import render_sweep_svg
from planner_service.whatif.catalog import load_catalog
from planner_service.whatif.service import WhatIfError
from planner_service.whatif.sweep import MAX_PAGE, create_sweep, read_sweep

router = APIRouter(include_in_schema=False)


@router.get("/ui/sweeps/{sweep_id}", response_class=HTMLResponse)
def sweep_page(request: Request, sweep_id: str, db: DatabaseDep, principal: PrincipalDep) -> Response:
    if has_nul(sweep_id):
        return _error_page(request, 400, "Bad request", f"sweep_id: {NO_NUL_MESSAGE}")
    if len(sweep_id) > 64:
        return _error_page(request, 404, "Sweep not found", f"sweep_id: no sweep {sweep_id[:64]!r}…")
    with db.session() as s:
        record = read_sweep(s, principal.project_id, sweep_id, limit=MAX_PAGE)
    if record is None:
        return _error_page(request, 404, "Sweep not found", f"sweep_id: no sweep {sweep_id!r}")
    refresh = record.progress.finished < record.progress.total
    return templates.TemplateResponse(
        request, "sweep.html", {"s": record, "chart": render_sweep_svg(record.points), "refresh": refresh}
    )


MAX_FEEDBACK_POINTS = 2000


@router.get("/ui/calibration", response_class=HTMLResponse)
def calibration_page(request: Request, db: DatabaseDep, principal: PrincipalDep) -> Response:
    stmt = (
        select(FeedbackRow.iteration_s, FeedbackRow.peak_device_bytes, PlanRow.hardware_key, PlanRow.headline)
        .join(PlanRow, PlanRow.id == FeedbackRow.plan_id)
        .where(PlanRow.project_id == principal.project_id)
        .order_by(FeedbackRow.created_at.desc())
        .limit(MAX_FEEDBACK_POINTS + 1)
    )
    points: list[FeedbackPoint] = []
    with db.session() as s:
        rows = s.execute(stmt).all()
    for measured_s, measured_peak, hardware, headline in rows[:MAX_FEEDBACK_POINTS]:
        pred = (headline or {}).get("predictions") or {}
        if pred.get("iteration_s") and pred.get("peak_device_bytes") and measured_s > 0:
            points.append(
                FeedbackPoint(
                    hardware,
                    float(pred["iteration_s"]),
                    float(measured_s),
                    int(pred["peak_device_bytes"]),
                    int(measured_peak),
                )
            )
    return templates.TemplateResponse(
        request,
        "calibration.html",
        {
            "points": points,
            "chart": render_calibration_svg(points),
            "errors": errors(points),
            "truncated": len(rows) > MAX_FEEDBACK_POINTS,
        },
    )


MAX_FORM_BYTES = 256 * 1024
HISTORY = 20
DEFAULT_FORM = {
    "config": "",
    "hardware": ["a100-80gb-sxm", "h100-sxm"],
    "batch_sizes": "1,2,4,8,16",
    "sequence_lengths": "2048",
    "dtype": "bf16",
}


def _history(s: Any, project_id: str) -> list[tuple[str, str, dict[str, Any]]]:
    """(sweep id, label, request) of the project's newest sweeps."""
    rows = s.scalars(
        select(SweepRow)
        .where(SweepRow.project_id == project_id)
        .order_by(SweepRow.created_at.desc())
        .limit(HISTORY)
    ).all()
    out = []
    for r in rows:
        cfg = r.request.get("config", {})
        label = (
            f"{cfg.get('model_type', '?')} {cfg.get('num_hidden_layers', '?')}L "
            f"{cfg.get('hidden_size', '?')}H on {', '.join(r.request.get('hardware', []))} "
            f"({r.n_points} points, {r.created_at:%Y-%m-%d %H:%M})"
        )
        out.append((r.id, label, r.request))
    return out


def _whatif_form(
    request: Request,
    db: Any,
    project_id: str,
    form: dict[str, Any],
    message: str | None,
    status_code: int = 200,
) -> Response:

    with db.session() as s:
        history = _history(s, project_id)
    items = [(sid, label) for sid, label, _ in history]
    return templates.TemplateResponse(
        request,
        "whatif.html",
        {
            "catalog": list(load_catalog().values()),
            "form": form,
            "message": message,
            "history": items,
            "sweeps": items,
        },
        status_code=status_code,
    )


@router.get("/ui/whatif", response_class=HTMLResponse)
def whatif_page(request: Request, db: DatabaseDep, principal: PrincipalDep) -> Response:
    return _whatif_form(request, db, principal.project_id, DEFAULT_FORM, None)


@router.post("/ui/whatif", response_class=HTMLResponse)
async def whatif_submit(request: Request, db: DatabaseDep, principal: PrincipalDep) -> Response:
    """Start a sweep from the form and go to its page; a bad field re-shows the form naming it (400)."""

    body = await request.body()
    if len(body) > MAX_FORM_BYTES:
        return _error_page(request, 413, "Too large", f"the form: at most {MAX_FORM_BYTES} bytes")
    raw = parse_qs(body.decode("utf-8", "replace"), max_num_fields=64)
    form: dict[str, Any] = {
        "config": (raw.get("config") or [""])[0],
        "hardware": raw.get("hardware", []),
        "batch_sizes": (raw.get("batch_sizes") or [""])[0],
        "sequence_lengths": (raw.get("sequence_lengths") or [""])[0],
        "dtype": (raw.get("dtype") or ["bf16"])[0],
    }
    previous = (raw.get("previous") or [""])[0]

    def bad(message: str) -> Response:
        return _whatif_form(request, db, principal.project_id, form, message, 400)

    config: Any = None
    if previous and not form["config"].strip():
        with db.session() as s:
            row = s.get(SweepRow, previous)
            if row is None or row.project_id != principal.project_id:
                return bad(f"previous: no sweep {previous[:40]!r}")
            config = row.request.get("config")
    else:
        try:
            config = json.loads(form["config"])
        except json.JSONDecodeError as exc:
            return bad(f"config: not JSON ({exc.msg} at line {exc.lineno})")
    try:
        req = SweepRequest(
            config=config,
            hardware=form["hardware"],
            batch_sizes=[int(v) for v in form["batch_sizes"].split(",") if v.strip()],
            sequence_lengths=[int(v) for v in form["sequence_lengths"].split(",") if v.strip()],
            dtype=form["dtype"],
        )
    except ValueError as exc:  # pydantic's ValidationError included
        if isinstance(exc, ValidationError):
            return bad(first_problem(exc, "form"))
        return bad(f"batch sizes and sequence lengths: numbers separated by commas ({exc})")
    queue = request.app.state.solve_queue

    def work() -> str:
        with db.session() as s:
            return str(create_sweep(s, principal.project_id, req, load_catalog(), queue.enqueue).id)

    try:
        sweep_id = await run_in_threadpool(work)
    except WhatIfError as exc:
        return bad(exc.message)
    return RedirectResponse(f"/ui/sweeps/{sweep_id}", status_code=303)
