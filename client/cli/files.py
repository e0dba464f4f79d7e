"""Reading the JSON files a person passes to a command: a file of the wrong kind (a plan where a trace is
wanted) is named in one line, not answered with dozens of validation errors."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

M = TypeVar("M", bound=BaseModel)
_ERRORS_SHOWN = 8


@dataclass(frozen=True)
class FileKind:
    name: str  # "a Trace"
    keys: frozenset[str]  # top-level fields that only this kind has all of
    made_by: str  # where such a file comes from


# Most specific first: a record's keys are a superset of nothing else listed here.
KINDS = (
    FileKind(
        "a Trace",
        frozenset({"hardware", "model", "workload", "measurements"}),
        "`memplan profile -o`, `agent.profile` or `memplan traces get -o`",
    ),
    FileKind(
        "a Plan",
        frozenset({"trace_hash", "solver", "constraints"}),
        "`memplan plans solve -o` or `memplan plans get -o`",
    ),
    FileKind(
        "a plan record (the API's answer for a plan)",
        frozenset({"trace_id", "status", "constraints"}),
        "GET /v1/plans/{id}",
    ),
    FileKind(
        "a trace record (the API's answer for a trace)",
        frozenset({"trace", "content_hash"}),
        "GET /v1/traces/{id}; its `trace` field is the Trace",
    ),
    FileKind("Feedback", frozenset({"iteration_s", "steps_measured"}), "the agent's measurements of a plan"),
    FileKind("an AllocationTrace", frozenset({"source", "horizon"}), "a Trace's `allocation_trace` field"),
)
TRACE, PLAN, ALLOCATION_TRACE = KINDS[0], KINDS[1], KINDS[5]


class WrongFile(Exception):
    """The file cannot be read as the kind wanted; the message is one line (plus capped validation errors)."""


def identify(data: Any) -> FileKind | None:
    if not isinstance(data, dict):
        return None
    return next((k for k in KINDS if k.keys <= data.keys()), None)


def read_json(path: Path) -> Any:
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise WrongFile(f"{path}: cannot read it ({exc})") from exc
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise WrongFile(f"{path} is not JSON ({exc})") from exc


def describe(data: Any) -> str:
    """What the JSON value is, in a few words."""
    kind = identify(data)
    if kind is not None:
        return f"{kind.name} (made by {kind.made_by})"
    if isinstance(data, dict):
        keys = ", ".join(sorted(data)[:8]) + (" ..." if len(data) > 8 else "")
        return f"a JSON object with fields {keys or '(none)'}"
    return f"a JSON {type(data).__name__.replace('dict', 'object').replace('str', 'string')}"


def parse_as(path: Path, data: Any, model: type[M], wanted: FileKind) -> M:
    """`data` validated as `model`. A file of another kind (or of no kind) gets one line naming what it is."""
    kind = identify(data)
    if kind is not wanted:
        missing = ", ".join(sorted(wanted.keys - data.keys())) if isinstance(data, dict) else ""
        why = f"; {wanted.name} has {missing}" if missing and kind is None else ""
        raise WrongFile(f"{path} is {describe(data)}, not {wanted.name}{why}")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        shown = "\n".join(
            f"  {'.'.join(str(p) for p in e['loc']) or '(top)'}: {e['msg']}" for e in errors[:_ERRORS_SHOWN]
        )
        more = f"\n  ... and {len(errors) - _ERRORS_SHOWN} more" if len(errors) > _ERRORS_SHOWN else ""
        raise WrongFile(
            f"{path} is {wanted.name} with {len(errors)} invalid field"
            f"{'s' if len(errors) != 1 else ''}:\n{shown}{more}"
        ) from exc


def read_as(path: Path, model: type[M], wanted: FileKind) -> M:
    return parse_as(path, read_json(path), model, wanted)
