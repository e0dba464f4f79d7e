"""solve jobs on procrastinate (PostgreSQL); the plan table's lease columns go

PostgreSQL: procrastinate's own schema (the `schema.sql` shipped in the installed package: its tables,
types, functions and triggers, all named `procrastinate_*`) is applied here, so Alembic stays the one way
the schema is made. This revision is for procrastinate's schema at migration level `SCHEMA_LEVEL` (the last
file in the package's `sql/migrations/`); an installed procrastinate whose schema is newer is refused here
with a message, not applied silently: a procrastinate upgrade that changes the schema gets its own Alembic
revision that executes the package's new migration files in order (docs/ARCHITECTURE.md, "Solve jobs").

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
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

SCHEMA_LEVEL = "03.04.00_50_post_add_retry_failed_job_procedure.sql"


def _procrastinate_schema() -> str:
    sql = resources.files("procrastinate.sql")
    levels = sorted(p.name for p in (sql / "migrations").iterdir() if p.name.endswith(".sql"))
    if levels[-1] != SCHEMA_LEVEL:
        raise RuntimeError(
            f"the installed procrastinate's schema is at {levels[-1]}; revision 0006 applies level {SCHEMA_LEVEL}. "
            "Install the procrastinate version pinned in pyproject.toml, or add an Alembic revision for the newer "
            "schema (docs/ARCHITECTURE.md, 'Solve jobs')")
    return (sql / "schema.sql").read_text(encoding="utf-8")


def upgrade() -> None:
    with op.batch_alter_table("plan") as batch:
        batch.drop_column("lease_owner")
        batch.drop_column("lease_expires_at")
    bind = op.get_bind()
    if bind.dialect.name != "postgresql":
        return
    # Through the driver: the SQL is procrastinate's, run as it ships (no bind-parameter parsing of its text).
    bind.connection.driver_connection.execute(_procrastinate_schema())  # type: ignore[union-attr]


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
