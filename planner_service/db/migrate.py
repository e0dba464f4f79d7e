"""Run Alembic programmatically (`memplan db upgrade|downgrade`) and check the schema is current.

This module imports `session` (engines), never the other way round: the readiness probe, which needs both,
lives here (`probe_revision`), so the database layer has no import cycle (tests/test_import_graph.py).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine, create_engine
from sqlalchemy.pool import NullPool

from planner_service.db.deadline import StatementDeadline
from planner_service.db.session import Database, Timeouts, make_engine

UPGRADE_HINT = "run `memplan db upgrade` (with the same MEMPLAN_DATABASE_URL) to bring the schema to head"


class SchemaOutOfDate(RuntimeError):
    """The database schema is not at the code's migration head."""


def include_name(name: str | None, type_: str, parent_names: object) -> bool:
    """What Alembic compares with the ORM models: not procrastinate's own tables (revision 0006 applies
    procrastinate's schema as it ships; the ORM does not map it)."""
    return not (
        type_ in ("table", "index") and (name or "").startswith(("procrastinate_", "idx_procrastinate_"))
    )


def migrations_dir() -> Path:
    here = Path(__file__).resolve().parent.parent
    packaged = here / "_migrations"  # wheel installs ship the migrations inside the package
    return packaged if packaged.is_dir() else here.parent / "migrations"


def alembic_config(url: str) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(migrations_dir()))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    cfg.set_main_option("file_template", "%%(year)d_%%(month).2d_%%(day).2d_%%(rev)s_%%(slug)s")
    return cfg


def _run(url: str, fn: Callable[[Config, str], None], revision: str) -> None:
    """Run an Alembic command on our own engine (SQLite pragmas, parent directory created)."""
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            sqlite = engine.dialect.name == "sqlite"
            if sqlite:
                # Alembic's batch mode rebuilds a SQLite table (create, copy, drop, rename); with foreign keys
                # enforced, dropping the old table deletes every row that references it (ON DELETE CASCADE:
                # rebuilding `trace` emptied `plan`). Off for the migration (the pragma only works outside a
                # transaction), and every reference checked before the commit instead.
                conn.exec_driver_sql("PRAGMA foreign_keys=OFF")
                conn.commit()
            with conn.begin():
                cfg = alembic_config(url)
                cfg.attributes["connection"] = conn
                fn(cfg, revision)
                if sqlite and (broken := conn.exec_driver_sql("PRAGMA foreign_key_check").all()):
                    raise RuntimeError(
                        f"migration to {revision} left rows with broken references: {broken[:5]}"
                    )
            if sqlite:
                conn.exec_driver_sql("PRAGMA foreign_keys=ON")
                conn.commit()
    finally:
        engine.dispose()


def upgrade(url: str, revision: str = "head") -> None:
    _run(url, command.upgrade, revision)


def downgrade(url: str, revision: str = "-1") -> None:
    _run(url, command.downgrade, revision)


def head_revision() -> str | None:
    return ScriptDirectory.from_config(alembic_config("sqlite://")).get_current_head()


def current_revision(engine: Engine) -> str | None:
    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def probe_revision(db: Database, timeout_s: float) -> str | None:
    """The schema revision of `db`, read on a new connection (not a pooled one, which may be stuck behind a
    frozen server) that gives up within about `timeout_s`: the readiness check."""
    if db.engine.dialect.name != "postgresql":
        return current_revision(db.engine)
    seconds = max(1, int(timeout_s))
    probe = create_engine(
        db.url,
        poolclass=NullPool,
        connect_args=Timeouts(connect_s=seconds, statement_s=timeout_s).connect_args(),
    )
    deadline = StatementDeadline(probe, timeout_s)
    try:
        return current_revision(probe)
    finally:
        deadline.close()
        probe.dispose()


def require_current(engine: Engine) -> None:
    """Refuse to run on an out-of-date schema, naming the command that fixes it."""
    current, head = current_revision(engine), head_revision()
    if current != head:
        raise SchemaOutOfDate(
            f"database schema is at {current or 'no revision'}, code needs {head}: {UPGRADE_HINT}"
        )
