"""HTTP SDK: paired `Client` / `AsyncClient` on httpx, with retries, typed responses and cursor-following lists.

Why one module over 400 lines: `Client` and `AsyncClient` share their request building, retries and error
mapping here, openai-python's shape; each method exists once per client.
"""

from __future__ import annotations

import asyncio
import gzip
import os
import random
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from email.utils import parsedate_to_datetime
from typing import Any, Generic, TypedDict, TypeVar, Unpack

import httpx
import pydantic
from pydantic import BaseModel

from client.contract import (
    AllocationTrace,
    Constraints,
    Feedback,
    FeedbackRecord,
    HardwareSummary,
    ModelSummary,
    Page,
    PlanRecord,
    PlanRequest,
    SweepRecord,
    SweepRequest,
    Trace,
    TraceCreated,
    TraceRecord,
    TraceSummary,
    WhatIfRequest,
    WhatIfResponse,
)
from client.errors import (
    APIConnectionError,
    APITimeoutError,
    MemplanError,
    UnexpectedResponseError,
    error_for_status,
    first_problem,
)

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")
DEFAULT_TIMEOUT_S = 30.0
# A what-if answer runs a fake iteration and the solver per entry while the client waits.
WHATIF_TIMEOUT_S = 300.0
# Placing a managed iteration's buffers: the service's time limit for it, plus a first numba compile.
MANAGED_ALLOCATION_WAIT_S = 60.0
DEFAULT_MAX_RETRIES = 2
RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})


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


def retry_delay(
    attempt: int, response: httpx.Response | None, *, base_s: float = 0.5, cap_s: float = 8.0
) -> float:
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
    """The decoded body of a success; the typed `APIStatusError` subclass for a 4xx/5xx; an
    `UnexpectedResponseError` for any other status that is not a success (a redirect, a 304 here)."""
    body = _decode(response)
    if response.status_code >= 400:
        raise error_for_status(response.status_code, body)
    if not 200 <= response.status_code < 300:
        raise UnexpectedResponseError(
            f"{response.request.method} {response.request.url.path}: an answer this request cannot get "
            f"({response.reason_phrase or 'no reason given'}; a proxy in between?)",
            status_code=response.status_code,
        )
    return body


def _parsed(parse: Callable[[Any], T], body: Any, response: httpx.Response) -> T:
    """`parse(body)`, or an `UnexpectedResponseError` naming the first problem when the body is not what the
    contract says (HTML from a login proxy, a record of another shape, a service of another version)."""
    try:
        return parse(body)
    except pydantic.ValidationError as exc:
        raise UnexpectedResponseError(
            f"{response.request.method} {response.request.url.path}: the answer is not what the contract says "
            f"({first_problem(exc, 'body')}; {exc.error_count()} problem(s))",
            status_code=response.status_code,
        ) from exc
    except (TypeError, KeyError, AttributeError, ValueError) as exc:  # a list expected, a string given, ...
        raise UnexpectedResponseError(
            f"{response.request.method} {response.request.url.path}: the answer is not what the contract says "
            f"({type(exc).__name__}: {exc})",
            status_code=response.status_code,
        ) from exc


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
        record = _parsed(PlanRecord.model_validate, _check(response), response)
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


class TraceListFilters(TypedDict, total=False):
    """The keywords of `list_traces_page`, typed once for both clients; defaults: `_list_traces_page`."""

    model: str | None
    hardware: str | None
    limit: int
    cursor: str | None
    sort: str
    id_prefix: str | None
    world_size: int | None
    ranks_per_node: int | None


class PlanListFilters(TypedDict, total=False):
    """The keywords of `list_plans_page`, typed once for both clients; defaults: `_list_plans_page`."""

    model: str | None
    hardware: str | None
    status: str | None
    limit: int
    cursor: str | None
    sort: str
    with_plan: bool
    id_prefix: str | None
    search: str | None
    world_size: int | None
    ranks_per_node: int | None


@dataclass(frozen=True)
class APIRequest(Generic[T]):
    """One call of the API, built once for both clients: what to send and how to read the answer."""

    method: str
    path: str
    parse: Callable[[Any], T]
    params: dict[str, Any] | None = None
    json: Any = None
    content: bytes | None = None
    headers: dict[str, str] = field(default_factory=dict)
    timeout: float | None = None

    def httpx_kwargs(self) -> dict[str, Any]:
        kw: dict[str, Any] = {"params": self.params, "headers": self.headers}
        if self.json is not None:
            kw["json"] = self.json
        if self.content is not None:
            kw["content"] = self.content
        if self.timeout is not None:
            kw["timeout"] = self.timeout
        return kw


