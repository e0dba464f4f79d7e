"""Hostile bodies and parameters on SQLite and PostgreSQL: the right 4xx, nothing stored, memory bounded.

Each case here was found by probing the service (issue 17): a gzip body of several members (the check used to
stop after the first), a bomb after a valid member, NUL characters (a 500 from PostgreSQL), malformed cursors
(a naive time gave a 500), 10^6 events, deeply nested JSON. The memory cases run against the real
`memplan serve` process and read its resident memory from /proc.
"""

from __future__ import annotations

import base64
import gzip
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import create_engine, func, select

from client.cli.embedded import free_port
from client.contract import Trace
from planner_service.db.models import FeedbackRow, HardwareRow, ModelRow, PlanRow, TraceRow
from planner_service.db.migrate import upgrade

LIMITS = {"device_memory_bytes": 16 * 2**30}
TABLES = (TraceRow, ModelRow, HardwareRow, PlanRow, FeedbackRow)


def _counts(db_url: str) -> dict[str, int]:
    engine = create_engine(db_url)
    with engine.connect() as conn:
        counts = {t.__tablename__: int(conn.execute(select(func.count()).select_from(t)).scalar_one()) for t in TABLES}
    engine.dispose()
    return counts


def _gz(data: bytes) -> bytes:
    return gzip.compress(data, compresslevel=6, mtime=0)


GZIP = {"content-encoding": "gzip"}


# ------------------------------------------------------------------------------ gzip members
def test_every_gzip_member_is_inflated_and_the_stored_trace_is_the_one_validated(api, trace: Trace) -> None:  # type: ignore[no-untyped-def]
    body = trace.canonical_json()
    half = len(body) // 2
    r = api.post("/v1/traces", content=_gz(body[:half]) + _gz(body[half:]), headers=GZIP)
    assert r.status_code == 201, r.text  # a valid (if unusual) gzip file: members back to back
    stored = api.get(f"/v1/traces/{r.json()['id']}")
    assert stored.status_code == 200 and Trace.model_validate(stored.json()["trace"]) == trace


def test_garbage_after_a_valid_gzip_member_is_a_400_and_stores_nothing(api, trace: Trace, db_url: str) -> None:  # type: ignore[no-untyped-def]
    for tail in (b"garbage after the member", _gz(b"{}")[:12], b"\x1f\x8b\x08\x00" + os.urandom(64)):
        r = api.post("/v1/traces", content=_gz(trace.canonical_json()) + tail, headers=GZIP)
        assert r.status_code == 400, (tail[:8], r.status_code, r.text)
        assert "gzip member 2" in r.json()["error"]
    assert set(_counts(db_url).values()) == {0}


def test_a_bomb_after_a_valid_member_counts_against_the_limit(settings, trace: Trace, db_url: str) -> None:  # type: ignore[no-untyped-def]
    from fastapi.testclient import TestClient

    from planner_service.app import create_app

    small = settings.model_copy(update={"max_decompressed_bytes": 8 * 2**20})
    bomb = _gz(trace.canonical_json()) + gzip.compress(b"\0" * (64 * 2**20), compresslevel=9)  # ~65 KB sent
    assert len(bomb) < 200_000
    with TestClient(create_app(small)) as api:
        r = api.post("/v1/traces", content=bomb, headers=GZIP)
        assert r.status_code == 413 and "all gzip members together" in r.json()["error"]
    assert set(_counts(db_url).values()) == {0}


# ------------------------------------------------------------------------------ NUL characters
def _with(raw: dict[str, Any], path: tuple[str | int, ...], value: Any) -> dict[str, Any]:
    copy = json.loads(json.dumps(raw))
    node = copy
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return copy


def _fields(r: httpx.Response) -> set[str]:
    return {d["field"] for d in r.json()["detail"]}


