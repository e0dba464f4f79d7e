"""Tokens scope every object to a project; other projects' objects are invisible; tokens are stored hashed."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import create_engine, select

from planner_service.app import InsecureBind, check_bind, create_app
from planner_service.auth import create_token
from planner_service.db.models import ApiTokenRow
from planner_service.db.session import Database
from planner_service.settings import Settings
from planner_service.solver.testing.synthetic import synthetic_trace

LIMITS = {"device_memory_bytes": 2**34}


@pytest.fixture
def secured(settings: Settings):  # type: ignore[no-untyped-def]
    secure = settings.model_copy(update={"auth": True})
    db = Database(secure.database_url)
    with db.session() as s:
        token_a, _ = create_token(s, "project-a")
        token_b, _ = create_token(s, "project-b")
    db.dispose()
    with TestClient(create_app(secure)) as client:
        yield client, {"authorization": f"Bearer {token_a}"}, {"authorization": f"Bearer {token_b}"}, token_a


def test_requests_without_a_valid_token_get_401(secured) -> None:  # type: ignore[no-untyped-def]
    api, _, _, _ = secured
    assert api.get("/v1/plans").status_code == 401
    assert api.get("/v1/plans", headers={"authorization": "Bearer mp_wrong"}).status_code == 401
    assert api.get("/healthz").status_code == 200  # probes need no token


def test_project_b_cannot_see_project_a_objects(secured) -> None:  # type: ignore[no-untyped-def]
    api, a, b, _ = secured
    trace = synthetic_trace(n_blocks=2, hidden=64, vocab=100, name="secret-model")
    tid = api.post("/v1/traces", content=trace.canonical_json(), headers=a).json()["id"]
    pid = api.post("/v1/plans", json={"trace_id": tid, "constraints": LIMITS}, headers=a).json()["id"]
    assert api.get(f"/v1/traces/{tid}", headers=b).status_code == 404
    assert api.get(f"/v1/plans/{pid}", headers=b).status_code == 404
    assert api.post("/v1/plans", json={"trace_id": tid, "constraints": LIMITS}, headers=b).status_code == 404
    fb = {"iteration_s": 1.0, "peak_device_bytes": 1, "peak_host_bytes": 1, "steps_measured": 1}
    assert api.post(f"/v1/plans/{pid}/feedback", json=fb, headers=b).status_code == 404
    assert api.get("/v1/plans", headers=b).json()["items"] == []
    assert api.get("/v1/traces", headers=b).json()["items"] == []
    assert api.get("/v1/models", headers=b).json() == [] and api.get("/v1/hardware", headers=b).json() == []
    assert [p["id"] for p in api.get("/v1/plans", headers=a).json()["items"]] == [pid]
    # the same content uploaded by B is B's own trace, not A's
    tid_b = api.post("/v1/traces", content=trace.canonical_json(), headers=b)
    assert tid_b.status_code == 201 and tid_b.json()["id"] != tid


def test_a_fingerprint_shared_by_two_projects_keeps_each_projects_own_name(secured) -> None:  # type: ignore[no-untyped-def]
    """The catalogue is per project: B uploading with A's model fingerprint (and hardware key) sees only what
    B sent, in /v1/models, /v1/hardware, trace records, lists and /ui/catalog, and A's pages never show B's."""
    api, a, b, _ = secured
    mine = synthetic_trace(n_blocks=2, hidden=64, vocab=100, name="a-secret-name")
    theirs = mine.model_copy(
        update={
            "model": mine.model.model_copy(update={"name": "b-own-name"}),
            "hardware": mine.hardware.model_copy(
                update={"device_memory_bytes": mine.hardware.device_memory_bytes + 1}
            ),
        }
    )
    assert theirs.model.fingerprint == mine.model.fingerprint and theirs.hardware.key == mine.hardware.key
    tid_a = api.post("/v1/traces", content=mine.canonical_json(), headers=a).json()["id"]
    tid_b = api.post("/v1/traces", content=theirs.canonical_json(), headers=b).json()["id"]
    pid_a = api.post("/v1/plans", json={"trace_id": tid_a, "constraints": LIMITS}, headers=a).json()["id"]
    for headers, own, other, tid, traces, plans in (
        (a, "a-secret-name", "b-own-name", tid_a, 1, 1),
        (b, "b-own-name", "a-secret-name", tid_b, 1, 0),
    ):
        models = api.get("/v1/models", headers=headers).json()
        assert [(m["name"], m["traces"], m["plans"]) for m in models] == [(own, traces, plans)]
        hardware = api.get("/v1/hardware", headers=headers).json()
        assert len(hardware) == 1 and (hardware[0]["traces"], hardware[0]["plans"]) == (traces, plans)
        expected_bytes = (mine if headers is a else theirs).hardware.device_memory_bytes
        assert hardware[0]["device_memory_bytes"] == expected_bytes
        assert api.get(f"/v1/traces/{tid}", headers=headers).json()["model_name"] == own
        assert [t["model_name"] for t in api.get("/v1/traces", headers=headers).json()["items"]] == [own]
        assert [
            t["id"] for t in api.get("/v1/traces", params={"model": own}, headers=headers).json()["items"]
        ] == [tid]
        assert api.get("/v1/traces", params={"model": other}, headers=headers).json()["items"] == []
        page = api.get("/ui/catalog", headers=headers).text
        assert own in page and other not in page
    plan = api.get(f"/v1/plans/{pid_a}", headers=a).json()
    assert plan["model_name"] == "a-secret-name"
    assert [p["model_name"] for p in api.get("/v1/plans", headers=a).json()["items"]] == ["a-secret-name"]
    assert "b-own-name" not in api.get("/ui/plans", headers=a).text


def test_tokens_are_stored_hashed_and_never_logged(secured, settings, caplog) -> None:  # type: ignore[no-untyped-def]
    api, a, _, token_a = secured
    with caplog.at_level(logging.DEBUG):
        api.get("/v1/plans", headers=a)
    assert token_a not in caplog.text
    engine = create_engine(settings.database_url)
    with engine.connect() as conn:
        stored = [
            tuple(r) for r in conn.execute(select(ApiTokenRow.digest, ApiTokenRow.prefix, ApiTokenRow.name))
        ]
    engine.dispose()
    assert stored and all(token_a not in "".join(r) for r in stored)


def test_rate_limit_answers_429_with_retry_after(settings: Settings) -> None:
    tight = settings.model_copy(update={"rate_limit_per_s": 1.0, "rate_limit_burst": 3})
    with TestClient(create_app(tight)) as api:
        codes = [api.get("/v1/plans").status_code for _ in range(5)]
        assert codes[:3] == [200, 200, 200] and codes[3] == 429
        r = api.get("/v1/plans")
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1


def test_service_refuses_a_public_address_without_auth() -> None:
    with pytest.raises(InsecureBind, match="MEMPLAN_AUTH"):
        check_bind("0.0.0.0", Settings(database_url="sqlite://"))
    check_bind("127.0.0.1", Settings(database_url="sqlite://"))
    check_bind("0.0.0.0", Settings(database_url="sqlite://", auth=True))
    res = subprocess.run(
        [sys.executable, "-m", "memplan", "serve", "--host", "0.0.0.0", "--port", "1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 2 and "without authentication" in res.stdout + res.stderr


def test_tokens_cli_prints_a_token_that_works(settings: Settings) -> None:
    import os

    env = {**os.environ, "MEMPLAN_DATABASE_URL": settings.database_url}
    res = subprocess.run(
        [sys.executable, "-m", "memplan", "tokens", "create", "--project", "team-x"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=True,
    )
    token = res.stdout.strip().splitlines()[-1]
    assert token.startswith("mp_")
    with TestClient(create_app(settings.model_copy(update={"auth": True}))) as api:
        assert api.get("/v1/plans", headers={"authorization": f"Bearer {token}"}).status_code == 200