def _raw(body: Any) -> Any:
    return body


def _next_cursor(page: Page[Any], seen: set[str]) -> str | None:
    """The cursor of the page after `page` (None: the last page); a cursor given before is a loop on the server's
    side (session 19 probe: a server always answering the same cursor kept `memplan plans list` paging forever),
    an `UnexpectedResponseError`, and an empty page can only be the last."""
    cursor = page.next_cursor
    if not cursor:
        return None
    if cursor in seen or not page.items:
        raise UnexpectedResponseError(
            f"list: the server's next page {'repeats an earlier cursor' if cursor in seen else 'follows an empty one'} "
            "(a pagination loop)",
            status_code=200,
        )
    seen.add(cursor)
    return cursor


def _follow(fetch: Callable[..., Page[M]], filters: dict[str, Any]) -> Iterator[M]:
    """Items of every page, following `next_cursor` until the last page (`_next_cursor`)."""
    cursor: str | None = None
    seen: set[str] = set()
    while True:
        page = fetch(cursor=cursor, **filters)
        yield from page.items
        if (cursor := _next_cursor(page, seen)) is None:
            return


async def _afollow(fetch: Callable[..., Awaitable[Page[M]]], filters: dict[str, Any]) -> AsyncIterator[M]:
    """`_follow` for the async client."""
    cursor: str | None = None
    seen: set[str] = set()
    while True:
        page = await fetch(cursor=cursor, **filters)
        for item in page.items:
            yield item
        if (cursor := _next_cursor(page, seen)) is None:
            return


class PlanWait:
    """The schedule of `wait_for_plan`: long-polls of at most `poll_s` until a final status or the deadline."""

    def __init__(self, timeout_s: float, poll_s: float) -> None:
        self.deadline = time.monotonic() + timeout_s
        self.poll_s = poll_s

    def next_wait_s(self) -> float:
        return max(0.0, min(self.poll_s, self.deadline - time.monotonic()))

    def finished(self, record: PlanRecord) -> bool:
        return record.status.final or time.monotonic() >= self.deadline


