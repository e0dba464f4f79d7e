"""Opaque cursors for keyset pagination on (created_at, id)."""

from __future__ import annotations

import base64
import json
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
