"""Identical requests at the same moment, against the real service on a loopback port (SQLite and PostgreSQL):
one plan and one solve, whoever wins the race; the same for identical trace uploads."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from threading import Barrier

import httpx
import pytest

from planner_service.app import create_app
from planner_service.db.models import PlanRow, TraceRow
from planner_service.solver.testing.synthetic import synthetic_trace
from tests.loopback import LoopbackServer
from tests.planner_service.rows import count_rows

pytestmark = pytest.mark.slow

CLIENTS = 12
LIMITS = {"device_memory_bytes": 16 * 2**30}


def _at_once(url: str, method: str, path: str, **kwargs: object) -> list[httpx.Response]:
    """`CLIENTS` requests, each on its own connection, released together by a barrier."""
    start = Barrier(CLIENTS)

    def one(_: int) -> httpx.Response:
        with httpx.Client(base_url=url, timeout=60) as client:
            start.wait()
            return client.request(method, path, **kwargs)  # type: ignore[arg-type]

    with ThreadPoolExecutor(CLIENTS) as pool:
        return list(pool.map(one, range(CLIENTS)))


def test_identical_plan_requests_at_once_make_one_plan(settings, db_url: str) -> None:  # type: ignore[no-untyped-def]
    trace = synthetic_trace(n_blocks=4, hidden=256, vocab=1000, batch=2, seq=128)
    with LoopbackServer(create_app(settings, workers=0)) as url:
        up = httpx.post(f"{url}/v1/traces", content=trace.canonical_json(), timeout=60)
        assert up.status_code == 201, up.text
        body = {"trace_id": up.json()["id"], "constraints": LIMITS}
        answers = _at_once(url, "POST", "/v1/plans", json=body)
    assert all(a.status_code in (200, 202) for a in answers), [(a.status_code, a.text) for a in answers]
    ids = {a.json()["id"] for a in answers}
    assert len(ids) == 1, f"{len(ids)} plans for one request"
    created = [a for a in answers if a.status_code == 202]
    assert len(created) == 1 and all(a.json()["reused"] for a in answers if a.status_code == 200)
    assert count_rows(db_url, PlanRow) == 1


def test_identical_trace_uploads_at_once_store_one_trace(settings, db_url: str) -> None:  # type: ignore[no-untyped-def]
    trace = synthetic_trace(n_blocks=4, hidden=256, vocab=1000, batch=2, seq=128)
    with LoopbackServer(create_app(settings, workers=0)) as url:
        answers = _at_once(url, "POST", "/v1/traces", content=trace.canonical_json())
    assert all(a.status_code in (200, 201) for a in answers), [(a.status_code, a.text) for a in answers]
    assert len({a.json()["id"] for a in answers}) == 1
    assert sum(a.status_code == 201 for a in answers) == 1
    assert count_rows(db_url, TraceRow) == 1