class BaseClient:
    """What the sync and async clients share (as openai-python's base client): configuration, headers, the
    retry decision and timing, request building, response parsing and the plan cache. Only the transport call
    (and sleeping between attempts) differs between `Client` and `AsyncClient`."""

    def __init__(self, base_url: str | None, *, token: str | None, max_retries: int) -> None:
        self.base_url = _base_url(base_url)
        self.headers = _headers(token)
        self.max_retries = max_retries
        self._plans = PlanCache()

    # retries -----------------------------------------------------------------------------------
    def _retry_after_error(self, attempt: int, method: str, path: str, exc: httpx.TransportError) -> float:
        """Seconds to wait before retrying a request that failed in transport; raises on the last attempt."""
        if attempt >= self.max_retries:
            if isinstance(exc, httpx.TimeoutException):
                raise APITimeoutError(f"{method} {path}: timed out") from exc
            raise APIConnectionError(f"{method} {path}: {exc}") from exc
        return retry_delay(attempt, None)

    def _should_retry(self, attempt: int, response: httpx.Response) -> bool:
        return response.status_code in RETRY_STATUSES and attempt < self.max_retries

    # requests ----------------------------------------------------------------------------------
    def _raw_request(
        self,
        method: str,
        path: str,
        *,
        params: dict[str, Any] | None = None,
        json: Any = None,
        content: bytes | None = None,
        headers: dict[str, str] | None = None,
        timeout: float | None = None,
    ) -> APIRequest[Any]:
        """Any call, answered with the decoded body (for calls the SDK has no method for)."""
        return APIRequest(
            method,
            path,
            _raw,
            params=params,
            json=json,
            content=content,
            headers=headers or {},
            timeout=timeout,
        )

    def _upload_trace(self, trace: Trace, compress: bool) -> APIRequest[TraceCreated]:
        body, headers = _trace_body(trace, compress)
        return APIRequest("POST", "/v1/traces", TraceCreated.model_validate, content=body, headers=headers)

    def _get_trace(self, trace_id: str) -> APIRequest[TraceRecord]:
        return APIRequest("GET", f"/v1/traces/{trace_id}", TraceRecord.model_validate)

    def _list_traces_page(
        self,
        *,
        model: str | None = None,
        hardware: str | None = None,
        limit: int = 50,
        cursor: str | None = None,
        sort: str = "-created_at",
        id_prefix: str | None = None,
        world_size: int | None = None,
        ranks_per_node: int | None = None,
    ) -> APIRequest[Page[TraceSummary]]:
        """A page of traces; `world_size` / `ranks_per_node` keep those measured in such a process group.
        The one definition of `list_traces_page`'s keywords and defaults, for both clients."""
        return APIRequest(
            "GET",
            "/v1/traces",
            Page[TraceSummary].model_validate,
            params=_params(
                model=model,
                hardware=hardware,
                limit=limit,
                cursor=cursor,
                sort=sort,
                id_prefix=id_prefix,
                world_size=world_size,
                ranks_per_node=ranks_per_node,
            ),
        )

    def _request_plan(self, trace_id: str, constraints: Constraints, solver: str) -> APIRequest[PlanRecord]:
        body = PlanRequest(
            trace_id=trace_id, constraints=constraints, solver=solver
        )  # the contract checks the name
        return APIRequest("POST", "/v1/plans", PlanRecord.model_validate, json=body.model_dump(mode="json"))

    def _get_plan(self, plan_id: str, wait_s: float, headers: dict[str, str]) -> APIRequest[Any]:
        """A plan read; its answer (a 304 included) is read by `self._plans.resolve`, not by `parse`."""
        return APIRequest(
            "GET",
            f"/v1/plans/{plan_id}",
            _raw,
            params=_params(wait=wait_s or None),
            headers=headers,
            timeout=DEFAULT_TIMEOUT_S + wait_s,
        )

    def _list_plans_page(
        self,
        *,
        model: str | None = None,
        hardware: str | None = None,
        status: str | None = None,
        limit: int = 50,
        cursor: str | None = None,
        sort: str = "-created_at",
        with_plan: bool = False,
        id_prefix: str | None = None,
        search: str | None = None,
        world_size: int | None = None,
        ranks_per_node: int | None = None,
    ) -> APIRequest[Page[PlanRecord]]:
        """A page of plans; `sort` is a column ("-" first for descending: created_at, model, hardware,
        workload, status, solver, iteration, peak, device_limit, error, peak_error), `search` free text;
        `world_size` / `ranks_per_node` keep plans for jobs of such a process group. The one definition
        of `list_plans_page`'s keywords and defaults, for both clients."""
        return APIRequest(
            "GET",
            "/v1/plans",
            Page[PlanRecord].model_validate,
            params=_params(
                model=model,
                hardware=hardware,
                status=status,
                limit=limit,
                cursor=cursor,
                sort=sort,
                with_plan=with_plan or None,
                id_prefix=id_prefix,
                search=search,
                world_size=world_size,
                ranks_per_node=ranks_per_node,
            ),
        )

    def _post_feedback(self, plan_id: str, feedback: Feedback) -> APIRequest[FeedbackRecord]:
        def parse(body: Any) -> FeedbackRecord:
            self._plans.forget(plan_id)
            return FeedbackRecord.model_validate(body)

        # fields left at None are left out: a service from before a field (the phases of session 19) refuses
        # unknown keys, even null ones
        return APIRequest(
            "POST",
            f"/v1/plans/{plan_id}/feedback",
            parse,
            json=feedback.model_dump(mode="json", exclude_none=True),
        )

    def _put_managed_allocation(self, plan_id: str, events: AllocationTrace) -> APIRequest[PlanRecord]:
        def parse(body: Any) -> PlanRecord:
            self._plans.forget(plan_id)
            return PlanRecord.model_validate(body)

        return APIRequest(
            "PUT",
            f"/v1/plans/{plan_id}/allocation",
            parse,
            json=events.model_dump(mode="json"),
            timeout=DEFAULT_TIMEOUT_S + MANAGED_ALLOCATION_WAIT_S,
        )

    def _models(self) -> APIRequest[list[ModelSummary]]:
        return APIRequest("GET", "/v1/models", lambda body: [ModelSummary.model_validate(m) for m in body])

    def _hardware(self) -> APIRequest[list[HardwareSummary]]:
        return APIRequest(
            "GET", "/v1/hardware", lambda body: [HardwareSummary.model_validate(h) for h in body]
        )

    def _health(self) -> APIRequest[dict[str, Any]]:
        return APIRequest("GET", "/healthz", dict)

    def _whatif(self, request: WhatIfRequest) -> APIRequest[WhatIfResponse]:
        return APIRequest(
            "POST",
            "/v1/whatif",
            WhatIfResponse.model_validate,
            json=request.model_dump(mode="json", exclude_none=True),
            timeout=WHATIF_TIMEOUT_S,
        )

    def _create_sweep(self, request: SweepRequest) -> APIRequest[SweepRecord]:
        return APIRequest(
            "POST",
            "/v1/sweeps",
            SweepRecord.model_validate,
            json=request.model_dump(mode="json", exclude_none=True),
            timeout=WHATIF_TIMEOUT_S,
        )

    def _get_sweep(self, sweep_id: str, limit: int, cursor: str | None) -> APIRequest[SweepRecord]:
        return APIRequest(
            "GET",
            f"/v1/sweeps/{sweep_id}",
            SweepRecord.model_validate,
            params=_params(limit=limit, cursor=cursor),
        )


