"""Typed repositories: every query the service makes, in one place per table.

Why one module over 400 lines: by design every query the service makes is in this one place
(docs/ARCHITECTURE.md), one class per table.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Concatenate, Generic, ParamSpec, TypeVar

from pydantic import ValidationError
from sqlalchemy import Connection, Text, bindparam, cast, func, or_, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, contains_eager, defer, joinedload, selectinload, undefer
from sqlalchemy.sql.elements import ColumnElement

from client.contract import (
    Constraints,
    Feedback,
    Objective,
    PlanHeadline,
    PlanStatus,
    Predictions,
    Trace,
)
from planner_service.db.base import utcnow
from planner_service.db.keyset_cursor import (
    after,
    after_sorted,
    decode_sort_cursor,
    encode_cursor,
    encode_sort_cursor,
    sort_order,
)
from planner_service.db.models import (
    DEFAULT_PROJECT,
    ApiTokenRow,
    FeedbackRow,
    HardwareRow,
    ModelRow,
    PlanRow,
    ProjectRow,
    TraceRow,
)
from planner_service.ingest import BadGzip, GzipTooLarge, TraceFacts, gunzip_limited

R = TypeVar("R")
P = ParamSpec("P")
REUSABLE_STATUSES = tuple(
    s.value for s in PlanStatus if s is not PlanStatus.failed
)  # a failed request may be retried


def once_more_on_conflict(
    attempt: Callable[Concatenate[Session, P], R],
) -> Callable[Concatenate[Session, P], R]:
    """`attempt(session, ...)`, and once more after rolling the transaction back when it lost a race on a
    unique key: an identical request committed the same plan (or trace) between this one's look-up and its
    insert, and the second attempt finds it. `attempt` must only write what the rollback may undo whole (it
    starts afresh)."""

    @functools.wraps(attempt)
    def twice(session: Session, *args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return attempt(session, *args, **kwargs)
        except IntegrityError:
            session.rollback()
        return attempt(session, *args, **kwargs)

    return twice


def plan_etag(
    plan_id: str,
    status: str,
    attempts: int,
    started_at: Any,
    finished_at: Any,
    n_feedback: int,
    revision: int = 0,
) -> str:
    """Entity tag of a plan record: it changes whenever the record can (status, a new attempt, its times, new
    feedback, a new revision of the stored Plan: written with the final status, and again when the agent's
    managed allocation replaces the profiled one). Strong: equal tags, equal bytes."""
    key = f"{plan_id}|{status}|{attempts}|{started_at}|{finished_at}|{n_feedback}|{revision}"
    return '"' + hashlib.blake2b(key.encode(), digest_size=12).hexdigest() + '"'


def plan_headline(result: dict[str, Any] | None) -> dict[str, Any] | None:
    """What lists show of a stored Plan (`PlanHeadline`): predictions without the timeline and the cost
    breakdown, and the solver's report. Stored beside the result when a plan finishes."""
    if result is None:
        return None
    predictions = result.get("predictions")
    if predictions is not None:
        predictions = {
            k: v for k, v in predictions.items() if k not in ("device_memory_timeline", "breakdown")
        }
    return {"predictions": predictions, "solver": result.get("solver")}


# Built once: constructing a Core statement costs more than running it (~0.25 ms of the hot poll's CPU).
_PLAN_VERSION = select(
    PlanRow.id,
    PlanRow.status,
    PlanRow.attempts,
    PlanRow.started_at,
    PlanRow.finished_at,
    select(func.count()).select_from(FeedbackRow).where(FeedbackRow.plan_id == PlanRow.id).scalar_subquery(),
    PlanRow.revision,
).where(PlanRow.id == bindparam("plan_id"), PlanRow.project_id == bindparam("project_id"))


def plan_version(conn: Connection, plan_id: str, project_id: str) -> str | None:
    """The plan's entity tag (`plan_etag`) from one narrow indexed query: no plan body, no ORM."""
    row = conn.execute(_PLAN_VERSION, {"plan_id": plan_id, "project_id": project_id}).first()
    return None if row is None else plan_etag(*row)


