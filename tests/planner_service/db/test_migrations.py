"""Migrations are the only source of the schema: head matches the ORM, downgrade to base works, old schemas are refused."""

from __future__ import annotations

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import create_engine, inspect

from planner_service.app import prepare_database
from planner_service.db.base import Base
from planner_service.db.migrate import (
    SchemaOutOfDate,
    current_revision,
    downgrade,
    head_revision,
    include_name,
    upgrade,
)
from planner_service.settings import Settings


def test_upgrade_to_head_matches_the_orm_models(empty_db_url: str) -> None:
    upgrade(empty_db_url)
    engine = create_engine(empty_db_url)
    with engine.connect() as conn:
        diff = compare_metadata(
            MigrationContext.configure(conn, opts={"compare_type": True, "include_name": include_name}),
            Base.metadata,
        )
    engine.dispose()
    assert diff == [], f"models and migrations disagree: {diff}"


def test_downgrade_to_base_removes_every_table_and_upgrade_again_works(empty_db_url: str) -> None:
    upgrade(empty_db_url)
    downgrade(empty_db_url, "base")
    engine = create_engine(empty_db_url)
    assert set(inspect(engine).get_table_names()) <= {"alembic_version"}
    upgrade(empty_db_url)
    assert current_revision(engine) == head_revision()
    engine.dispose()


def test_non_sqlite_service_refuses_an_out_of_date_schema_and_names_the_fix(empty_db_url: str) -> None:
    settings = Settings(database_url=empty_db_url, auto_upgrade=False)
    with pytest.raises(SchemaOutOfDate, match="memplan db upgrade"):
        prepare_database(settings)


def test_embedded_sqlite_default_upgrades_itself(tmp_path) -> None:  # type: ignore[no-untyped-def]
    settings = Settings(database_url=f"sqlite:///{tmp_path / 'sub' / 'm.db'}")
    assert settings.should_auto_upgrade
    db = prepare_database(settings)
    assert current_revision(db.engine) == head_revision()
    db.dispose()


def test_default_database_is_sqlite_under_the_user_data_dir(monkeypatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    monkeypatch.delenv("MEMPLAN_DATABASE_URL", raising=False)
    assert Settings().database_url == f"sqlite:///{tmp_path / 'memplan' / 'memplan.db'}"
    assert not Settings(database_url="postgresql+psycopg://x@h/db").should_auto_upgrade


def test_0005_splits_the_shared_catalogue_and_each_project_gets_its_own_names_back(empty_db_url: str) -> None:
    """Before 0005 two projects with one model fingerprint shared a row (the first uploader's name). The
    upgrade gives each project a row named from its own stored trace; the downgrade merges them again."""
    import gzip
    import json
    from datetime import UTC, datetime

    from sqlalchemy import text

    upgrade(empty_db_url, "0004")
    engine = create_engine(empty_db_url)
    now = datetime.now(UTC)
    with engine.begin() as conn:
        conn.execute(
            text("INSERT INTO project (id, name, created_at) VALUES ('b', 'project-b', :t)"), {"t": now}
        )
        conn.execute(text("INSERT INTO model VALUES ('fp', 'name-of-a', 'Arch', 10, :t)"), {"t": now})
        conn.execute(
            text("INSERT INTO hardware VALUES ('cpu:x:1GiB:x1', 'cpu', 'x', 1073741824, 1, :t)"), {"t": now}
        )
        for trace_id, project, name, memory in (
            ("t1", "default", "name-of-a", 2**30),
            ("t2", "b", "name-of-b", 2**30 + 7),
        ):
            payload = gzip.compress(
                json.dumps(
                    {
                        "model": {"name": name, "architecture": "Arch", "parameter_count": 10},
                        "hardware": {
                            "device_type": "cpu",
                            "device_name": "x",
                            "device_memory_bytes": memory,
                            "device_count": 1,
                        },
                    }
                ).encode()
            )
            conn.execute(
                text(
                    "INSERT INTO trace (id, project_id, content_hash, model_fingerprint, hardware_key, "
                    "workload_key, schema_version, payload_gzip, payload_bytes, created_at) VALUES "
                    "(:id, :p, :id, 'fp', 'cpu:x:1GiB:x1', 'w', 2, :g, 1, :t)"
                ),
                {"id": trace_id, "p": project, "g": payload, "t": now},
            )
    upgrade(empty_db_url, "0005")
    with engine.connect() as conn:
        models = conn.execute(text("SELECT project_id, name FROM model ORDER BY project_id")).all()
        hardware = conn.execute(
            text("SELECT project_id, device_memory_bytes FROM hardware ORDER BY project_id")
        ).all()
    assert [tuple(r) for r in models] == [("b", "name-of-b"), ("default", "name-of-a")]
    assert [tuple(r) for r in hardware] == [("b", 2**30 + 7), ("default", 2**30)]
    downgrade(empty_db_url, "0004")
    with engine.connect() as conn:
        assert [tuple(r) for r in conn.execute(text("SELECT fingerprint, name FROM model"))] == [
            ("fp", "name-of-a")
        ]
        assert conn.execute(text("SELECT count(*) FROM trace")).scalar_one() == 2
    engine.dispose()


def test_a_downgrade_and_upgrade_keep_every_plan_and_feedback_row(api, trace, db_url: str) -> None:  # type: ignore[no-untyped-def]
    """SQLite migrations rebuild tables (Alembic batch mode); with foreign keys enforced, dropping the old
    `trace` or `plan` table deleted the plans and feedback that referenced it (ON DELETE CASCADE)."""
    from sqlalchemy import text

    tid = api.post("/v1/traces", content=trace.canonical_json()).json()["id"]
    pid = api.post("/v1/plans", json={"trace_id": tid, "constraints": {"device_memory_bytes": 2**34}}).json()[
        "id"
    ]
    assert api.get(f"/v1/plans/{pid}", params={"wait": 30}).json()["status"] == "done"
    fb = {"iteration_s": 1.0, "peak_device_bytes": 1, "peak_host_bytes": 0, "steps_measured": 1}
    phases = {"forward_s": 0.25, "backward_s": 0.5, "step_s": 0.25, "uploads_per_iteration": 3.0}
    assert api.post(f"/v1/plans/{pid}/feedback", json=fb | {"phases": phases}).status_code == 201
    assert api.get(f"/v1/plans/{pid}").json()["feedback"][0]["feedback"]["phases"] == phases
    engine = create_engine(db_url)

    def counts() -> tuple[int, ...]:
        with engine.connect() as conn:
            return tuple(
                conn.execute(text(f"SELECT count(*) FROM {t}")).scalar_one()
                for t in ("trace", "plan", "feedback", "model", "hardware")
            )

    assert counts() == (1, 1, 1, 1, 1)
    downgrade(db_url, "0003")
    assert counts() == (1, 1, 1, 1, 1)
    upgrade(db_url)
    assert counts() == (1, 1, 1, 1, 1)
    engine.dispose()
    kept = api.get(f"/v1/plans/{pid}").json()["feedback"][0]
    # the phases went with 0010's columns (an agent before them measured none); the row and its figures stayed
    assert kept["feedback"]["steps_measured"] == 1 and kept["feedback"]["phases"] is None