BODY_DEADLINE_S = 120.0
"""The most seconds an answer's body may take to arrive once its headers did. httpx's read timeout is per read,
so a server sending a byte every few seconds held a call (and the `memplan` command) for ever (session 19
probe); the largest answer (a plan with its allocation, tens of MiB) takes seconds on a loopback or LAN."""


def _received(
    http: httpx.Client, request: httpx.Request, within_s: float = BODY_DEADLINE_S
) -> httpx.Response:
    """`request`'s answer, its body read whole within `within_s` of its headers (else `httpx.ReadTimeout`)."""
    response = http.send(request, stream=True)
    if response.is_stream_consumed:  # read already (an in-memory transport's answer): nothing to wait for
        return response
    try:
        deadline = time.monotonic() + within_s
        body = bytearray()
        for chunk in response.iter_raw():
            body += chunk
            if time.monotonic() > deadline:
                raise httpx.ReadTimeout(
                    f"the answer's body took over {within_s:.0f}s to arrive", request=request
                )
    finally:
        response.close()
    return _whole(response, bytes(body), request)


async def _received_async(
    http: httpx.AsyncClient, request: httpx.Request, within_s: float = BODY_DEADLINE_S
) -> httpx.Response:
    """`_received` of `AsyncClient`."""
    response = await http.send(request, stream=True)
    if response.is_stream_consumed:
        return response
    try:
        deadline = time.monotonic() + within_s
        body = bytearray()
        async for chunk in response.aiter_raw():
            body += chunk
            if time.monotonic() > deadline:
                raise httpx.ReadTimeout(
                    f"the answer's body took over {within_s:.0f}s to arrive", request=request
                )
    finally:
        await response.aclose()
    return _whole(response, bytes(body), request)


def _whole(streamed: httpx.Response, raw: bytes, request: httpx.Request) -> httpx.Response:
    """A read response of `streamed`'s status and headers with its body `raw` (as sent: decoded on access)."""
    return httpx.Response(
        streamed.status_code,
        headers=streamed.headers,
        content=raw,
        request=request,
        extensions=streamed.extensions,
    )


