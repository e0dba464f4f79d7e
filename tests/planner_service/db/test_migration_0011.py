"""Migration 0011: one plan that did not fail per request key. Duplicates a database already holds (made by
identical requests at once before it) keep their status and rows, the later ones a key of their own, so the
unique index can be built; after it, the database refuses a second such plan of a request (SQLite and
PostgreSQL)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import create_engine, text
from sqlalchemy.exc import IntegrityError

from planner_service.app import create_app
from planner_service.db.migrate import downgrade, upgrade

COLUMNS = (
    "trace_id, project_id, model_fingerprint, hardware_key, workload_key, request_key, solver, solver_version, "
    "status, constraints, objective, error, attempts, revision"
)


def _copy(db_url: str, old: str, new: str) -> None:
    """A copy of plan `old` named `new`, made a second later (the later of two identical requests)."""
    engine = create_engine(db_url)
    with engine.begin() as conn:
        conn.execute(
            text(
                f"INSERT INTO plan (id, {COLUMNS}, created_at) SELECT :new, {COLUMNS}, :t FROM plan WHERE id = :old"
            ),
            {"new": new, "old": old, "t": datetime.now(UTC) + timedelta(seconds=1)},
        )
    engine.dispose()


@pytest.mark.parametrize("status", ["queued", "done"])
def test_0011_rekeys_later_duplicates_then_refuses_new_ones(
    settings, trace, db_url: str, status: str
) -> None:  # type: ignore[no-untyped-def]
    with TestClient(create_app(settings, workers=0)) as api:  # no worker: the plan stays queued
        tid = api.post("/v1/traces", content=trace.canonical_json()).json()["id"]
        pid = api.post(
            "/v1/plans", json={"trace_id": tid, "constraints": {"device_memory_bytes": 2**34}}
        ).json()["id"]
    downgrade(db_url, "0010")
    engine = create_engine(db_url)
    with engine.begin() as conn:
        conn.execute(text("UPDATE plan SET status = :s"), {"s": status})
        key = conn.execute(text("SELECT request_key FROM plan")).scalar_one()
    dup = "d" * 32
    _copy(db_url, pid, dup)  # a duplicate, as two requests at once made before 0011
    upgrade(db_url)
    with engine.connect() as conn:
        rows = {r[0]: (r[1], r[2]) for r in conn.execute(text("SELECT id, status, request_key FROM plan"))}
    assert rows[pid] == (status, key) and rows[dup][0] == status and rows[dup][1] != key
    with (
        pytest.raises(IntegrityError),
        engine.begin() as conn,
    ):  # the index: a second plan of the key is refused
        conn.execute(text("UPDATE plan SET request_key = :k WHERE id = :id"), {"k": key, "id": dup})
    with engine.begin() as conn:  # a failed plan is not reused: another of its request is allowed
        conn.execute(
            text("UPDATE plan SET status = 'failed', request_key = :k WHERE id = :id"), {"k": key, "id": dup}
        )
    engine.dispose()
    with TestClient(create_app(settings, workers=0)) as api:  # the request reuses the kept plan
        again = api.post("/v1/plans", json={"trace_id": tid, "constraints": {"device_memory_bytes": 2**34}})
    assert again.status_code == 200 and again.json()["id"] == pid
