"""Polls of unchanged plans and known tokens answered from memory on PostgreSQL, kept honest by the
database's notifications.

Real PostgreSQL throughout: the triggers of migration 0003, the API's LISTEN connection, and changes made
through other connections (as another API process or a worker would make them).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import create_engine, text

from planner_service.app import create_app
from planner_service.auth import create_token, digest, revoke_token
from planner_service.db.change_feed import APPLICATION_NAME, PLAN_CHANNEL, TOKEN_CHANNEL, ChangeFeed
from planner_service.db.session import Database
from planner_service.observability import POLL_ANSWERS
from planner_service.settings import Settings

pytestmark = pytest.mark.postgres

# Feedback written past the service, as another API process would (psycopg placeholder for the plan id).
ADD_FEEDBACK = (
    "INSERT INTO feedback (id, plan_id, iteration_s, peak_device_bytes, peak_host_bytes, steps_measured, "
    "notes, created_at) VALUES (md5(random()::text), %(p)s, 1.0, 1, 1, 5, '', now())"
)
LIMITS = {"device_memory_bytes": 8 * 2**30, "time_limit_s": 2}


def _libpq(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://")


def _eventually(check: Callable[[], Any], timeout: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got or time.monotonic() > deadline:
            return got
        time.sleep(0.02)


@pytest.fixture
def api(postgres_url: str) -> Iterator[TestClient]:
    settings = Settings(
        database_url=postgres_url,
        workers=1,
        poll_interval_s=0.05,
        stalled_after_s=5.0,
        auto_upgrade=False,
        ingest_prestart=False,
    )
    with TestClient(create_app(settings)) as client:
        assert _eventually(lambda: client.app.state.change_feed.listening)  # type: ignore[attr-defined]
        yield client


def _reads(source: str) -> float:
    return POLL_ANSWERS.labels(source)._value.get()


def _done_plan(api: TestClient, trace: Any) -> tuple[str, str]:
    trace_id = api.post("/v1/traces", content=trace.canonical_json()).json()["id"]
    plan_id = api.post("/v1/plans", json={"trace_id": trace_id, "constraints": LIMITS}).json()["id"]
    done = api.get(f"/v1/plans/{plan_id}", params={"wait": 30})
    assert done.json()["status"] in ("done", "infeasible")
    return plan_id, done.headers["etag"]


def test_polls_of_an_unchanged_plan_are_answered_from_memory(api: TestClient, trace: Any) -> None:
    plan_id, tag = _done_plan(api, trace)
    before = _reads("shortcut")
    for _ in range(5):
        r = api.get(f"/v1/plans/{plan_id}", headers={"if-none-match": tag})
        assert r.status_code == 304 and r.headers["etag"] == tag and r.content == b""
        assert r.headers["x-request-id"]  # answered inside the observability middleware
    assert _reads("shortcut") - before >= 4  # the first poll may have had to ask the database
    assert 'route="/v1/plans/{plan_id}",status="304"' in api.get("/metrics").text  # labelled as the route's
    # What the shortcut leaves to the route: a long-poll (query string), a tag that does not match.
    before = {source: _reads(source) for source in ("shortcut", "memory", "database")}
    r = api.get(f"/v1/plans/{plan_id}", params={"wait": 0}, headers={"if-none-match": tag})
    assert r.status_code == 304 and r.headers["etag"] == tag
    stale = api.get(f"/v1/plans/{plan_id}", headers={"if-none-match": '"not-the-tag"'})
    assert stale.status_code == 200 and stale.json()["id"] == plan_id and stale.headers["etag"] == tag
    assert _reads("shortcut") == before["shortcut"]
    assert _reads("memory") + _reads("database") > before["memory"] + before["database"]
    # Memory never answers for another project: the database does (404 there, tested in test_auth.py).
    feed: ChangeFeed = api.app.state.change_feed  # type: ignore[attr-defined]
    assert feed.tag(plan_id, "some-other-project") is None


def test_a_change_through_another_connection_reaches_the_next_polls(
    api: TestClient, trace: Any, postgres_url: str
) -> None:
    """As a second API process or a worker would change it: a committed write notifies, the tag is dropped,
    the next poll with the old tag gets the new record."""
    plan_id, tag = _done_plan(api, trace)
    assert api.get(f"/v1/plans/{plan_id}", headers={"if-none-match": tag}).status_code == 304
    engine = create_engine(postgres_url)
    with engine.begin() as conn:
        conn.execute(text(ADD_FEEDBACK.replace("%(p)s", ":p")), {"p": plan_id})
    engine.dispose()
    changed = _eventually(
        lambda: (
            (r := api.get(f"/v1/plans/{plan_id}", headers={"if-none-match": tag})).status_code == 200 and r
        )
    )
    assert changed and changed.headers["etag"] != tag and len(changed.json()["feedback"]) == 1


def test_feedback_posted_here_is_seen_by_the_very_next_poll(api: TestClient, trace: Any) -> None:
    plan_id, tag = _done_plan(api, trace)
    if api.get(f"/v1/plans/{plan_id}").json()["status"] != "done":
        pytest.skip("feedback is for done plans; this instance solved infeasible")
    assert api.get(f"/v1/plans/{plan_id}", headers={"if-none-match": tag}).status_code == 304
    posted = api.post(
        f"/v1/plans/{plan_id}/feedback",
        json={"iteration_s": 1.0, "peak_device_bytes": 1, "peak_host_bytes": 1, "steps_measured": 5},
    )
    assert posted.status_code == 201
    r = api.get(f"/v1/plans/{plan_id}", headers={"if-none-match": tag})  # no wait for the notification
    assert r.status_code == 200 and len(r.json()["feedback"]) == 1


def test_long_poll_wakes_on_the_change_notification(api: TestClient, trace: Any, postgres_url: str) -> None:
    plan_id, tag = _done_plan(api, trace)
    engine = create_engine(postgres_url)

    def change_soon() -> None:
        time.sleep(0.5)
        with engine.begin() as conn:
            conn.execute(text("UPDATE plan SET attempts = attempts + 1 WHERE id = :p"), {"p": plan_id})

    import threading

    writer = threading.Thread(target=change_soon)
    writer.start()
    r = api.get(f"/v1/plans/{plan_id}", params={"wait": 20}, headers={"if-none-match": tag})
    writer.join()
    engine.dispose()
    assert r.status_code == 200 and r.headers["etag"] != tag and r.json()["attempts"] == 2


def test_triggers_notify_for_what_the_tag_depends_on_and_not_for_other_columns(
    postgres_url: str, trace: Any
) -> None:
    settings = Settings(database_url=postgres_url, workers=0, auto_upgrade=False, ingest_prestart=False)
    with TestClient(create_app(settings)) as api:  # a plan row; then no service runs (no worker re-queues it)
        trace_id = api.post("/v1/traces", content=trace.canonical_json()).json()["id"]
        plan_id = api.post("/v1/plans", json={"trace_id": trace_id, "constraints": LIMITS}).json()["id"]
    with (
        psycopg.connect(_libpq(postgres_url), autocommit=True) as listener,
        psycopg.connect(_libpq(postgres_url), autocommit=True) as writer,
    ):
        listener.execute(f"LISTEN {PLAN_CHANNEL}")
        statements = [
            "UPDATE plan SET error = 'a note' WHERE id = %(p)s",  # not part of the tag: nobody is told
            "UPDATE plan SET status = 'running' WHERE id = %(p)s",
            "UPDATE plan SET attempts = attempts + 1 WHERE id = %(p)s",
            "UPDATE plan SET started_at = now() WHERE id = %(p)s",
            "UPDATE plan SET finished_at = now() WHERE id = %(p)s",
            ADD_FEEDBACK,
            "DELETE FROM feedback WHERE plan_id = %(p)s",
            "DELETE FROM plan WHERE id = %(p)s",
        ]
        for sql in statements:
            writer.execute(sql, {"p": plan_id})
        with writer.transaction():  # rolled back: never announced
            writer.execute("UPDATE plan SET status = 'queued' WHERE id = 'none'")
        got = [n.payload for n in listener.notifies(timeout=5, stop_after=len(statements) - 1)]
        assert got == [plan_id] * (len(statements) - 1)
        assert list(listener.notifies(timeout=0.3)) == []


def test_a_lost_listener_empties_the_cache_and_comes_back(
    api: TestClient, trace: Any, postgres_url: str
) -> None:
    plan_id, tag = _done_plan(api, trace)
    feed: ChangeFeed = api.app.state.change_feed  # type: ignore[attr-defined]
    feed.reconnect_s = 0.1
    assert api.get(f"/v1/plans/{plan_id}", headers={"if-none-match": tag}).status_code == 304
    assert feed.tag(plan_id, "default") == tag
    generation = feed.generation
    with psycopg.connect(_libpq(postgres_url), autocommit=True) as admin:
        admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = current_database() AND application_name = %s",
            (APPLICATION_NAME,),
        )
    assert _eventually(lambda: feed.generation >= generation + 2 and feed.listening)  # lost, then back
    assert feed.tag(plan_id, "default") is None  # what it knew may have missed changes: forgotten
    assert api.get(f"/v1/plans/{plan_id}", headers={"if-none-match": tag}).status_code == 304  # asked the db


def test_a_tag_read_while_a_notification_came_in_is_not_kept(postgres_url: str) -> None:
    async def scenario() -> tuple[str | None, str | None]:
        feed = ChangeFeed(_libpq(postgres_url))
        feed.start()
        try:
            for _ in range(500):
                if feed.listening:
                    break
                await asyncio.sleep(0.01)
            before = feed.generation  # a read starts here ...
            async with await psycopg.AsyncConnection.connect(_libpq(postgres_url), autocommit=True) as conn:
                await conn.execute(
                    f"SELECT pg_notify('{PLAN_CHANNEL}', 'p1')"
                )  # ... a change commits meanwhile
            for _ in range(500):  # the notification arrives
                if feed.notifications:
                    break
                await asyncio.sleep(0.01)
            feed.remember("p1", "default", '"old"', before)  # ... and the read's (stale) answer lands
            stale = feed.tag("p1", "default")
            feed.remember("p2", "default", '"fresh"', feed.generation)
            return stale, feed.tag("p2", "default")
        finally:
            await feed.stop()

    stale, fresh = asyncio.run(scenario())
    assert stale is None and fresh == '"fresh"'


def test_a_known_token_is_resolved_from_memory_until_it_is_revoked(postgres_url: str, trace: Any) -> None:
    settings = Settings(
        database_url=postgres_url, workers=0, auto_upgrade=False, ingest_prestart=False, auth=True
    )
    db = Database(postgres_url)
    with db.session() as s:
        token, row = create_token(s, "project-a")
    with TestClient(create_app(settings)) as api:
        feed: ChangeFeed = api.app.state.change_feed  # type: ignore[attr-defined]
        assert _eventually(lambda: feed.listening)
        headers = {"authorization": f"Bearer {token}"}
        assert api.get("/v1/plans", headers=headers).status_code == 200
        assert feed.token_owner(digest(token)) is not None  # the next request needs no query
        assert api.get("/v1/plans", headers=headers).status_code == 200
        trace_id = api.post("/v1/traces", content=trace.canonical_json(), headers=headers).json()["id"]
        plan = api.post("/v1/plans", json={"trace_id": trace_id, "constraints": LIMITS}, headers=headers)
        poll = {
            **headers,
            "if-none-match": api.get(f"/v1/plans/{plan.json()['id']}", headers=headers).headers["etag"],
        }
        before = _reads("shortcut")
        assert api.get(f"/v1/plans/{plan.json()['id']}", headers=poll).status_code == 304
        assert _reads("shortcut") == before + 1  # token and tag from memory, before routing
        other_token = None
        with db.session() as s:
            other_token, _ = create_token(s, "project-b")
        other = api.get(
            f"/v1/plans/{plan.json()['id']}", headers={**poll, "authorization": f"Bearer {other_token}"}
        )
        assert other.status_code == 404  # another project's token: never from memory
        with db.session() as s:  # revoked past this process (the CLI, another API process)
            assert revoke_token(s, row.id)
        assert _eventually(lambda: api.get("/v1/plans", headers=headers).status_code == 401)
        assert feed.token_owner(digest(token)) is None
        assert api.get(f"/v1/plans/{plan.json()['id']}", headers=poll).status_code == 401
    db.dispose()


def test_token_changes_notify(postgres_url: str) -> None:
    db = Database(postgres_url)
    with db.session() as s:
        _, row = create_token(s, "project-a")
    with psycopg.connect(_libpq(postgres_url), autocommit=True) as listener:
        listener.execute(f"LISTEN {TOKEN_CHANNEL}")
        with db.session() as s:
            revoke_token(s, row.id)
        with db.session() as s:
            s.execute(text("DELETE FROM api_token"))
        got = [(n.channel, n.payload) for n in listener.notifies(timeout=5, stop_after=2)]
    db.dispose()
    assert got == [(TOKEN_CHANNEL, row.id)] * 2


def test_the_rate_limit_holds_for_polls_answered_from_memory(postgres_url: str, trace: Any) -> None:
    settings = Settings(
        database_url=postgres_url,
        workers=0,
        auto_upgrade=False,
        ingest_prestart=False,
        rate_limit_per_s=0.01,
        rate_limit_burst=6,
    )
    with TestClient(create_app(settings)) as api:
        assert _eventually(lambda: api.app.state.change_feed.listening)  # type: ignore[attr-defined]
        trace_id = api.post("/v1/traces", content=trace.canonical_json()).json()["id"]
        plan_id = api.post("/v1/plans", json={"trace_id": trace_id, "constraints": LIMITS}).json()["id"]
        tag = api.get(f"/v1/plans/{plan_id}").headers["etag"]
        statuses = [
            api.get(f"/v1/plans/{plan_id}", headers={"if-none-match": tag}).status_code for _ in range(5)
        ]
    assert statuses[:3] == [304, 304, 304] and statuses[3:] == [429, 429]  # 6 = upload, request, GET, 3 polls
