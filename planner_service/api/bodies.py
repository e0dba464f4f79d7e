"""Reading request bodies safely: size limit (413), content encoding (gzip is inflated, bomb-safe, by
`planner_service.ingest.gunzip_limited` where the body is parsed)."""

from __future__ import annotations

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
