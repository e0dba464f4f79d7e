"""One error shape for every failure: `{"error": "...", "detail": ...}`; validation errors name field paths."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any
from urllib.parse import urlencode

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, RedirectResponse, Response
from pydantic import ValidationError
from sqlalchemy.exc import OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from client.contract import ErrorBody
from client.contract.common import NO_NUL_MESSAGE, NO_NUL_PATTERN

ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorBody, "description": text}
    for code, text in {
        400: "malformed request (JSON; plain text when the HTTP server cannot parse the request: a request line "
        "of about 64 KiB or more)",
        401: "missing or invalid token",
        404: "not found (or not yours)",
        409: "conflict with the object's state",
        413: "body too large",
        415: "unsupported content encoding",
        422: "validation failed: `detail` lists field paths",
        429: "rate limited: see Retry-After",
        503: "unavailable (the database, or an ingest process that died): retry",
    }.items()
}
# A request the HTTP server cannot parse (a request line of about 64 KiB or more: the fuzz tests sent a 270 KB
# cursor) is refused by uvicorn before the app sees it, with a plain-text 400 ("Invalid HTTP request received.");
# the document lists that content type beside the JSON error body, as it is what a client gets.
ERROR_RESPONSES[400]["content"] = {"text/plain": {"schema": {"type": "string"}}}


class ApiError(Exception):
    def __init__(
        self, status: int, error: str, detail: Any = None, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(error)
        self.status, self.error, self.detail, self.headers = status, error, detail, headers


def field_path(loc: Sequence[int | str]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out or "(root)"


def _message(error: Any) -> str:
    """pydantic's message, except for the contract's no-NUL rule, which says what is wrong in words."""
    if error["type"] == "string_pattern_mismatch" and NO_NUL_PATTERN in error["msg"]:
        return NO_NUL_MESSAGE
    return str(error["msg"])


def validation_detail(errors: Sequence[Any], prefix: Sequence[str | int] = ()) -> list[dict[str, str]]:
    return [
        {"field": field_path([*prefix, *e["loc"]]), "message": _message(e), "type": e["type"]} for e in errors
    ]


def _allowed_methods(request: Request) -> set[str]:
    """Methods of every route whose path matches (Starlette reports PARTIAL for a path match, wrong method)."""
    methods: set[str] = set()
    for route in request.app.router.routes:
        if route.matches(request.scope)[0] != Match.NONE:
            methods |= set(getattr(route, "methods", None) or ())
    return methods


def install(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> Response:
        if exc.status == 401 and request.url.path.startswith("/ui/"):  # a person at a browser: log in first
            return RedirectResponse(f"/ui/login?{urlencode({'next': request.url.path})}", status_code=303)
        return JSONResponse(
            {"error": exc.error, "detail": exc.detail}, status_code=exc.status, headers=exc.headers
        )

    @app.exception_handler(RequestValidationError)
    async def _request_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        if any(e["type"] == "json_invalid" for e in errors):
            # a body that is not JSON at all is malformed (400), as `POST /v1/traces` says it; 422 is for JSON
            # that does not fit the contract (FastAPI answers 422 for both)
            return JSONResponse(
                {"error": "body is not valid JSON", "detail": validation_detail(errors)}, status_code=400
            )
        return JSONResponse(
            {"error": "validation failed", "detail": validation_detail(errors)}, status_code=422
        )

    @app.exception_handler(ValidationError)
    async def _model_validation(_: Request, exc: ValidationError) -> JSONResponse:
        return JSONResponse(
            {"error": "validation failed", "detail": validation_detail(exc.errors(), ("body",))},
            status_code=422,
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        headers = dict(getattr(exc, "headers", None) or {})
        if exc.status_code == 405:  # list the methods of every route on this path, not just the first one
            headers["Allow"] = ", ".join(sorted(_allowed_methods(request)))
        return JSONResponse(
            {"error": str(exc.detail), "detail": None}, status_code=exc.status_code, headers=headers or None
        )

    @app.exception_handler(OperationalError)
    async def _db_down(_: Request, exc: OperationalError) -> JSONResponse:
        return JSONResponse(
            {"error": "database unavailable, retry later", "detail": None},
            status_code=503,
            headers={"Retry-After": "1"},
        )

    @app.exception_handler(PoolTimeout)
    async def _db_busy(_: Request, exc: PoolTimeout) -> JSONResponse:
        return JSONResponse(
            {"error": "no database connection free in time, retry later", "detail": None},
            status_code=503,
            headers={"Retry-After": "1"},
        )