@dataclass
class PageResult(Generic[R]):
    items: list[R]
    next_cursor: str | None


def _page(
    session: Session, stmt: Any, model: Any, limit: int, cursor: str | None, descending: bool
) -> PageResult[Any]:
    if cursor:
        stmt = stmt.where(after(model.created_at, model.id, cursor, descending))
    order = (model.created_at.desc(), model.id.desc()) if descending else (model.created_at, model.id)
    rows = list(session.scalars(stmt.order_by(*order).limit(limit + 1)))
    more = len(rows) > limit
    rows = rows[:limit]
    nxt = encode_cursor(rows[-1].created_at, rows[-1].id) if more and rows else None
    return PageResult(rows, nxt)


# ------------------------------------------------------------------------------------------- traces
STORED_TRACE_READ_LIMIT = 256 * 2**20  # the service's default max_decompressed_bytes


class UnreadableStoredTrace(ValueError):
    """A stored payload that does not inflate (within the limit) to a valid trace. Since uploads are checked
    whole (every gzip member) none is stored; rows stored before may hold a bomb or garbage."""


def read_stored_trace(payload_gzip: bytes, limit: int = STORED_TRACE_READ_LIMIT) -> Trace:
    """The trace of a stored payload, inflated under `limit` (a row stored before uploads were checked
    whole is never inflated without bound); `UnreadableStoredTrace` if it cannot be read."""
    try:
        raw, _ = gunzip_limited(payload_gzip, limit)
        return Trace.model_validate_json(raw)
    except (BadGzip, GzipTooLarge, ValidationError) as exc:
        raise UnreadableStoredTrace(f"stored trace cannot be read: {str(exc)[:200]}") from None


def decompress_trace(row: TraceRow, limit: int = STORED_TRACE_READ_LIMIT) -> Trace:
    return read_stored_trace(row.payload_gzip, limit)


