"""The SDK against real HTTP servers on loopback: retries honour Retry-After, errors are typed, lists follow cursors."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from starlette.routing import Route

from client import AsyncClient, Client
from client.contract import Constraints, Feedback
from client.errors import (
    APIConnectionError,
    APITimeoutError,
    MemplanError,
    NotFoundError,
    ServiceUnavailableError,
    UnexpectedResponseError,
    UnprocessableEntityError,
)
from client.sdk import retry_delay
from planner_service.embedded import EmbeddedServer, free_port
from planner_service.solver.testing.synthetic import synthetic_trace
from tests.loopback import LoopbackServer


class FlakyServer(LoopbackServer):
    """Answers 503 (Retry-After: 0) `failures` times, then 200; records when each request came."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.calls: list[float] = []

        async def healthz(_: Request) -> JSONResponse:
            self.calls.append(time.monotonic())
            if len(self.calls) <= self.failures:
                return JSONResponse({"error": "busy"}, status_code=503, headers={"Retry-After": "0"})
            return JSONResponse({"status": "ok"})

        super().__init__(Starlette(routes=[Route("/healthz", healthz)]))


class ForeignServer(LoopbackServer):
    """Answers what no memplan service does: a login page, JSON of another shape, a 304 to a plain GET, a redirect
    (a proxy, a cache or a service of another version in between)."""

    def __init__(self) -> None:
        async def models(_: Request) -> HTMLResponse:
            return HTMLResponse("<html><body>Please sign in</body></html>")

        async def hardware(_: Request) -> JSONResponse:
            return JSONResponse({"items": "not a list"})

        async def plan(_: Request) -> Response:
            return Response(status_code=304)

        async def trace(_: Request) -> RedirectResponse:
            return RedirectResponse("/login", status_code=302)

        async def plans(_: Request) -> JSONResponse:
            return JSONResponse({"items": [], "next_cursor": "loop"})

        routes = [
            Route("/v1/models", models),
            Route("/v1/hardware", hardware),
            Route("/v1/plans/{plan_id}", plan),
            Route("/v1/traces/{trace_id}", trace),
            Route("/v1/plans", plans),
        ]
        super().__init__(Starlette(routes=routes))


def test_an_answer_no_service_gives_is_a_memplan_error_naming_the_request() -> None:
    """Session 19 probe: the SDK let pydantic's ValidationError (and an AssertionError for a 304) out, which the CLI
    printed as a traceback and `agent.wrap` re-raised as its own bug, killing the job."""
    with ForeignServer() as url, Client(url, max_retries=0) as c:
        for call, words in (
            (c.models, "GET /v1/models: the answer is not what the contract says"),
            (c.hardware, "GET /v1/hardware: the answer is not what the contract says"),
            (lambda: c.get_plan("p1"), "304 Not Modified to a request without If-None-Match"),
            (lambda: c.get_trace("t1"), "GET /v1/traces/t1: an answer this request cannot get"),
            (lambda: list(c.list_plans()), "a pagination loop"),  # it paged forever
        ):
            with pytest.raises(UnexpectedResponseError, match=words) as info:
                call()
            assert isinstance(info.value, MemplanError)

        async def read() -> None:
            async with AsyncClient(url, max_retries=0) as ac:
                with pytest.raises(UnexpectedResponseError, match="304"):
                    await ac.get_plan("p1")

        asyncio.run(read())


def test_retries_5xx_then_succeeds() -> None:
    flaky = FlakyServer(failures=2)
    with flaky as url, Client(url, max_retries=2) as c:
        assert c.health() == {"status": "ok"}
    assert len(flaky.calls) == 3


def test_gives_up_after_max_retries_with_a_typed_error() -> None:
    flaky = FlakyServer(failures=10)
    with flaky as url, Client(url, max_retries=1) as c, pytest.raises(ServiceUnavailableError) as info:
        c.health()
    assert info.value.status_code == 503 and len(flaky.calls) == 2


