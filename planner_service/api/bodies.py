"""Reading request bodies safely: size limit (413), gzip with a decompressed-size limit, JSON parsing."""

from __future__ import annotations

import zlib
from dataclasses import dataclass

from fastapi import Request

from planner_service.api.errors import ApiError
from planner_service.settings import Settings


@dataclass(frozen=True)
class Body:
    """A request body within the size limit: JSON text, or the gzip bytes as received (inflated later,
    by whoever parses it, under `max_decompressed_bytes`)."""

    data: bytes
    gzipped: bool


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
    if encoding not in ("gzip", "identity", ""):
        raise ApiError(415, f"content-encoding {encoding!r} not supported (use gzip or none)")
    return Body(data=body, gzipped=encoding == "gzip")


class BadGzip(ValueError):
    """Not gzip, or truncated (400)."""


class GzipTooLarge(ValueError):
    """Inflates beyond the limit (413)."""


def gunzip_limited(data: bytes, limit: int) -> bytes:
    """Decompress gzip without ever holding more than `limit` bytes (gzip-bomb safe). Picklable errors:
    it also runs in the ingest processes."""
    d = zlib.decompressobj(16 + zlib.MAX_WBITS)
    try:
        out = d.decompress(data, limit + 1)
    except zlib.error as exc:
        raise BadGzip(f"body is not valid gzip: {exc}") from None
    if len(out) > limit or d.unconsumed_tail:
        raise GzipTooLarge(f"decompressed body larger than {limit} bytes")
    if not d.eof:
        raise BadGzip("body is truncated gzip")
    return out