def test_nul_in_any_trace_string_is_a_422_naming_the_field(api, trace: Trace, db_url: str) -> None:  # type: ignore[no-untyped-def]
    raw = json.loads(trace.canonical_json())
    for path in (("hardware", "device_name"), ("model", "name"), ("model", "fingerprint"),
                 ("model", "blocks", 1, "name"), ("software", "torch_version"), ("software", "cuda_version")):
        r = api.post("/v1/traces", json=_with(raw, path, "a\x00b"))
        assert r.status_code == 422, (path, r.status_code, r.text)
        field = "body." + ".".join(str(p) for p in path).replace(".1.", "[1].")
        assert field in _fields(r), (field, r.json())
        assert r.json()["detail"][0]["message"] == "must not contain NUL (\\u0000) characters"
        gz = api.post("/v1/traces", content=_gz(json.dumps(_with(raw, path, "\x00")).encode()), headers=GZIP)
        assert gz.status_code == 422 and field in _fields(gz)
    assert set(_counts(db_url).values()) == {0}


def test_nul_in_ids_filters_and_feedback_is_a_422_naming_the_parameter(api, trace: Trace, db_url: str) -> None:  # type: ignore[no-untyped-def]
    trace_id = api.post("/v1/traces", content=trace.canonical_json()).json()["id"]
    plan_id = api.post("/v1/plans", json={"trace_id": trace_id, "constraints": LIMITS}).json()["id"]
    assert api.get(f"/v1/plans/{plan_id}", params={"wait": 30}).json()["status"] in ("done", "infeasible")
    before = _counts(db_url)
    cases: list[tuple[str, str, dict[str, Any], str]] = [
        ("GET", "/v1/traces/a%00b", {}, "path.trace_id"),
        ("GET", "/v1/plans/a%00b", {}, "path.plan_id"),
        ("GET", "/v1/traces?model=a%00b", {}, "query.model"),
        ("GET", "/v1/traces?hardware=%00", {}, "query.hardware"),
        ("GET", "/v1/plans?model=a%00b", {}, "query.model"),
        ("GET", "/v1/plans?hardware=a%00b", {}, "query.hardware"),
        ("POST", "/v1/plans", {"json": {"trace_id": trace_id + "\x00", "constraints": LIMITS}}, "body.trace_id"),
        ("POST", "/v1/plans/a%00b/feedback", {"json": {"iteration_s": 1.0, "peak_device_bytes": 1,
                                                        "peak_host_bytes": 0, "steps_measured": 1}}, "path.plan_id"),
        ("POST", f"/v1/plans/{plan_id}/feedback", {"json": {"iteration_s": 1.0, "peak_device_bytes": 1,
                                                             "peak_host_bytes": 0, "steps_measured": 1,
                                                             "notes": "ok\x00no"}}, "body.notes"),
    ]
    for method, url, kw, field in cases:
        r = api.request(method, url, **kw)
        assert r.status_code == 422 and field in _fields(r), (method, url, r.status_code, r.text)
    for url in ("/ui/plans?model=a%00b", "/ui/plans?hardware=%00", "/ui/plans/a%00b"):
        r = api.get(url)
        assert r.status_code == 400 and "NUL" in r.text, (url, r.status_code)
    assert _counts(db_url) == before


# ------------------------------------------------------------------------------ cursors
def _cursor(value: Any) -> str:
    return base64.urlsafe_b64encode(json.dumps(value).encode()).decode().rstrip("=")


@pytest.mark.parametrize("cursor", [
    _cursor(["2026-11-21T10:00:00", "0" * 32]),  # naive time (a 500 on both databases before)
    _cursor(["2026-11-21T10:00:00+00:00", "a\x00b"]),  # NUL in the id
    _cursor(["2026-11-21T10:00:00+00:00", 7]),
    _cursor([1, "0" * 32]),
    _cursor(["not a time", "0" * 32]),
    _cursor({"a": 1}),
    _cursor(["2026-11-21T10:00:00+00:00", "0" * 32, "extra"]),
    "!!bad", "%00", "A" * 5000, "",
])
def test_any_malformed_cursor_is_a_400(api, cursor: str) -> None:  # type: ignore[no-untyped-def]
    for url in ("/v1/traces", "/v1/plans"):
        r = api.get(url, params={"cursor": cursor})
        if cursor == "":  # no cursor at all: the first page
            assert r.status_code == 200
            continue
        assert r.status_code == 400 and r.json()["error"].startswith("cursor:"), (url, r.status_code, r.text)
    r = api.get("/ui/plans", params={"cursor": cursor})
    assert r.status_code == (200 if cursor == "" else 400)