class TraceRepository:
    def __init__(self, session: Session) -> None:
        self.s = session

    def get(self, trace_id: str, project_id: str | None = None, *, payload: bool = True) -> TraceRow | None:
        """A trace by id; with `project_id`, only if it belongs to that project. `payload=False` leaves the
        stored body (~1 MB gzip) unread until it is touched."""
        row = self.s.get(TraceRow, trace_id, options=() if payload else (defer(TraceRow.payload_gzip),))
        return row if row is not None and (project_id is None or row.project_id == project_id) else None

    def by_hash(self, project_id: str, content_hash: str) -> TraceRow | None:
        return self.s.scalar(
            select(TraceRow).where(TraceRow.project_id == project_id, TraceRow.content_hash == content_hash)
        )

    def add(self, trace: Trace | TraceFacts, project_id: str = DEFAULT_PROJECT) -> tuple[TraceRow, bool]:
        """Store a trace in a project; identical content there returns the existing row (created=False)."""
        facts = trace if isinstance(trace, TraceFacts) else TraceFacts.of(trace)
        existing = self.by_hash(project_id, facts.content_hash)
        if existing is not None:
            return existing, False
        self._ensure_model(facts, project_id)
        self._ensure_hardware(facts, project_id)
        row = TraceRow(
            project_id=project_id,
            content_hash=facts.content_hash,
            model_fingerprint=facts.model_fingerprint,
            hardware_key=facts.hardware_key,
            workload_key=facts.workload_key,
            schema_version=facts.schema_version,
            payload_gzip=facts.payload_gzip,
            payload_bytes=facts.payload_bytes,
            created_at=utcnow(),
        )
        try:
            with self.s.begin_nested():
                self.s.add(row)
        except IntegrityError:  # a concurrent upload of the same content won the race
            winner = self.by_hash(project_id, facts.content_hash)
            if winner is None:
                raise
            return winner, False
        return row, True

    def _ensure_model(self, f: TraceFacts, project_id: str) -> None:
        """The project's catalogue row of the model (the first trace of it names it)."""
        if self.s.get(ModelRow, {"project_id": project_id, "fingerprint": f.model_fingerprint}) is None:
            try:
                with self.s.begin_nested():
                    self.s.add(
                        ModelRow(
                            project_id=project_id,
                            fingerprint=f.model_fingerprint,
                            name=f.model_name,
                            architecture=f.architecture,
                            parameter_count=f.parameter_count,
                            created_at=utcnow(),
                        )
                    )
            except IntegrityError:
                pass

    def _ensure_hardware(self, f: TraceFacts, project_id: str) -> None:
        if self.s.get(HardwareRow, {"project_id": project_id, "key": f.hardware_key}) is None:
            try:
                with self.s.begin_nested():
                    self.s.add(
                        HardwareRow(
                            project_id=project_id,
                            key=f.hardware_key,
                            device_type=f.device_type,
                            device_name=f.device_name,
                            device_memory_bytes=f.device_memory_bytes,
                            device_count=f.device_count,
                            world_size=f.world_size,
                            ranks_per_node=f.ranks_per_node,
                            created_at=utcnow(),
                        )
                    )
            except IntegrityError:
                pass

    def list(
        self,
        *,
        project_id: str,
        model: str | None,
        hardware: str | None,
        limit: int,
        cursor: str | None,
        descending: bool = True,
        id_prefix: str | None = None,
        world_size: int | None = None,
        ranks_per_node: int | None = None,
    ) -> PageResult[TraceRow]:
        stmt = select(TraceRow).join(ModelRow).where(TraceRow.project_id == project_id)
        if id_prefix:
            stmt = stmt.where(TraceRow.id.startswith(id_prefix, autoescape=True))
        if model:
            stmt = stmt.where(or_(TraceRow.model_fingerprint == model, ModelRow.name == model))
        if hardware:
            stmt = stmt.where(TraceRow.hardware_key == hardware)
        stmt = _by_process_group(stmt, TraceRow, world_size, ranks_per_node)
        return _page(self.s, stmt, TraceRow, limit, cursor, descending)

    def process_group(self, trace: TraceRow) -> tuple[int, int]:
        """(world size, ranks per node) of the job the trace was measured in ((1, 1): a single process)."""
        hw = self.s.get(HardwareRow, {"project_id": trace.project_id, "key": trace.hardware_key})
        return (1, 1) if hw is None else (hw.world_size, hw.ranks_per_node)


def _by_process_group(
    stmt: Any, row: type[TraceRow] | type[PlanRow], world: int | None, per_node: int | None
) -> Any:
    """`stmt` keeping the rows whose hardware has this world size / ranks per node (None: any)."""
    if world is None and per_node is None:
        return stmt
    stmt = stmt.join(
        HardwareRow, (HardwareRow.project_id == row.project_id) & (HardwareRow.key == row.hardware_key)
    )
    if world is not None:
        stmt = stmt.where(HardwareRow.world_size == world)
    if per_node is not None:
        stmt = stmt.where(HardwareRow.ranks_per_node == per_node)
    return stmt


