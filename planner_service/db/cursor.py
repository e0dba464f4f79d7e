"""Opaque cursors for keyset pagination on (created_at, id)."""

from __future__ import annotations

import base64
import json
from datetime import datetime
from typing import Any

from sqlalchemy import and_, or_
from sqlalchemy.sql.elements import ColumnElement


class BadCursor(ValueError):
    pass


def encode_cursor(created_at: datetime, row_id: str) -> str:
    raw = json.dumps([created_at.isoformat(), row_id]).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(cursor: str) -> tuple[datetime, str]:
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        at, row_id = json.loads(raw)
        return datetime.fromisoformat(at), str(row_id)
    except Exception as exc:  # any malformed cursor is the client's error
        raise BadCursor(f"cursor: not a cursor returned by this API ({cursor[:40]!r})") from exc


def after(created_col: Any, id_col: Any, cursor: str, descending: bool) -> ColumnElement[bool]:
    at, row_id = decode_cursor(cursor)
    if descending:
        return or_(created_col < at, and_(created_col == at, id_col < row_id))
    return or_(created_col > at, and_(created_col == at, id_col > row_id))
