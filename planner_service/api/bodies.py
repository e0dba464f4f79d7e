"""Reading request bodies safely: size limit (413), gzip with a decompressed-size limit, JSON parsing."""

from __future__ import annotations

import zlib
from dataclasses import dataclass

from fastapi import Request

from planner_service.api.errors import ApiError
from planner_service.settings import Settings


@dataclass(frozen=True)
class Body:
    raw: bytes  # the JSON text
    gzip: bytes | None  # the gzip body as received, when the client compressed it


async def read_body(request: Request, settings: Settings) -> Body:
    """The body within the size limits, gunzipped (bomb-safe) when Content-Encoding says gzip."""
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
        return Body(raw=gunzip_limited(body, settings.max_decompressed_bytes), gzip=body)
    if encoding not in ("identity", ""):
        raise ApiError(415, f"content-encoding {encoding!r} not supported (use gzip or none)")
    return Body(raw=body, gzip=None)


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