# -------------------------------------------------------------------------------------------- plans
def request_key(
    trace_hash: str,
    constraints: Constraints,
    objective: Objective,
    solver: str,
    solver_version: str,
    process_group: tuple[int, int] = (1, 1),
) -> str:
    """The plan cache key of a request. A multi-rank job's (world size, ranks per node) is part of it (the
    trace's hash differs already; the key says so outright); single-process keys are what they were."""
    parts: list[Any] = [
        trace_hash,
        constraints.model_dump(mode="json"),
        objective.value,
        solver,
        solver_version,
    ]
    if process_group != (1, 1):
        parts.append(list(process_group))
    blob = json.dumps(parts, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()


# What a plans list can be sorted by: the API's `sort` (with "-" for descending), the UI's columns, the CLI's
# `--sort`. "error" and "peak_error" are the latest feedback's |measured / predicted - 1| of the iteration
# time and the peak device memory; "iteration" and "peak" the predictions.
TEXT_PLAN_SORT_KEYS = ("model", "hardware", "workload", "status", "solver")
NUMERIC_PLAN_SORT_KEYS = ("iteration", "peak", "device_limit", "error", "peak_error")
PLAN_SORT_KEYS = ("created_at", *TEXT_PLAN_SORT_KEYS, *NUMERIC_PLAN_SORT_KEYS)
MAX_SEARCH_CHARS = 200
MAX_SEARCH_TERMS = 8


@dataclass(frozen=True)
class PlanListRow:
    """A plan of a list, with its latest feedback's relative errors (measured / predicted - 1; None: none)."""

    plan: PlanRow
    iteration_error: float | None
    peak_device_error: float | None


def search_terms(search: str | None) -> list[str]:
    """The words of a free-text search, lower-cased: a plan matches when every word is found in its model name,
    hardware key, workload, a feedback note, or starts its id or its model's fingerprint. Raises ValueError
    naming `search` for a NUL, more than MAX_SEARCH_CHARS characters or MAX_SEARCH_TERMS words."""
    if not search:
        return []
    if "\x00" in search:
        raise ValueError("search: must not contain a NUL character")
    if len(search) > MAX_SEARCH_CHARS:
        raise ValueError(f"search: longer than {MAX_SEARCH_CHARS} characters")
    terms = search.lower().split()
    if len(terms) > MAX_SEARCH_TERMS:
        raise ValueError(f"search: more than {MAX_SEARCH_TERMS} words")
    return terms


def _matches(term: str) -> ColumnElement[bool]:
    """One search word, found anywhere (LIKE wildcards in it escaped: a '%' matches a '%')."""
    notes = (
        select(FeedbackRow.id)
        .where(
            FeedbackRow.plan_id == PlanRow.id, func.lower(FeedbackRow.notes).contains(term, autoescape=True)
        )
        .correlate(PlanRow)
        .exists()
    )
    return or_(
        func.lower(ModelRow.name).contains(term, autoescape=True),
        func.lower(PlanRow.hardware_key).contains(term, autoescape=True),
        func.lower(PlanRow.workload_key).contains(term, autoescape=True),
        PlanRow.id.startswith(term, autoescape=True),
        func.lower(PlanRow.model_fingerprint).startswith(term, autoescape=True),
        notes,
    )


def _latest_feedback(column: Any) -> Any:
    """`column` of the plan's latest feedback (None without feedback), as a correlated scalar subquery."""
    return (
        select(column)
        .where(FeedbackRow.plan_id == PlanRow.id)
        .order_by(FeedbackRow.created_at.desc(), FeedbackRow.id.desc())
        .limit(1)
        .correlate(PlanRow)
        .scalar_subquery()
    )


def _sort_expression(sort_key: str, iteration_error: Any, peak_error: Any) -> Any:
    if sort_key == "model":
        return ModelRow.name
    if sort_key in ("hardware", "workload"):
        return getattr(PlanRow, f"{sort_key}_key")
    if sort_key in ("status", "solver"):
        return getattr(PlanRow, sort_key)
    if sort_key == "iteration":
        return PlanRow.headline[("predictions", "iteration_s")].as_float()
    if sort_key == "peak":
        return PlanRow.headline[("predictions", "peak_device_bytes")].as_float()
    if sort_key == "device_limit":
        return PlanRow.constraints[("device_memory_bytes",)].as_float()
    if sort_key == "error":
        return func.abs(iteration_error)
    if sort_key == "peak_error":
        return func.abs(peak_error)
    raise ValueError(f"sort: {sort_key!r} is not one of {', '.join(PLAN_SORT_KEYS)}")


class PlanRepository:
    def __init__(self, session: Session) -> None:
        self.s = session

    def get(self, plan_id: str, project_id: str | None = None) -> PlanRow | None:
        """A plan by id (with its model and feedback, in one query); with `project_id`, only if it is theirs."""
        stmt = (
            select(PlanRow)
            .where(PlanRow.id == plan_id)
            .options(joinedload(PlanRow.model), joinedload(PlanRow.feedback))
        )
        if project_id is not None:
            stmt = stmt.where(PlanRow.project_id == project_id)
        return self.s.execute(stmt).unique().scalar_one_or_none()

    def get_raw(self, plan_id: str, project_id: str) -> tuple[PlanRow, str | None] | None:
        """A plan with its model and feedback, and its stored Plan as the JSON text the database holds (not
        parsed: a plan with 10^5 buffer offsets is passed through, not decoded and encoded again)."""
        stmt = (
            select(PlanRow, cast(PlanRow.result, Text))
            .where(PlanRow.id == plan_id, PlanRow.project_id == project_id)
            .options(defer(PlanRow.result), joinedload(PlanRow.model), selectinload(PlanRow.feedback))
        )
        found = self.s.execute(stmt).first()
        if found is None:
            return None
        row, raw = found
        return row, None if raw in (None, "null") else raw

    def reusable(self, project_id: str, key: str) -> PlanRow | None:
        """An earlier identical request of the project that is queued, running or finished (not failed)."""
        return self.s.scalar(
            select(PlanRow)
            .where(
                PlanRow.project_id == project_id,
                PlanRow.request_key == key,
                PlanRow.status.in_(REUSABLE_STATUSES),
            )
            .order_by(PlanRow.created_at)
            .limit(1)
        )

    def _request_key(
        self,
        trace: TraceRow,
        constraints: Constraints,
        objective: Objective,
        solver: str,
        solver_version: str,
    ) -> str:
        group = TraceRepository(self.s).process_group(trace)
        return request_key(trace.content_hash, constraints, objective, solver, solver_version, group)

    def reusable_or_new(
        self,
        trace: TraceRow,
        constraints: Constraints,
        objective: Objective,
        solver: str,
        solver_version: str,
    ) -> tuple[PlanRow, bool]:
        """The project's plan for this request: an identical earlier one that did not fail (`False`), else a new
        queued one (`True`). Of identical requests at once, the unique index on the keys of plans that did not
        fail (`uq_plan_request`) lets one insert; the others' flush raises `IntegrityError`, and the caller
        rolls the transaction back and asks again (`once_more_on_conflict`), finding the winner's."""
        key = self._request_key(trace, constraints, objective, solver, solver_version)
        existing = self.reusable(trace.project_id, key)
        if existing is not None:
            return existing, False
        return self.create(trace, constraints, objective, solver, solver_version, key=key), True

    def create(
        self,
        trace: TraceRow,
        constraints: Constraints,
        objective: Objective,
        solver: str,
        solver_version: str,
        *,
        key: str | None = None,
    ) -> PlanRow:
        """A new queued plan of the request (`key`: its request key, when the caller has it already)."""
        if key is None:
            key = self._request_key(trace, constraints, objective, solver, solver_version)
        row = PlanRow(
            trace_id=trace.id,
            project_id=trace.project_id,
            model_fingerprint=trace.model_fingerprint,
            hardware_key=trace.hardware_key,
            workload_key=trace.workload_key,
            request_key=key,
            solver=solver,
            solver_version=solver_version,
            status=PlanStatus.queued.value,
            constraints=constraints.model_dump(mode="json"),
            objective=objective.value,
            attempts=0,
            created_at=utcnow(),
        )
        self.s.add(row)
        self.s.flush()
        return row

    def list(
        self,
        *,
        project_id: str,
        model: str | None,
        hardware: str | None,
        status: str | None,
        limit: int,
        cursor: str | None,
        descending: bool = True,
        with_result: bool = False,
        id_prefix: str | None = None,
        sort_key: str = "created_at",
        search: str | None = None,
        world_size: int | None = None,
        ranks_per_node: int | None = None,
    ) -> PageResult[PlanListRow]:
        """A page of plans with their models and their latest measured errors, filtered, searched
        (`search_terms`) and sorted by `sort_key` (one of `PLAN_SORT_KEYS`; nulls last, then the id), of jobs of the process
        group `world_size` / `ranks_per_node` if given; the
        stored Plans (megabytes each) only `with_result`."""
        if sort_key not in PLAN_SORT_KEYS:
            raise ValueError(f"sort: {sort_key!r} is not one of {', '.join(PLAN_SORT_KEYS)}")
        iteration_error = _latest_feedback(FeedbackRow.iteration_error)
        peak_error = _latest_feedback(FeedbackRow.peak_device_error)
        stmt = (
            select(PlanRow, iteration_error, peak_error)
            .join(
                ModelRow,
                (ModelRow.project_id == PlanRow.project_id)
                & (ModelRow.fingerprint == PlanRow.model_fingerprint),
            )
            .where(PlanRow.project_id == project_id)
            .options(contains_eager(PlanRow.model), *((undefer(PlanRow.result),) if with_result else ()))
        )
        if model:
            stmt = stmt.where(or_(PlanRow.model_fingerprint == model, ModelRow.name == model))
        if hardware:
            stmt = stmt.where(PlanRow.hardware_key == hardware)
        if status:
            stmt = stmt.where(PlanRow.status == status)
        if id_prefix:
            stmt = stmt.where(PlanRow.id.startswith(id_prefix, autoescape=True))
        stmt = _by_process_group(stmt, PlanRow, world_size, ranks_per_node)
        for term in search_terms(search):
            stmt = stmt.where(_matches(term))
        if sort_key == "created_at":
            if cursor:
                stmt = stmt.where(after(PlanRow.created_at, PlanRow.id, cursor, descending))
            order: tuple[Any, ...] = (
                (PlanRow.created_at.desc(), PlanRow.id.desc())
                if descending
                else (PlanRow.created_at, PlanRow.id)
            )
            expr = None
        else:
            expr = _sort_expression(sort_key, iteration_error, peak_error)
            stmt = stmt.add_columns(expr)
            if cursor:
                value, row_id = decode_sort_cursor(cursor, sort_key, sort_key in NUMERIC_PLAN_SORT_KEYS)
                stmt = stmt.where(after_sorted(expr, PlanRow.id, value, row_id, descending))
            order = sort_order(expr, PlanRow.id, descending)
        found = list(self.s.execute(stmt.order_by(*order).limit(limit + 1)))
        more = len(found) > limit
        found = found[:limit]
        items = [PlanListRow(r[0], r[1], r[2]) for r in found]
        nxt = None
        if more and found:
            last = found[-1]
            if expr is None:
                nxt = encode_cursor(last[0].created_at, last[0].id)
            else:
                value = last[3]
                nxt = encode_sort_cursor(
                    sort_key,
                    None if value is None else (value if isinstance(value, str) else float(value)),
                    last[0].id,
                )
        return PageResult(items, nxt)

    # the solve job's writes: each changes the row only from the state the caller read (compare-and-set), so a
    # worker presumed lost that comes back late cannot overwrite the attempt that replaced it
    def progress(self, plan_id: str) -> tuple[str, int] | None:
        """(status, attempts) of the plan, or None if it is gone."""
        row = self.s.execute(select(PlanRow.status, PlanRow.attempts).where(PlanRow.id == plan_id)).first()
        return None if row is None else (row.status, row.attempts)

    def claim(self, plan_id: str, status: str, attempts: int) -> bool:
        """Mark the plan running attempt `attempts + 1`, if it is still at (`status`, `attempts`)."""
        res = self.s.execute(
            update(PlanRow)
            .where(PlanRow.id == plan_id, PlanRow.status == status, PlanRow.attempts == attempts)
            .values(
                status=PlanStatus.running.value, attempts=attempts + 1, started_at=utcnow(), finished_at=None
            )
        )
        return res.rowcount == 1  # type: ignore[attr-defined]

    def fail_if(self, plan_id: str, statuses: Sequence[str], error: str) -> bool:
        """Fail the plan with `error`, if its status is one of `statuses`."""
        res = self.s.execute(
            update(PlanRow)
            .where(PlanRow.id == plan_id, PlanRow.status.in_(tuple(statuses)))
            .values(status=PlanStatus.failed.value, finished_at=utcnow(), error=error)
        )
        return res.rowcount == 1  # type: ignore[attr-defined]

    def finish_attempt(
        self, plan_id: str, attempt: int, status: PlanStatus, result: dict[str, Any] | None, error: str | None
    ) -> bool:
        """Write attempt `attempt`'s outcome, if the plan is still running that attempt."""
        res = self.s.execute(
            update(PlanRow)
            .where(
                PlanRow.id == plan_id, PlanRow.status == PlanStatus.running.value, PlanRow.attempts == attempt
            )
            .values(
                status=status.value,
                result=result,
                headline=plan_headline(result),
                error=error,
                finished_at=utcnow() if status.final else None,
            )
        )
        return res.rowcount == 1  # type: ignore[attr-defined]

    def replace_allocation(self, plan_id: str, project_id: str, allocation: dict[str, Any]) -> PlanRow | None:
        """Store `allocation` as the `done` plan's allocation and count a revision; None (nothing written) if
        the plan is not the project's or not done. The row is locked for the read-modify-write."""
        row = self.s.scalar(
            select(PlanRow)
            .where(PlanRow.id == plan_id, PlanRow.project_id == project_id)
            .options(undefer(PlanRow.result))
            .with_for_update()
        )
        if row is None or row.status != PlanStatus.done.value or row.result is None:
            return None
        row.result = {**row.result, "allocation": allocation}
        row.revision = (row.revision or 0) + 1
        self.s.flush()
        return row

    def solve_inputs(self, plan_id: str) -> tuple[bytes | None, dict[str, Any]]:
        """The plan's stored trace (gzip bytes; None if gone) and its request's fields, as stored."""
        plan = self.s.get(PlanRow, plan_id)
        if plan is None:
            raise LookupError(f"plan {plan_id} is gone")
        payload = self.s.scalar(select(TraceRow.payload_gzip).where(TraceRow.id == plan.trace_id))
        return payload, {
            "trace_id": plan.trace_id,
            "constraints": plan.constraints,
            "objective": plan.objective,
            "solver": plan.solver,
        }

    def queue_depth(self) -> int:
        return int(
            self.s.scalar(
                select(func.count()).select_from(PlanRow).where(PlanRow.status == PlanStatus.queued.value)
            )
            or 0
        )


# ----------------------------------------------------------------------------------------- feedback
def relative_error(measured: float, predicted: float | None) -> float | None:
    if predicted is None or predicted <= 0:
        return None
    return measured / predicted - 1.0


class FeedbackRepository:
    def __init__(self, session: Session) -> None:
        self.s = session

    def add(self, plan: PlanRow, feedback: Feedback) -> FeedbackRow:
        head = PlanHeadline.model_validate(plan.headline) if plan.headline else None
        predicted = head.predictions if head else None
        # the phases are checked against the whole predictions (their breakdown: the headline has none), read
        # only when the feedback has phases (the stored plan is deferred: megabytes with an allocation)
        whole = plan.result.get("predictions") if feedback.phases is not None and plan.result else None
        row = FeedbackRow(
            plan_id=plan.id,
            iteration_s=feedback.iteration_s,
            peak_device_bytes=feedback.peak_device_bytes,
            peak_host_bytes=feedback.peak_host_bytes,
            steps_measured=feedback.steps_measured,
            notes=feedback.notes,
            iteration_error=relative_error(
                feedback.iteration_s, predicted.iteration_s if predicted else None
            ),
            peak_device_error=relative_error(
                feedback.peak_device_bytes, predicted.peak_device_bytes if predicted else None
            ),
            phases=feedback.phases.model_dump(mode="json") if feedback.phases else None,
            phase_errors=feedback.phases.errors(Predictions.model_validate(whole))
            if feedback.phases and whole
            else None,
            created_at=utcnow(),
        )
        self.s.add(row)
        self.s.flush()
        return row

    def counts(self, plan_ids: Sequence[str]) -> dict[str, int]:
        """How many feedback reports each of these plans has (plans without any are absent)."""
        if not plan_ids:
            return {}
        stmt = (
            select(FeedbackRow.plan_id, func.count())
            .where(FeedbackRow.plan_id.in_(plan_ids))
            .group_by(FeedbackRow.plan_id)
        )
        return {pid: int(n) for pid, n in self.s.execute(stmt)}


# ----------------------------------------------------------------------------------------- projects, tokens
class AccessRepository:
    """Projects and their API tokens (the rules, token generation and digests, are `planner_service.auth`'s)."""

    def __init__(self, session: Session) -> None:
        self.s = session

    def project_named(self, name: str) -> ProjectRow | None:
        return self.s.scalar(select(ProjectRow).where(ProjectRow.name == name))

    def add(self, row: ProjectRow | ApiTokenRow) -> None:
        self.s.add(row)
        self.s.flush()

    def token(self, token_id: str) -> ApiTokenRow | None:
        return self.s.get(ApiTokenRow, token_id)

    def live_token(self, token_digest: str) -> ApiTokenRow | None:
        """The unrevoked token with this digest, if any."""
        return self.s.scalar(
            select(ApiTokenRow).where(ApiTokenRow.digest == token_digest, ApiTokenRow.revoked_at.is_(None))
        )


# ----------------------------------------------------------------------------------------- catalog
class CatalogRepository:
    def __init__(self, session: Session) -> None:
        self.s = session

    def models(self, project_id: str) -> list[tuple[ModelRow, int, int]]:
        """Models the project has traces of (other projects' models are invisible), with counts."""
        traces = (
            select(TraceRow.model_fingerprint, func.count().label("n"))
            .where(TraceRow.project_id == project_id)
            .group_by(TraceRow.model_fingerprint)
            .subquery()
        )
        plans = (
            select(PlanRow.model_fingerprint, func.count().label("n"))
            .where(PlanRow.project_id == project_id)
            .group_by(PlanRow.model_fingerprint)
            .subquery()
        )
        stmt = (
            select(ModelRow, traces.c.n, func.coalesce(plans.c.n, 0))
            .where(ModelRow.project_id == project_id)
            .join(traces, traces.c.model_fingerprint == ModelRow.fingerprint)
            .outerjoin(plans, plans.c.model_fingerprint == ModelRow.fingerprint)
            .order_by(ModelRow.name, ModelRow.fingerprint)
        )
        return [(m, int(t), int(p)) for m, t, p in self.s.execute(stmt)]

    def hardware(self, project_id: str) -> list[tuple[HardwareRow, int, int]]:
        """Hardware the project has traces from, with counts."""
        traces = (
            select(TraceRow.hardware_key, func.count().label("n"))
            .where(TraceRow.project_id == project_id)
            .group_by(TraceRow.hardware_key)
            .subquery()
        )
        plans = (
            select(PlanRow.hardware_key, func.count().label("n"))
            .where(PlanRow.project_id == project_id)
            .group_by(PlanRow.hardware_key)
            .subquery()
        )
        stmt = (
            select(HardwareRow, traces.c.n, func.coalesce(plans.c.n, 0))
            .where(HardwareRow.project_id == project_id)
            .join(traces, traces.c.hardware_key == HardwareRow.key)
            .outerjoin(plans, plans.c.hardware_key == HardwareRow.key)
            .order_by(HardwareRow.key)
        )
        return [(h, int(t), int(p)) for h, t, p in self.s.execute(stmt)]
