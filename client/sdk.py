"""HTTP SDK: paired `Client` / `AsyncClient` on httpx, with retries, typed responses and cursor-following lists."""

from __future__ import annotations

import asyncio
import gzip
import os
import random
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from email.utils import parsedate_to_datetime
from typing import Any, TypeVar

import httpx
from pydantic import BaseModel

from client.contract import (
    Constraints,
    Feedback,
    FeedbackRecord,
    HardwareSummary,
    ModelSummary,
    Page,
    PlanRecord,
    PlanRequest,
    Trace,
    TraceCreated,
    TraceRecord,
    TraceSummary,
)
from client.errors import APIConnectionError, APITimeoutError, MemplanError, error_for_status

M = TypeVar("M", bound=BaseModel)
DEFAULT_TIMEOUT_S = 30.0
DEFAULT_MAX_RETRIES = 2
RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
FINAL_STATUSES = frozenset({"done", "failed", "infeasible"})


def _base_url(base_url: str | None) -> str:
    url = base_url or os.environ.get("MEMPLAN_SERVER")
    if not url:
        raise MemplanError("no server: pass base_url=... or set MEMPLAN_SERVER (e.g. http://127.0.0.1:8000)")
    return url.rstrip("/")


def _headers(token: str | None) -> dict[str, str]:
    token = token or os.environ.get("MEMPLAN_TOKEN")
    headers = {"user-agent": "memplan-client/0.1.0", "accept": "application/json"}
    if token:
        headers["authorization"] = f"Bearer {token}"
    return headers


def retry_delay(attempt: int, response: httpx.Response | None, *, base_s: float = 0.5, cap_s: float = 8.0) -> float:
    """Exponential backoff with full jitter; a server's Retry-After (seconds or date) wins when given."""
    if response is not None:
        after = response.headers.get("retry-after")
        if after:
            try:
                return min(cap_s * 4, max(0.0, float(after)))
            except ValueError:
                try:
                    return min(cap_s * 4, max(0.0, parsedate_to_datetime(after).timestamp() - time.time()))
                except (TypeError, ValueError):
                    pass
    return random.uniform(0, min(cap_s, base_s * 2**attempt))


def _decode(response: httpx.Response) -> Any:
    try:
        return response.json()
    except ValueError:
        return response.text


def _check(response: httpx.Response) -> Any:
    body = _decode(response)
    if response.status_code >= 400:
        raise error_for_status(response.status_code, body)
    return body


class PlanCache:
    """Plan records by id with their entity tags (bounded, least recently used first out), so that polling a
    plan that has not changed is answered 304 without a body. Records returned are shared: do not mutate."""

    def __init__(self, size: int = 64) -> None:
        self.size = size
        self._items: OrderedDict[str, tuple[str, PlanRecord]] = OrderedDict()

    def forget(self, plan_id: str) -> None:
        """Drop the copy of a plan this client just changed (feedback): the next read fetches the record
        instead of trusting a 304, which a server that has not yet heard of the change could still give."""
        self._items.pop(plan_id, None)

    def headers(self, plan_id: str) -> dict[str, str]:
        hit = self._items.get(plan_id)
        return {"if-none-match": hit[0]} if hit else {}

    def resolve(self, plan_id: str, response: httpx.Response) -> PlanRecord | None:
        """The record a response stands for; None for a 304 about a copy this cache no longer holds."""
        if response.status_code == 304:
            hit = self._items.get(plan_id)
            if hit is None:
                return None
            self._items.move_to_end(plan_id)
            return hit[1]
        record = PlanRecord.model_validate(_check(response))
        etag = response.headers.get("etag")
        if etag:
            self._items[plan_id] = (etag, record)
            self._items.move_to_end(plan_id)
            while len(self._items) > self.size:
                self._items.popitem(last=False)
        return record


def _trace_body(trace: Trace, compress: bool) -> tuple[bytes, dict[str, str]]:
    raw = trace.canonical_json()
    headers = {"content-type": "application/json"}
    if compress:
        raw = gzip.compress(raw, compresslevel=6)
        headers["content-encoding"] = "gzip"
    return raw, headers