def test_connection_refused_is_an_api_connection_error() -> None:
    with Client(f"http://127.0.0.1:{free_port()}", max_retries=1) as c, pytest.raises(APIConnectionError):
        c.health()


def test_retry_delay_honours_retry_after_and_caps_backoff() -> None:
    import httpx

    r = httpx.Response(429, headers={"Retry-After": "3"})
    assert retry_delay(0, r) == 3.0
    assert all(0 <= retry_delay(10, None) <= 8.0 for _ in range(100))


def test_async_client_retries_and_gives_up_like_the_sync_client() -> None:
    async def health(url: str, retries: int) -> dict[str, object]:
        async with AsyncClient(url, max_retries=retries) as c:
            return await c.health()

    flaky = FlakyServer(failures=2)
    with flaky as url:
        assert asyncio.run(health(url, 2)) == {"status": "ok"}
    assert len(flaky.calls) == 3
    flaky = FlakyServer(failures=10)
    with flaky as url, pytest.raises(ServiceUnavailableError):
        asyncio.run(health(url, 1))
    assert len(flaky.calls) == 2
    with pytest.raises(APIConnectionError):
        asyncio.run(health(f"http://127.0.0.1:{free_port()}", 1))


def test_retry_delay_reads_an_http_date_and_ignores_garbage() -> None:
    from datetime import UTC, datetime, timedelta
    from email.utils import format_datetime

    soon = format_datetime(datetime.now(UTC) + timedelta(seconds=5), usegmt=True)
    assert 3.0 <= retry_delay(0, httpx.Response(503, headers={"Retry-After": soon})) <= 5.0
    assert 0 <= retry_delay(0, httpx.Response(503, headers={"Retry-After": "soon"})) <= 0.5


