"""solve jobs on procrastinate (PostgreSQL); the plan table's lease columns go

PostgreSQL: procrastinate's own schema (the `schema.sql` shipped in the installed package: its tables,
types, functions and triggers, all named `procrastinate_*`) is applied here, so Alembic stays the one way
the schema is made, and the schema level it brings (the last file of the package's `sql/migrations/`, which
`schema.sql` includes) is recorded as the comment of `procrastinate_jobs`. A later procrastinate that changes
its schema gets its own revision, which executes the package's migration files named after the recorded
level, in order, and records the new level (docs/architecture/jobs.md, "Upgrading procrastinate").

Both databases: the plan's lease (`lease_owner`, `lease_expires_at`) is dropped: workers no longer claim
plan rows (on SQLite the in-process pool runs them; see planner_service/jobs/).

Revision ID: 0006
Revises: 0004 (to be re-chained after 0005)
Create Date: 2026-11-25 03:30:00
"""

from collections.abc import Sequence
from importlib import resources

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

LEVEL_PREFIX = "memplan: procrastinate schema level "


def _procrastinate_schema() -> tuple[str, str]:
    """(schema.sql, its level: the name of the last migration file it includes)."""
    sql = resources.files("procrastinate.sql")
    level = max(p.name for p in (sql / "migrations").iterdir() if p.name.endswith(".sql"))
    return (sql / "schema.sql").read_text(encoding="utf-8"), level


def upgrade() -> None:
    with op.batch_alter_table("plan") as batch:
        batch.drop_column("lease_owner")
        batch.drop_column("lease_expires_at")
    bind = op.get_bind()
    if bind.dialect.name != "postgresql":
        return
    schema, level = _procrastinate_schema()
    # Through the driver: the SQL is procrastinate's, run as it ships (no bind-parameter parsing of its text).
    driver = bind.connection.driver_connection
    driver.execute(schema)  # type: ignore[union-attr]
    driver.execute(f"COMMENT ON TABLE procrastinate_jobs IS '{LEVEL_PREFIX}{level}'")  # type: ignore[union-attr]


def downgrade() -> None:
    bind = op.get_bind()
    if bind.dialect.name == "postgresql":
        op.execute("DROP TABLE IF EXISTS procrastinate_events, procrastinate_periodic_defers, procrastinate_jobs, "
                   "procrastinate_workers CASCADE")
        op.execute("""
            DO $$ DECLARE f record; BEGIN
                FOR f IN SELECT p.oid::regprocedure AS sig FROM pg_proc p
                         JOIN pg_namespace n ON n.oid = p.pronamespace
                         WHERE n.nspname = current_schema() AND p.proname LIKE 'procrastinate\\_%'
                LOOP EXECUTE 'DROP FUNCTION ' || f.sig || ' CASCADE'; END LOOP;
            END $$
        """)
        op.execute("DROP TYPE IF EXISTS procrastinate_job_to_defer_v1, procrastinate_job_event_type, "
                   "procrastinate_job_status CASCADE")
    with op.batch_alter_table("plan") as batch:
        batch.add_column(sa.Column("lease_owner", sa.String(length=128), nullable=True))
        batch.add_column(sa.Column("lease_expires_at", sa.DateTime(timezone=True), nullable=True))
