"""One exception class per kind of failure, all under `MemplanError`."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pydantic

__all__ = [
    "first_problem",
    "APIConnectionError",
    "APIStatusError",
    "APITimeoutError",
    "AuthenticationError",
    "BadRequestError",
    "ConflictError",
    "InternalServerError",
    "MemplanError",
    "NotFoundError",
    "PayloadTooLargeError",
    "PermissionDeniedError",
    "RateLimitError",
    "ServiceUnavailableError",
    "UnexpectedResponseError",
    "UnprocessableEntityError",
    "error_for_status",
    "service_root",
]


class MemplanError(Exception):
    """Base of every error the SDK raises."""


class APIConnectionError(MemplanError):
    """The service could not be reached (after retries)."""


class APITimeoutError(APIConnectionError):
    """The service did not answer in time (after retries)."""


class UnexpectedResponseError(MemplanError):
    """The service answered something this client cannot read: a body that is not the expected JSON (an HTML
    login page, a proxy's error, a record of the wrong shape), or a status the request cannot get (a 304 to a
    request without If-None-Match, a redirect). A service or proxy fault, never the caller's."""

    def __init__(self, message: str, *, status_code: int) -> None:
        super().__init__(f"{status_code}: {message}")
        self.status_code = status_code


class APIStatusError(MemplanError):
    """The service answered with an error status."""

    status_code: int = 0

    def __init__(self, message: str, *, status_code: int, body: Any = None) -> None:
        super().__init__(f"{status_code}: {message}")
        self.status_code = status_code
        self.body = body
        self.detail = body.get("detail") if isinstance(body, dict) else None


class BadRequestError(APIStatusError): ...


class AuthenticationError(APIStatusError): ...


class PermissionDeniedError(APIStatusError): ...


class NotFoundError(APIStatusError):
    @property
    def no_such_route(self) -> bool:
        """The 404 is for the path itself, not for a plan or trace: the base URL is not the memplan service's
        root (e.g. it ends in /v1, or is another server). memplan's own 404s name what is missing; a route
        miss says only "Not Found", and another server's page is not memplan's JSON."""
        return not (
            isinstance(self.body, dict) and str(self.body.get("error", "")).lower() not in ("", "not found")
        )


def service_root(url: str) -> str:
    """`scheme://host:port` of `url`: what to pass as the service URL when `url` has a path."""
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, "", "", ""))


class ConflictError(APIStatusError): ...


class PayloadTooLargeError(APIStatusError): ...


class UnprocessableEntityError(APIStatusError): ...


class RateLimitError(APIStatusError): ...


class InternalServerError(APIStatusError): ...


class ServiceUnavailableError(InternalServerError): ...


_BY_STATUS: dict[int, type[APIStatusError]] = {
    400: BadRequestError,
    401: AuthenticationError,
    403: PermissionDeniedError,
    404: NotFoundError,
    409: ConflictError,
    413: PayloadTooLargeError,
    422: UnprocessableEntityError,
    429: RateLimitError,
    503: ServiceUnavailableError,
}


def error_for_status(status: int, body: Any) -> APIStatusError:
    cls = _BY_STATUS.get(status) or (InternalServerError if status >= 500 else APIStatusError)
    message = body.get("error", "") if isinstance(body, dict) else str(body)[:500]
    if isinstance(body, dict) and isinstance(body.get("detail"), list):
        fields = "; ".join(
            f"{d.get('field')}: {d.get('message')}" for d in body["detail"][:5] if isinstance(d, dict)
        )
        if fields:
            message = f"{message} ({fields})"
    return cls(message, status_code=status, body=body)


def first_problem(exc: pydantic.ValidationError, root: str) -> str:
    """'where: what' of a validation error's first problem (`root` names the top level when it has no path)."""
    first = exc.errors()[0]
    return f"{'.'.join(str(x) for x in first['loc']) or root}: {first['msg']}"
