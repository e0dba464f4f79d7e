"""Opaque cursors for keyset pagination on (created_at, id), or on (value, id) for lists sorted by a value."""

from __future__ import annotations

import base64
import json
import math
import re
from datetime import datetime
from typing import Any

from sqlalchemy import and_, or_
from sqlalchemy.sql.elements import ColumnElement


class BadCursor(ValueError):
    pass


def encode_cursor(created_at: datetime, row_id: str) -> str:
    raw = json.dumps([created_at.isoformat(), row_id]).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


MAX_CURSOR_CHARS = 200
_ROW_ID = re.compile(r"[0-9a-f]{1,64}")


def decode_cursor(cursor: str) -> tuple[datetime, str]:
    """The (created_at, id) a cursor stands for; anything else is `BadCursor` (400), never a database error:
    not base64 JSON, not a pair of strings, a naive or unparsable time, an id that is not one of ours."""
    try:
        if len(cursor) > MAX_CURSOR_CHARS:
            raise ValueError("too long")
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        at, row_id = json.loads(raw)
        if not isinstance(at, str) or not isinstance(row_id, str) or not _ROW_ID.fullmatch(row_id):
            raise ValueError("not a (time, id) pair")
        when = datetime.fromisoformat(at)
        if when.tzinfo is None or when.utcoffset() is None:
            raise ValueError("naive time")
        return when, row_id
    except Exception as exc:  # any malformed cursor is the client's error
        raise BadCursor(f"cursor: not a cursor returned by this API ({cursor[:40]!r})") from exc


def after(created_col: Any, id_col: Any, cursor: str, descending: bool) -> ColumnElement[bool]:
    at, row_id = decode_cursor(cursor)
    if descending:
        return or_(created_col < at, and_(created_col == at, id_col < row_id))
    return or_(created_col > at, and_(created_col == at, id_col > row_id))


# ------------------------------------------------------------------- cursors of lists sorted by another column
# A list sorted by a column other than created_at (a name, a prediction, a measured error) orders by
# (value IS NULL, value, id): rows without a value come last in both directions, the id breaks ties. Its cursor
# names the sort key it was made for, so a cursor of one sort is refused by another (400, not a wrong page).
MAX_SORT_CURSOR_CHARS = 4096  # the value may be a hardware key (600 characters) or a model name
SortValue = str | float | None


def encode_sort_cursor(sort_key: str, value: SortValue, row_id: str) -> str:
    raw = json.dumps([sort_key, value, row_id]).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_sort_cursor(cursor: str, sort_key: str, numeric: bool) -> tuple[SortValue, str]:
    """The (value, id) a cursor of the list sorted by `sort_key` stands for; anything else is `BadCursor`:
    another sort's cursor, a value of the wrong type (a number for a `numeric` key, a string otherwise; a NUL,
    NaN or infinity never reaches the database), an id that is not one of ours."""
    try:
        if len(cursor) > MAX_SORT_CURSOR_CHARS:
            raise ValueError("too long")
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        key, value, row_id = json.loads(raw)
        if key != sort_key:
            raise ValueError(f"a cursor of the list sorted by {key!r}")
        if not isinstance(row_id, str) or not _ROW_ID.fullmatch(row_id):
            raise ValueError("not an id")
        if value is not None:
            if numeric:
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                    raise ValueError("not a finite number")
                value = float(value)
            elif not isinstance(value, str) or "\x00" in value:
                raise ValueError("not a string")
        return value, row_id
    except Exception as exc:  # any malformed cursor is the client's error
        raise BadCursor(
            f"cursor: not a cursor returned by this API for sort {sort_key!r} ({cursor[:40]!r})"
        ) from exc


def sort_order(expr: Any, id_col: Any, descending: bool) -> tuple[Any, ...]:
    """ORDER BY of a list sorted by `expr`: nulls last, then the value, then the id."""
    if descending:
        return (expr.is_(None), expr.desc(), id_col.desc())
    return (expr.is_(None), expr, id_col)


def after_sorted(
    expr: Any, id_col: Any, value: SortValue, row_id: str, descending: bool
) -> ColumnElement[bool]:
    """Rows after (value, row_id) in `sort_order(expr, id_col, descending)`."""
    if value is None:
        return and_(expr.is_(None), id_col < row_id if descending else id_col > row_id)
    beyond = expr < value if descending else expr > value
    tie = and_(expr == value, id_col < row_id if descending else id_col > row_id)
    return or_(expr.is_(None), beyond, tie)