def test_missing_server_url_is_a_clear_error(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from client.errors import MemplanError

    monkeypatch.delenv("MEMPLAN_SERVER", raising=False)
    with pytest.raises(MemplanError, match="MEMPLAN_SERVER"):
        Client()


@pytest.fixture
def service(settings) -> Iterator[str]:  # type: ignore[no-untyped-def]
    with EmbeddedServer(settings) as url:
        yield url


def test_sync_client_full_cycle_against_the_real_service(service: str) -> None:
    with Client(service) as c:
        created = c.upload_trace(synthetic_trace(n_blocks=2, hidden=64, vocab=100))
        assert c.upload_trace(synthetic_trace(n_blocks=2, hidden=64, vocab=100)).created is False
        record = c.request_plan(created.id, Constraints(device_memory_bytes=2**34))
        done = c.wait_for_plan(record.id, timeout_s=30)
        assert done.status in ("done", "infeasible") and done.plan is not None
        fb = c.post_feedback(
            done.id, Feedback(iteration_s=1.0, peak_device_bytes=1, peak_host_bytes=1, steps_measured=3)
        )
        assert fb.plan_id == done.id
        with pytest.raises(NotFoundError):
            c.get_plan("missing")
        with pytest.raises(UnprocessableEntityError, match="constraints.device_memory_bytes"):
            c._request(
                "POST", "/v1/plans", json={"trace_id": created.id, "constraints": {"device_memory_bytes": 0}}
            )
        assert [m.name for m in c.models()] == ["synthetic-2L-64H"]


def test_polling_a_plan_revalidates_instead_of_downloading_it_again(service: str) -> None:
    statuses: list[int] = []
    with Client(service) as c:
        c._http.event_hooks["response"].append(lambda r: statuses.append(r.status_code))
        created = c.upload_trace(synthetic_trace(n_blocks=2, hidden=64, vocab=100))
        done = c.wait_for_plan(
            c.request_plan(created.id, Constraints(device_memory_bytes=2**34)).id, timeout_s=30
        )
        statuses.clear()
        again = c.get_plan(done.id)
        assert statuses == [304] and again == done
        c.post_feedback(
            done.id, Feedback(iteration_s=1.0, peak_device_bytes=1, peak_host_bytes=1, steps_measured=3)
        )
        statuses.clear()
        assert len(c.get_plan(done.id).feedback) == 1 and statuses == [200]

    async def run() -> tuple[list[int], bool]:
        seen: list[int] = []
        async with AsyncClient(service) as ac:
            first = await ac.get_plan(done.id)

            async def hook(r: httpx.Response) -> None:
                seen.append(r.status_code)

            ac._http.event_hooks["response"].append(hook)
            return seen, (await ac.get_plan(done.id)) == first

    seen, same = asyncio.run(run())
    assert seen == [304] and same


def test_async_client_lists_follow_cursors(service: str) -> None:
    async def run() -> list[str]:
        async with AsyncClient(service) as c:
            for i in range(5):
                await c.upload_trace(synthetic_trace(n_blocks=1 + i, hidden=64, vocab=100, name="m"))
            return [t.id async for t in c.list_traces(model="m", limit=2)]

    ids = asyncio.run(run())
    assert len(ids) == 5 == len(set(ids))


def test_both_clients_read_the_same_plan_page_from_the_one_query_builder(service: str) -> None:
    """`list_plans_page` keywords are defined once (`BaseClient._list_plans_page`): the async client, given the
    same filters, reads the same page and cursor as the sync one; an unknown keyword is refused by both."""
    with Client(service) as c:
        for i in range(3):
            created = c.upload_trace(synthetic_trace(n_blocks=1 + i, hidden=64, vocab=100, name="pm"))
            c.request_plan(created.id, Constraints(device_memory_bytes=2**34))
        page = c.list_plans_page(model="pm", limit=2, sort="created_at", with_plan=True)
        with pytest.raises(TypeError, match="colour"):
            c.list_plans_page(colour="red")  # type: ignore[call-arg]

    async def run() -> tuple[list[str], str | None, list[str]]:
        async with AsyncClient(service) as ac:
            first = await ac.list_plans_page(model="pm", limit=2, sort="created_at", with_plan=True)
            with pytest.raises(TypeError, match="colour"):
                await ac.list_plans_page(colour="red")  # type: ignore[call-arg]
            every = [p.id async for p in ac.list_plans(model="pm", limit=2)]
            return [p.id for p in first.items], first.next_cursor, every

    ids, cursor, every = asyncio.run(run())
    assert ids == [p.id for p in page.items] and len(ids) == 2
    assert cursor is not None and cursor == page.next_cursor
    assert len(every) == 3 == len(set(every))


def _trickling_app(seconds_per_byte: float) -> Starlette:
    """A server that sends its headers at once, then a JSON body one byte every `seconds_per_byte`."""
    from starlette.responses import StreamingResponse

    async def trickle(request: Request) -> Response:
        async def body() -> object:
            for ch in b'{"status": "ok", "padding": "' + b"x" * 200 + b'"}':
                yield bytes([ch])
                await asyncio.sleep(seconds_per_byte)

        return StreamingResponse(body(), media_type="application/json")  # type: ignore[arg-type]

    return Starlette(routes=[Route("/{path:path}", trickle)])


def test_a_body_trickling_past_the_deadline_is_a_timeout_not_a_hang() -> None:
    """Session 19 probe: httpx's read timeout is per read, so a server sending a byte every few seconds held a
    call (and the `memplan` command) for ever. The whole body must now arrive within `body_deadline_s`."""
    with LoopbackServer(_trickling_app(0.05)) as url:
        started = time.monotonic()
        with (
            Client(url, timeout=5, max_retries=0, body_deadline_s=1.0) as c,
            pytest.raises(APITimeoutError, match="timed out"),
        ):
            c.health()
        assert time.monotonic() - started < 5  # the 232-byte body would have taken ~12 s

        async def run() -> None:
            async with AsyncClient(url, timeout=5, max_retries=0, body_deadline_s=1.0) as c:
                await c.health()

        with pytest.raises(APITimeoutError):
            asyncio.run(run())
        with Client(url, timeout=5, max_retries=0, body_deadline_s=60) as c:  # in time: read whole
            assert c._request("GET", "/v1/health")["status"] == "ok"