class Client(BaseClient):
    """Synchronous client. `Client(base_url, token=..., timeout=..., max_retries=...)`; env: MEMPLAN_SERVER/TOKEN.
    `timeout` bounds each connect and read; `body_deadline_s` the whole body once the headers came."""

    def __init__(
        self,
        base_url: str | None = None,
        *,
        token: str | None = None,
        timeout: float = DEFAULT_TIMEOUT_S,
        max_retries: int = DEFAULT_MAX_RETRIES,
        transport: httpx.BaseTransport | None = None,
        body_deadline_s: float = BODY_DEADLINE_S,
    ) -> None:
        super().__init__(base_url, token=token, max_retries=max_retries)
        self.body_deadline_s = body_deadline_s
        self._http = httpx.Client(
            base_url=self.base_url, headers=self.headers, timeout=timeout, transport=transport
        )

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _send(self, request: APIRequest[Any]) -> httpx.Response:
        """The transport call, retried on connection errors and on 408/429/5xx (see `BaseClient`)."""
        attempt = 0
        while True:
            try:
                response = _received(
                    self._http,
                    self._http.build_request(request.method, request.path, **request.httpx_kwargs()),
                    self.body_deadline_s,
                )
            except httpx.TransportError as exc:
                delay = self._retry_after_error(attempt, request.method, request.path, exc)
            else:
                if not self._should_retry(attempt, response):
                    return response
                delay = retry_delay(attempt, response)
            time.sleep(delay)
            attempt += 1

    def _call(self, request: APIRequest[T]) -> T:
        response = self._send(request)
        return _parsed(request.parse, _check(response), response)

    def _request(self, method: str, path: str, *, timeout: float | None = None, **kw: Any) -> Any:
        return self._call(self._raw_request(method, path, timeout=timeout, **kw))

    # traces ------------------------------------------------------------------------------------
    def upload_trace(self, trace: Trace, *, compress: bool = True) -> TraceCreated:
        return self._call(self._upload_trace(trace, compress))

    def get_trace(self, trace_id: str) -> TraceRecord:
        return self._call(self._get_trace(trace_id))

    def list_traces_page(self, **filters: Unpack[TraceListFilters]) -> Page[TraceSummary]:
        """A page of traces; the keywords and their defaults: `BaseClient._list_traces_page`."""
        return self._call(self._list_traces_page(**filters))

    def list_traces(self, **filters: Any) -> Iterator[TraceSummary]:
        """Every matching trace, newest first, following cursors."""
        return _follow(self.list_traces_page, filters)

    # plans -------------------------------------------------------------------------------------
    def request_plan(self, trace_id: str, constraints: Constraints, *, solver: str = "cpsat") -> PlanRecord:
        return self._call(self._request_plan(trace_id, constraints, solver))

    def get_plan(self, plan_id: str, *, wait_s: float = 0.0) -> PlanRecord:
        """The plan record; a plan fetched before is revalidated (If-None-Match), so polling an unchanged plan
        costs a 304 and no body. With `wait_s`, the server holds the request until the plan changes or is final."""
        for headers in (self._plans.headers(plan_id), {}):
            record = self._plans.resolve(plan_id, self._send(self._get_plan(plan_id, wait_s, headers)))
            if record is not None:
                return record
        raise UnexpectedResponseError(
            f"GET /v1/plans/{plan_id}: 304 Not Modified to a request without If-None-Match (a cache or proxy in "
            "between?)",
            status_code=304,
        )

    def wait_for_plan(self, plan_id: str, *, timeout_s: float = 300.0, poll_s: float = 10.0) -> PlanRecord:
        """Long-poll until the plan is done, failed or infeasible, or `timeout_s` passes (returns as it is)."""
        wait = PlanWait(timeout_s, poll_s)
        while True:
            record = self.get_plan(plan_id, wait_s=wait.next_wait_s())
            if wait.finished(record):
                return record

    def list_plans_page(self, **filters: Unpack[PlanListFilters]) -> Page[PlanRecord]:
        """A page of plans; its keywords (sort, search, ...) and their defaults: `BaseClient._list_plans_page`."""
        return self._call(self._list_plans_page(**filters))

    def list_plans(self, **filters: Any) -> Iterator[PlanRecord]:
        """Every matching plan, newest first, following cursors. Records carry the plan's `headline`; the
        whole `plan` (megabytes with an allocation) only with `with_plan=True`, or from `get_plan`."""
        return _follow(self.list_plans_page, filters)

    def post_feedback(self, plan_id: str, feedback: Feedback) -> FeedbackRecord:
        return self._call(self._post_feedback(plan_id, feedback))

    def put_managed_allocation(self, plan_id: str, events: AllocationTrace) -> PlanRecord:
        """Send one iteration run under the plan (its allocation trace); the service places it and stores the
        placement as the plan's allocation (`iteration="managed"`). Returns the updated record."""
        return self._call(self._put_managed_allocation(plan_id, events))

    # catalog -----------------------------------------------------------------------------------
    def models(self) -> list[ModelSummary]:
        return self._call(self._models())

    def hardware(self) -> list[HardwareSummary]:
        return self._call(self._hardware())

    def health(self) -> dict[str, Any]:
        return self._call(self._health())

    # what-if -----------------------------------------------------------------------------------
    def whatif(self, request: WhatIfRequest) -> WhatIfResponse:
        """Each requested catalogue entry's answer: fits, which limit binds, speed, calibration."""
        return self._call(self._whatif(request))

    def create_sweep(self, request: SweepRequest) -> SweepRecord:
        """Start a sweep: one plan per point, solved on the service's workers."""
        return self._call(self._create_sweep(request))

    def get_sweep(self, sweep_id: str, *, limit: int = 100, cursor: str | None = None) -> SweepRecord:
        """A sweep's progress and one page of its points (`next_cursor` for the next page)."""
        return self._call(self._get_sweep(sweep_id, limit, cursor))


