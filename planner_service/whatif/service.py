"""`POST /v1/whatif`'s work: a WhatIfRequest answered on catalogued hardware, calibrated by the project's history.

A config is run once per batch on fake tensors (`modelled_trace.iterate`) and priced on each entry; a stored
measured trace is retargeted (`retarget.py`). With `calibrate` (the default), each entry's factors are fitted
(`calibrate.py`) to the project's measured traces taken on the entry's device (matched by device name, same
precision; at most `MAX_CALIBRATION_TRACES`, the newest usable): each is paired with the fake iteration of its
own model under its own workload (`calibrate.sample_of`). The efficiency factors are the hardware's, so any
model's trace serves: one that records its Hugging Face config (`ModelInfo.config`, written by the profiler)
is priced from that config; one that records none only when it is the asked model. An entry without a usable
trace answers uncalibrated; a calibrated answer says from how many traces and of which models.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session

from client.contract import CatalogEntry, OptimizerKind, Trace, WhatIfRequest
from client.contract.trace import MAX_BLOCKS
from planner_service.db.models import HardwareRow, ModelRow, TraceRow
from planner_service.db.repositories import TraceRepository, UnreadableStoredTrace, decompress_trace
from planner_service.whatif.answer import Answer, answer
from planner_service.whatif.architecture import ArchitectureError, config_from_dict
from planner_service.whatif.calibrate import Calibration, CalibrationSample, calibrate, sample_of
from planner_service.whatif.catalog import CatalogError, entry
from planner_service.whatif.modelled_trace import ModelledWorkload, iterate, trace_on
from planner_service.whatif.retarget import retarget, source_entry

MAX_CALIBRATION_TRACES = 8


@dataclass
class WhatIfError(Exception):
    """The request names something that does not exist or cannot be modelled (`status`: HTTP status)."""

    status: int
    message: str

    def __str__(self) -> str:
        return self.message


def answer_request(
    req: WhatIfRequest,
    *,
    session: Session,
    project_id: str,
    catalog: dict[str, CatalogEntry],
    time_limit_s: float,
) -> list[Answer]:
    """Every entry's answer to `req` (see the module docstring); WhatIfError names the offending field."""
    entries = []
    for i, key in enumerate(req.hardware):
        if key not in catalog:
            raise WhatIfError(
                422,
                f"hardware[{i}]: {key!r} is not in the catalogue (`memplan hardware catalog` lists the keys)",
            )
        entries.append(catalog[key])
    if req.trace_id is not None:
        return _retargeted(req, session, project_id, catalog, entries, time_limit_s)
    return _modelled(req, session, project_id, entries, time_limit_s)


def _retargeted(
    req: WhatIfRequest,
    session: Session,
    project_id: str,
    catalog: dict[str, CatalogEntry],
    entries: list[CatalogEntry],
    time_limit_s: float,
) -> list[Answer]:
    assert req.trace_id is not None
    row = TraceRepository(session).get(req.trace_id, project_id)
    if row is None:
        raise WhatIfError(404, f"trace_id: no trace {req.trace_id!r} in this project")
    try:
        measured = decompress_trace(row)
    except UnreadableStoredTrace as exc:
        raise WhatIfError(500, f"trace_id: the stored trace is unreadable ({exc})") from None
    if measured.modelled is not None:
        raise WhatIfError(422, "trace_id: a modelled trace; retargeting needs a measured one")
    try:
        if req.source_hardware is not None:
            src = entry(catalog, req.source_hardware)
        else:
            src = source_entry(measured, catalog)
    except CatalogError as exc:
        raise WhatIfError(422, f"source_hardware: {exc}".replace("--from KEY", "source_hardware")) from None
    return [
        answer(
            retarget(measured, src, e, host_memory_bytes=req.host_memory_bytes),
            e,
            host_memory_bytes=req.host_memory_bytes,
            time_limit_s=time_limit_s,
        )
        for e in entries
    ]


def _modelled(
    req: WhatIfRequest, session: Session, project_id: str, entries: list[CatalogEntry], time_limit_s: float
) -> list[Answer]:
    assert req.batch_size is not None and req.sequence_length is not None
    dtype = req.dtype or "bf16"
    try:
        cfg = config_from_dict(req.config, "config")
        layers = getattr(cfg, "num_hidden_layers", None)
        if isinstance(layers, int) and not 1 <= layers <= MAX_BLOCKS - 2:
            raise WhatIfError(422, f"config: num_hidden_layers: {layers} is not in 1..{MAX_BLOCKS - 2}")
        workload = ModelledWorkload(
            req.batch_size, req.sequence_length, dtype, req.optimizer or OptimizerKind.adamw
        )
        it = iterate(cfg, workload)
    except (ArchitectureError, ValueError) as exc:
        raise WhatIfError(422, str(exc)) from None
    out = []
    for e in entries:
        cal = calibration_for(cfg, e, dtype, session, project_id) if req.calibrate else None
        out.append(
            answer(
                trace_on(it, e, host_memory_bytes=req.host_memory_bytes, calibration=cal),
                e,
                host_memory_bytes=req.host_memory_bytes,
                time_limit_s=time_limit_s,
            )
        )
    return out


MAX_CALIBRATION_ROWS = 4 * MAX_CALIBRATION_TRACES  # stored traces read to find the usable ones


def stored_measured_traces(
    session: Session,
    project_id: str,
    device_name: str,
    architecture: str | None = None,
    limit: int = MAX_CALIBRATION_TRACES,
) -> list[Trace]:
    """The project's newest measured traces taken on a device named `device_name` (of `architecture` only, if
    given)."""
    stmt = (
        select(TraceRow)
        .join(
            HardwareRow,
            (HardwareRow.project_id == TraceRow.project_id) & (HardwareRow.key == TraceRow.hardware_key),
        )
        .join(
            ModelRow,
            (ModelRow.project_id == TraceRow.project_id)
            & (ModelRow.fingerprint == TraceRow.model_fingerprint),
        )
        .where(TraceRow.project_id == project_id, HardwareRow.device_name == device_name)
        .order_by(TraceRow.created_at.desc(), TraceRow.id.desc())
        .limit(limit)
    )
    if architecture is not None:
        stmt = stmt.where(ModelRow.architecture == architecture)
    out = []
    for row in session.scalars(stmt):
        try:
            t = decompress_trace(row)
        except UnreadableStoredTrace:
            continue  # an unreadable payload calibrates nothing; GET /v1/traces/{id} reports it
        if t.modelled is None:
            out.append(t)
    return out


def calibration_for(
    cfg: object, entry: CatalogEntry, dtype: str, session: Session, project_id: str
) -> Calibration | None:
    """The entry's factors in `dtype` fitted to the project's measured traces on its device (see the module
    docstring); None where no trace is usable (the answer says uncalibrated)."""
    samples: list[CalibrationSample] = []
    for m in stored_measured_traces(session, project_id, entry.name, limit=MAX_CALIBRATION_ROWS):
        if m.workload.precision.value != dtype:
            continue
        sample = sample_of(m, cfg)
        if sample is not None:
            samples.append(sample)
            if len(samples) == MAX_CALIBRATION_TRACES:
                break
    return calibrate(samples, entry, dtype) if samples else None
