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
        diff = compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True,
                                                                            "include_name": include_name}), Base.metadata)
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
