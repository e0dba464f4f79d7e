"""Reading request bodies safely: size limit (413), gzip with a decompressed-size limit, JSON parsing."""

from __future__ import annotations

import json
import zlib
from typing import Any

from fastapi import Request

from planner_service.api.errors import ApiError
from planner_service.settings import Settings


async def read_json(request: Request, settings: Settings) -> Any:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > settings.max_body_bytes:
        raise ApiError(413, f"request body larger than {settings.max_body_bytes} bytes")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > settings.max_body_bytes:
            raise ApiError(413, f"request body larger than {settings.max_body_bytes} bytes")
        chunks.append(chunk)
    body = b"".join(chunks)
    encoding = request.headers.get("content-encoding", "identity").lower()
    if encoding == "gzip":
        body = gunzip_limited(body, settings.max_decompressed_bytes)
    elif encoding not in ("identity", ""):
        raise ApiError(415, f"content-encoding {encoding!r} not supported (use gzip or none)")
    try:
        return json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ApiError(400, f"body is not valid JSON: {exc}") from exc


def gunzip_limited(data: bytes, limit: int) -> bytes:
    """Decompress gzip without ever holding more than `limit` bytes (gzip-bomb safe)."""
    d = zlib.decompressobj(16 + zlib.MAX_WBITS)
    try:
        out = d.decompress(data, limit + 1)
    except zlib.error as exc:
        raise ApiError(400, f"body is not valid gzip: {exc}") from exc
    if len(out) > limit or d.unconsumed_tail:
        raise ApiError(413, f"decompressed body larger than {limit} bytes")
    if not d.eof:
        raise ApiError(400, "body is truncated gzip")
    return out
