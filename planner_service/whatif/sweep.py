"""What-if sweeps: one request fanned out into one solve job per point on the job engine, results kept as plans.

`create_sweep` runs the config's fake iteration once per (batch, sequence length), prices it on each catalogue
entry (a modelled trace, stored like any other: `TraceRepository.add`), and for each device and host limit
creates a plan and enqueues its solve job, or reuses an identical request's plan
(`PlanRepository.reusable_or_new` + the app's solve queue: procrastinate on PostgreSQL, the in-process pool on
SQLite), all in the caller's transaction with the sweep row: the sweep and all its jobs, or none. `read_sweep`
reports progress (plans by status) and one page of points with each plan's status and headline. A point's plan
is an ordinary plan: `GET /v1/plans/{id}` shows it whole.

Points are calibrated as `POST /v1/whatif` answers are (`service.calibration_for`, once per catalogue entry:
the project's measured traces on the entry's device, of any model that records its config), unless the request
says `calibrate: false`; each point says whether it is calibrated, from how many traces, of which models, and
the residual (read back from its stored modelled trace's `modelled` section).
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable

from sqlalchemy import select
from sqlalchemy.orm import Session

from client.contract import (
    FINAL_PLAN_STATUSES,
    CatalogEntry,
    Constraints,
    Objective,
    PlanStatus,
    SweepPoint,
    SweepProgress,
    SweepRecord,
    SweepRequest,
)
from client.contract.trace import MAX_BLOCKS
from planner_service.db.models import PlanRow, SweepRow
from planner_service.db.repositories import PlanRepository, TraceRepository, once_more_on_conflict
from planner_service.solver import SOLVER_VERSION
from planner_service.whatif.architecture import ArchitectureError, config_from_dict
from planner_service.whatif.calibration import Calibration
from planner_service.whatif.modelled_trace import ModelledWorkload, iterate, trace_on
from planner_service.whatif.service import WhatIfError, calibration_for

SOLVER = "cpsat"
MAX_PAGE = 500


@once_more_on_conflict
def create_sweep(
    session: Session,
    project_id: str,
    req: SweepRequest,
    catalog: dict[str, CatalogEntry],
    enqueue: Callable[[Session, str], None],
) -> SweepRow:
    """Store the sweep, its modelled traces and one plan per point (see the module docstring): a point whose
    request an earlier plan answers (an identical sweep's, or a `POST /v1/plans`) reuses it, as that endpoint
    does; a sweep that lost a race with an identical one on a plan or trace is made again from the start."""
    entries = []
    for i, key in enumerate(req.hardware):
        if key not in catalog:
            raise WhatIfError(
                422,
                f"hardware[{i}]: {key!r} is not in the catalogue (`memplan hardware catalog` lists the keys)",
            )
        entries.append(catalog[key])
    try:
        cfg = config_from_dict(req.config, "config")
    except ArchitectureError as exc:
        raise WhatIfError(422, str(exc)) from None
    layers = getattr(cfg, "num_hidden_layers", None)
    if isinstance(layers, int) and not 1 <= layers <= MAX_BLOCKS - 2:
        raise WhatIfError(422, f"config: num_hidden_layers: {layers} is not in 1..{MAX_BLOCKS - 2}")
    traces, plans = TraceRepository(session), PlanRepository(session)
    calibrations: dict[str, Calibration | None] = {
        e.key: calibration_for(cfg, e, req.dtype, session, project_id) if req.calibrate else None
        for e in entries
    }
    stored = []  # (batch, seq, entry, host, trace row): every trace first, for their savepoints (below)
    for batch, seq in itertools.product(req.batch_sizes, req.sequence_lengths):
        try:
            it = iterate(cfg, ModelledWorkload(batch, seq, req.dtype, req.optimizer))
        except (ArchitectureError, ValueError) as exc:
            raise WhatIfError(422, f"batch {batch} x seq {seq}: {exc}") from None
        for e in entries:
            for host in req.host_memory_bytes or [e.host_memory_bytes]:
                cal = calibrations[e.key]
                row, _ = traces.add(trace_on(it, e, host_memory_bytes=host, calibration=cal), project_id)
                stored.append((batch, seq, e, host, row, cal))
    # Plans and their jobs after every trace: `TraceRepository.add` opens a savepoint, and a savepoint
    # released after a plan was handed to the in-process pool let that plan run before its row was committed.
    points: list[dict[str, object]] = []
    for batch, seq, e, host, row, cal in stored:
        for device in req.device_memory_bytes or [e.device_memory_bytes]:
            c = Constraints(device_memory_bytes=device, host_memory_bytes=host, time_limit_s=req.time_limit_s)
            plan, created = plans.reusable_or_new(
                row, c, Objective.min_iteration_time, SOLVER, SOLVER_VERSION
            )
            if created:
                enqueue(session, plan.id)
            points.append(
                {
                    "batch_size": batch,
                    "sequence_length": seq,
                    "hardware": e.key,
                    "device_memory_bytes": device,
                    "host_memory_bytes": host,
                    "trace_id": row.id,
                    "plan_id": plan.id,
                    **_calibration_fields(cal),
                }
            )
    sweep = SweepRow(
        project_id=project_id, request=req.model_dump(mode="json"), points=points, n_points=len(points)
    )
    session.add(sweep)
    session.flush()
    return sweep


def _calibration_fields(cal: Calibration | None) -> dict[str, object]:
    """What a point says of its calibration (`SweepPoint.calibrated` ...)."""
    if cal is None or not cal.calibrated:
        return {
            "calibrated": False,
            "calibration_traces": 0,
            "calibration_residual": None,
            "calibration_models": [],
        }
    return {
        "calibrated": True,
        "calibration_traces": cal.traces,
        "calibration_residual": cal.residual,
        "calibration_models": list(cal.models),
    }


def read_sweep(
    session: Session, project_id: str, sweep_id: str, *, limit: int = 100, cursor: str | None = None
) -> SweepRecord | None:
    """Progress and one page of points (`cursor`: the index of the first point, as returned in `next_cursor`)."""
    sweep = session.get(SweepRow, sweep_id)
    if sweep is None or sweep.project_id != project_id:
        return None
    start = 0
    if cursor is not None:
        if not cursor.isdigit() or int(cursor) > sweep.n_points:
            raise WhatIfError(400, f"cursor: {cursor[:40]!r} is not a cursor of this sweep")
        start = int(cursor)
    limit = max(1, min(limit, MAX_PAGE))
    ids = [p["plan_id"] for p in sweep.points]
    statuses: dict[str, str] = dict(
        session.execute(select(PlanRow.id, PlanRow.status).where(PlanRow.id.in_(ids))).all()
    )
    by_status = Counter(statuses.get(i, "missing") for i in ids)
    page = sweep.points[start : start + limit]
    rows = {
        r.id: r for r in session.scalars(select(PlanRow).where(PlanRow.id.in_([p["plan_id"] for p in page])))
    }
    out = []
    for p in page:
        row = rows.get(p["plan_id"])
        point = SweepPoint(**p, status=row.status if row is not None else "missing")
        pred = (row.headline or {}).get("predictions") if row is not None else None
        if row is not None and row.status in FINAL_PLAN_STATUSES:
            point.fits = row.status == PlanStatus.done and pred is not None
        if pred:
            point.iteration_s = pred.get("iteration_s")
            point.peak_device_bytes = pred.get("peak_device_bytes")
            point.peak_host_bytes = pred.get("peak_host_bytes")
            if point.iteration_s:
                point.tokens_per_s = p["batch_size"] * p["sequence_length"] / point.iteration_s
        out.append(point)
    end = start + len(page)
    return SweepRecord(
        id=sweep.id,
        created_at=sweep.created_at,
        progress=SweepProgress(
            total=sweep.n_points,
            finished=sum(by_status[s] for s in FINAL_PLAN_STATUSES),
            by_status=dict(by_status),
        ),
        points=out,
        next_cursor=str(end) if end < sweep.n_points else None,
    )
