"""One error shape for every failure: `{"error": "...", "detail": ...}`; validation errors name field paths."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from sqlalchemy.exc import OperationalError
from starlette.exceptions import HTTPException as StarletteHTTPException


class ApiError(Exception):
    def __init__(self, status: int, error: str, detail: Any = None, headers: dict[str, str] | None = None) -> None:
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


def validation_detail(errors: Sequence[Any], prefix: Sequence[str | int] = ()) -> list[dict[str, str]]:
    return [{"field": field_path([*prefix, *e["loc"]]), "message": e["msg"], "type": e["type"]} for e in errors]


def install(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse({"error": exc.error, "detail": exc.detail}, status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _request_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse({"error": "validation failed", "detail": validation_detail(exc.errors())}, status_code=422)

    @app.exception_handler(ValidationError)
    async def _model_validation(_: Request, exc: ValidationError) -> JSONResponse:
        return JSONResponse({"error": "validation failed", "detail": validation_detail(exc.errors(), ("body",))},
                            status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse({"error": str(exc.detail), "detail": None}, status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(OperationalError)
    async def _db_down(_: Request, exc: OperationalError) -> JSONResponse:
        return JSONResponse({"error": "database unavailable, retry later", "detail": None}, status_code=503,
                            headers={"Retry-After": "1"})