class AsyncClient(BaseClient):
    """Asynchronous twin of `Client` (same methods, awaitable; list methods are async iterators)."""

    def __init__(
        self,
        base_url: str | None = None,
        *,
        token: str | None = None,
        timeout: float = DEFAULT_TIMEOUT_S,
        max_retries: int = DEFAULT_MAX_RETRIES,
        transport: httpx.AsyncBaseTransport | None = None,
        body_deadline_s: float = BODY_DEADLINE_S,
    ) -> None:
        super().__init__(base_url, token=token, max_retries=max_retries)
        self.body_deadline_s = body_deadline_s
        self._http = httpx.AsyncClient(
            base_url=self.base_url, headers=self.headers, timeout=timeout, transport=transport
        )

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._http.aclose()

    async def _send(self, request: APIRequest[Any]) -> httpx.Response:
        attempt = 0
        while True:
            try:
                response = await _received_async(
                    self._http,
                    self._http.build_request(request.method, request.path, **request.httpx_kwargs()),
                    self.body_deadline_s,
                )
            except httpx.TransportError as exc:
                delay = self._retry_after_error(attempt, request.method, request.path, exc)
            else:
                if not self._should_retry(attempt, response):
                    return response
                delay = retry_delay(attempt, response)
            await asyncio.sleep(delay)
            attempt += 1

    async def _call(self, request: APIRequest[T]) -> T:
        response = await self._send(request)
        return _parsed(request.parse, _check(response), response)

    async def _request(self, method: str, path: str, *, timeout: float | None = None, **kw: Any) -> Any:
        return await self._call(self._raw_request(method, path, timeout=timeout, **kw))

    async def upload_trace(self, trace: Trace, *, compress: bool = True) -> TraceCreated:
        return await self._call(self._upload_trace(trace, compress))

    async def get_trace(self, trace_id: str) -> TraceRecord:
        return await self._call(self._get_trace(trace_id))

    async def list_traces_page(self, **filters: Unpack[TraceListFilters]) -> Page[TraceSummary]:
        return await self._call(self._list_traces_page(**filters))

    def list_traces(self, **filters: Any) -> AsyncIterator[TraceSummary]:
        return _afollow(self.list_traces_page, filters)

    async def request_plan(
        self, trace_id: str, constraints: Constraints, *, solver: str = "cpsat"
    ) -> PlanRecord:
        return await self._call(self._request_plan(trace_id, constraints, solver))

    async def get_plan(self, plan_id: str, *, wait_s: float = 0.0) -> PlanRecord:
        for headers in (self._plans.headers(plan_id), {}):
            record = self._plans.resolve(plan_id, await self._send(self._get_plan(plan_id, wait_s, headers)))
            if record is not None:
                return record
        raise UnexpectedResponseError(
            f"GET /v1/plans/{plan_id}: 304 Not Modified to a request without If-None-Match (a cache or proxy in "
            "between?)",
            status_code=304,
        )

    async def wait_for_plan(
        self, plan_id: str, *, timeout_s: float = 300.0, poll_s: float = 10.0
    ) -> PlanRecord:
        wait = PlanWait(timeout_s, poll_s)
        while True:
            record = await self.get_plan(plan_id, wait_s=wait.next_wait_s())
            if wait.finished(record):
                return record

    async def list_plans_page(self, **filters: Unpack[PlanListFilters]) -> Page[PlanRecord]:
        return await self._call(self._list_plans_page(**filters))

    def list_plans(self, **filters: Any) -> AsyncIterator[PlanRecord]:
        return _afollow(self.list_plans_page, filters)

    async def post_feedback(self, plan_id: str, feedback: Feedback) -> FeedbackRecord:
        return await self._call(self._post_feedback(plan_id, feedback))

    async def put_managed_allocation(self, plan_id: str, events: AllocationTrace) -> PlanRecord:
        return await self._call(self._put_managed_allocation(plan_id, events))

    async def models(self) -> list[ModelSummary]:
        return await self._call(self._models())

    async def hardware(self) -> list[HardwareSummary]:
        return await self._call(self._hardware())

    async def health(self) -> dict[str, Any]:
        return await self._call(self._health())

    async def whatif(self, request: WhatIfRequest) -> WhatIfResponse:
        return await self._call(self._whatif(request))

    async def create_sweep(self, request: SweepRequest) -> SweepRecord:
        return await self._call(self._create_sweep(request))

    async def get_sweep(self, sweep_id: str, *, limit: int = 100, cursor: str | None = None) -> SweepRecord:
        return await self._call(self._get_sweep(sweep_id, limit, cursor))
