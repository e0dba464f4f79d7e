"""Every request body within `max_body_bytes` (413 beyond), before any route reads it.

The trace upload checks its own body as it streams it (`bodies.read_body`: gzip, a declared length). The other
routes take JSON that FastAPI reads whole and parses: a 400 MiB body to `POST /v1/plans` was read and parsed
before its 422 (the API process grew by 300 MB: session 19 probe), so a few such requests at once could exhaust
the server's memory. This ASGI middleware refuses a declared length over the limit at once, and counts a chunked
body as it arrives, answering 413 as soon as it passes the limit (the app is told the client left, and what it answers
then is dropped).
"""

from __future__ import annotations

import json
import re

import numpy as np
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from client.contract.trace import EVENT_DTYPES, MAX_ALLOCATION_EVENTS

ALLOCATION_ROUTE = re.compile(r"/v1/plans/[^/]+/allocation")
ALLOCATION_BODY_BYTES = (
    MAX_ALLOCATION_EVENTS * sum(np.dtype(d).itemsize for d in EVENT_DTYPES.values()) * 4 // 3 + 2**20
)
"""The largest managed allocation the contract admits, as the SDK sends it (uncompressed JSON, the events'
columns in base64: ~72 MiB at 2M events), plus room for the rest of the body: that route's limit when it is
above `max_body_bytes`."""


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limit_for(scope.get("path", ""))
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await self._refuse(send, limit)
            return
        seen = 0
        started = refused = False

        async def counted() -> Message:
            # past the limit: the 413 goes out now, and the app is told the client left (it stops reading;
            # whatever it answers then is dropped below)
            nonlocal seen, refused
            if refused:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    refused = True
                    if not started:
                        await self._refuse(send, limit)
                    return {"type": "http.disconnect"}
            return message

        async def tracked(message: Message) -> None:
            nonlocal started
            if refused:
                return
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, counted, tracked)
        except Exception:
            if not refused:
                raise  # (refused: the app's ClientDisconnect, or whatever it made of it, after the 413 went out)

    def limit_for(self, path: str) -> int:
        """`max_bytes`, or for a managed allocation the largest the contract admits when that is more."""
        if ALLOCATION_ROUTE.fullmatch(path):
            return max(self.max_bytes, ALLOCATION_BODY_BYTES)
        return self.max_bytes

    async def _refuse(self, send: Send, limit: int) -> None:
        body = json.dumps({"error": f"request body larger than {limit} bytes", "detail": None}).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