def _params(**kw: Any) -> dict[str, Any]:
    return {k: v for k, v in kw.items() if v is not None}


def _follow(fetch: Callable[..., Page[M]], filters: dict[str, Any]) -> Iterator[M]:
    """Items of every page, following `next_cursor` until the last page."""
    cursor: str | None = None
    while True:
        page = fetch(cursor=cursor, **filters)
        yield from page.items
        if not page.next_cursor:
            return
        cursor = page.next_cursor


async def _afollow(fetch: Callable[..., Awaitable[Page[M]]], filters: dict[str, Any]) -> AsyncIterator[M]:
    cursor: str | None = None
    while True:
        page = await fetch(cursor=cursor, **filters)
        for item in page.items:
            yield item
        if not page.next_cursor:
            return
        cursor = page.next_cursor


class Client:
    """Synchronous client. `Client(base_url, token=..., timeout=..., max_retries=...)`; env: MEMPLAN_SERVER/TOKEN."""

    def __init__(self, base_url: str | None = None, *, token: str | None = None,
                 timeout: float = DEFAULT_TIMEOUT_S, max_retries: int = DEFAULT_MAX_RETRIES,
                 transport: httpx.BaseTransport | None = None) -> None:
        self.base_url = _base_url(base_url)
        self.max_retries = max_retries
        self._plans = PlanCache()
        self._http = httpx.Client(base_url=self.base_url, headers=_headers(token), timeout=timeout,
                                  transport=transport)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _request(self, method: str, path: str, *, timeout: float | None = None, **kw: Any) -> Any:
        return _check(self._send(method, path, timeout=timeout, **kw))

    def _send(self, method: str, path: str, *, timeout: float | None = None, **kw: Any) -> httpx.Response:
        for attempt in range(self.max_retries + 1):
            response: httpx.Response | None = None
            try:
                extra = {"timeout": timeout} if timeout is not None else {}
                response = self._http.request(method, path, **kw, **extra)
            except httpx.TimeoutException as exc:
                if attempt == self.max_retries:
                    raise APITimeoutError(f"{method} {path}: timed out") from exc
            except httpx.TransportError as exc:
                if attempt == self.max_retries:
                    raise APIConnectionError(f"{method} {path}: {exc}") from exc
            else:
                if response.status_code not in RETRY_STATUSES or attempt == self.max_retries:
                    return response
            time.sleep(retry_delay(attempt, response))
        raise AssertionError("unreachable")

    # traces ------------------------------------------------------------------------------------
    def upload_trace(self, trace: Trace, *, compress: bool = True) -> TraceCreated:
        body, headers = _trace_body(trace, compress)
        return TraceCreated.model_validate(self._request("POST", "/v1/traces", content=body, headers=headers))

    def get_trace(self, trace_id: str) -> TraceRecord:
        return TraceRecord.model_validate(self._request("GET", f"/v1/traces/{trace_id}"))

    def list_traces_page(self, *, model: str | None = None, hardware: str | None = None, limit: int = 50,
                         cursor: str | None = None, sort: str = "-created_at",
                         id_prefix: str | None = None) -> Page[TraceSummary]:
        data = self._request("GET", "/v1/traces", params=_params(model=model, hardware=hardware, limit=limit,
                                                                 cursor=cursor, sort=sort, id_prefix=id_prefix))
        return Page[TraceSummary].model_validate(data)

    def list_traces(self, **filters: Any) -> Iterator[TraceSummary]:
        """Every matching trace, newest first, following cursors."""
        return _follow(self.list_traces_page, filters)

    # plans -------------------------------------------------------------------------------------
    def request_plan(self, trace_id: str, constraints: Constraints, *, solver: str = "cpsat") -> PlanRecord:
        body = PlanRequest(trace_id=trace_id, constraints=constraints, solver=solver)  # type: ignore[arg-type]
        return PlanRecord.model_validate(self._request("POST", "/v1/plans", json=body.model_dump(mode="json")))

    def get_plan(self, plan_id: str, *, wait_s: float = 0.0) -> PlanRecord:
        """The plan record; a plan fetched before is revalidated (If-None-Match), so polling an unchanged plan
        costs a 304 and no body. With `wait_s`, the server holds the request until the plan changes or is final."""
        for headers in (self._plans.headers(plan_id), {}):
            response = self._send("GET", f"/v1/plans/{plan_id}", params=_params(wait=wait_s or None),
                                  headers=headers, timeout=DEFAULT_TIMEOUT_S + wait_s)
            record = self._plans.resolve(plan_id, response)
            if record is not None:
                return record
        raise AssertionError("unreachable: a request without If-None-Match gets no 304")

    def wait_for_plan(self, plan_id: str, *, timeout_s: float = 300.0, poll_s: float = 10.0) -> PlanRecord:
        """Long-poll until the plan is done, failed or infeasible, or `timeout_s` passes (returns as it is)."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            record = self.get_plan(plan_id, wait_s=max(0.0, min(poll_s, left)))
            if record.status in FINAL_STATUSES or time.monotonic() >= deadline:
                return record

    def list_plans_page(self, *, model: str | None = None, hardware: str | None = None, status: str | None = None,
                        limit: int = 50, cursor: str | None = None, sort: str = "-created_at",
                        with_plan: bool = False, id_prefix: str | None = None) -> Page[PlanRecord]:
        data = self._request("GET", "/v1/plans", params=_params(model=model, hardware=hardware, status=status,
                                                                limit=limit, cursor=cursor, sort=sort,
                                                                with_plan=with_plan or None, id_prefix=id_prefix))
        return Page[PlanRecord].model_validate(data)

    def list_plans(self, **filters: Any) -> Iterator[PlanRecord]:
        """Every matching plan, newest first, following cursors. Records carry the plan's `headline`; the
        whole `plan` (megabytes with an allocation) only with `with_plan=True`, or from `get_plan`."""
        return _follow(self.list_plans_page, filters)

    def post_feedback(self, plan_id: str, feedback: Feedback) -> FeedbackRecord:
        data = self._request("POST", f"/v1/plans/{plan_id}/feedback", json=feedback.model_dump(mode="json"))
        self._plans.forget(plan_id)
        return FeedbackRecord.model_validate(data)

    # catalog -----------------------------------------------------------------------------------
    def models(self) -> list[ModelSummary]:
        return [ModelSummary.model_validate(m) for m in self._request("GET", "/v1/models")]

    def hardware(self) -> list[HardwareSummary]:
        return [HardwareSummary.model_validate(h) for h in self._request("GET", "/v1/hardware")]

    def health(self) -> dict[str, Any]:
        result: dict[str, Any] = self._request("GET", "/healthz")
        return result


class AsyncClient:
    """Asynchronous twin of `Client` (same methods, awaitable; list methods are async iterators)."""

    def __init__(self, base_url: str | None = None, *, token: str | None = None,
                 timeout: float = DEFAULT_TIMEOUT_S, max_retries: int = DEFAULT_MAX_RETRIES,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.base_url = _base_url(base_url)
        self.max_retries = max_retries
        self._plans = PlanCache()
        self._http = httpx.AsyncClient(base_url=self.base_url, headers=_headers(token), timeout=timeout,
                                       transport=transport)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._http.aclose()

    async def _request(self, method: str, path: str, *, timeout: float | None = None, **kw: Any) -> Any:
        return _check(await self._send(method, path, timeout=timeout, **kw))

    async def _send(self, method: str, path: str, *, timeout: float | None = None, **kw: Any) -> httpx.Response:
        for attempt in range(self.max_retries + 1):
            response: httpx.Response | None = None
            try:
                extra = {"timeout": timeout} if timeout is not None else {}
                response = await self._http.request(method, path, **kw, **extra)
            except httpx.TimeoutException as exc:
                if attempt == self.max_retries:
                    raise APITimeoutError(f"{method} {path}: timed out") from exc
            except httpx.TransportError as exc:
                if attempt == self.max_retries:
                    raise APIConnectionError(f"{method} {path}: {exc}") from exc
            else:
                if response.status_code not in RETRY_STATUSES or attempt == self.max_retries:
                    return response
            await asyncio.sleep(retry_delay(attempt, response))
        raise AssertionError("unreachable")

    async def upload_trace(self, trace: Trace, *, compress: bool = True) -> TraceCreated:
        body, headers = _trace_body(trace, compress)
        return TraceCreated.model_validate(await self._request("POST", "/v1/traces", content=body, headers=headers))

    async def get_trace(self, trace_id: str) -> TraceRecord:
        return TraceRecord.model_validate(await self._request("GET", f"/v1/traces/{trace_id}"))

    async def list_traces_page(self, *, model: str | None = None, hardware: str | None = None, limit: int = 50,
                               cursor: str | None = None, sort: str = "-created_at",
                               id_prefix: str | None = None) -> Page[TraceSummary]:
        data = await self._request("GET", "/v1/traces", params=_params(model=model, hardware=hardware, limit=limit,
                                                                       cursor=cursor, sort=sort, id_prefix=id_prefix))
        return Page[TraceSummary].model_validate(data)

    def list_traces(self, **filters: Any) -> AsyncIterator[TraceSummary]:
        return _afollow(self.list_traces_page, filters)

    async def request_plan(self, trace_id: str, constraints: Constraints, *, solver: str = "cpsat") -> PlanRecord:
        body = PlanRequest(trace_id=trace_id, constraints=constraints, solver=solver)  # type: ignore[arg-type]
        return PlanRecord.model_validate(await self._request("POST", "/v1/plans", json=body.model_dump(mode="json")))

    async def get_plan(self, plan_id: str, *, wait_s: float = 0.0) -> PlanRecord:
        for headers in (self._plans.headers(plan_id), {}):
            response = await self._send("GET", f"/v1/plans/{plan_id}", params=_params(wait=wait_s or None),
                                        headers=headers, timeout=DEFAULT_TIMEOUT_S + wait_s)
            record = self._plans.resolve(plan_id, response)
            if record is not None:
                return record
        raise AssertionError("unreachable: a request without If-None-Match gets no 304")

    async def wait_for_plan(self, plan_id: str, *, timeout_s: float = 300.0, poll_s: float = 10.0) -> PlanRecord:
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            record = await self.get_plan(plan_id, wait_s=max(0.0, min(poll_s, left)))
            if record.status in FINAL_STATUSES or time.monotonic() >= deadline:
                return record

    async def list_plans_page(self, *, model: str | None = None, hardware: str | None = None,
                              status: str | None = None, limit: int = 50, cursor: str | None = None,
                              sort: str = "-created_at", with_plan: bool = False,
                              id_prefix: str | None = None) -> Page[PlanRecord]:
        data = await self._request("GET", "/v1/plans", params=_params(model=model, hardware=hardware, status=status,
                                                                      limit=limit, cursor=cursor, sort=sort,
                                                                      with_plan=with_plan or None,
                                                                      id_prefix=id_prefix))
        return Page[PlanRecord].model_validate(data)

    def list_plans(self, **filters: Any) -> AsyncIterator[PlanRecord]:
        return _afollow(self.list_plans_page, filters)

    async def post_feedback(self, plan_id: str, feedback: Feedback) -> FeedbackRecord:
        data = await self._request("POST", f"/v1/plans/{plan_id}/feedback", json=feedback.model_dump(mode="json"))
        self._plans.forget(plan_id)
        return FeedbackRecord.model_validate(data)

    async def models(self) -> list[ModelSummary]:
        return [ModelSummary.model_validate(m) for m in await self._request("GET", "/v1/models")]

    async def hardware(self) -> list[HardwareSummary]:
        return [HardwareSummary.model_validate(h) for h in await self._request("GET", "/v1/hardware")]

    async def health(self) -> dict[str, Any]:
        result: dict[str, Any] = await self._request("GET", "/healthz")
        return result
