"""change notifications for plans and tokens (PostgreSQL)

A plan's entity tag (`planner_service.db.repositories.plan_etag`) depends on its status, attempts,
started_at, finished_at and its number of feedback rows. Triggers NOTIFY `memplan_plan_changed` with the
plan's id whenever one of these changes (or the plan is deleted), from inside the writing transaction, so
the notification is delivered at commit and never for a rolled-back write; any update or delete of an API
token (a revocation) NOTIFYs `memplan_token_changed`. API processes LISTEN and answer polls of unchanged
plans, and resolve tokens they have seen, from memory (`planner_service.db.change_feed`). Every writer is covered, including
ones that bypass the service (a `psql` session, a future migration). SQLite (the embedded single-process
default) has no triggers here: its service always asks the database.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-21 11:00:00
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

CHANNEL = "memplan_plan_changed"
TOKEN_CHANNEL = "memplan_token_changed"


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute(f"""
        CREATE FUNCTION memplan_notify_plan_changed() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            IF TG_TABLE_NAME = 'feedback' AND TG_OP = 'DELETE' THEN
                PERFORM pg_notify('{CHANNEL}', OLD.plan_id);
            ELSIF TG_TABLE_NAME = 'feedback' THEN
                PERFORM pg_notify('{CHANNEL}', NEW.plan_id);
            ELSIF TG_OP = 'DELETE' THEN
                PERFORM pg_notify('{CHANNEL}', OLD.id);
            ELSE
                PERFORM pg_notify('{CHANNEL}', NEW.id);
            END IF;
            RETURN NULL;
        END $$
    """)
    # Lease renewals (lease_expires_at) change nothing a client sees, so they notify nobody.
    op.execute("""
        CREATE TRIGGER plan_changed AFTER UPDATE ON plan FOR EACH ROW
        WHEN (OLD.status IS DISTINCT FROM NEW.status OR OLD.attempts IS DISTINCT FROM NEW.attempts
              OR OLD.started_at IS DISTINCT FROM NEW.started_at OR OLD.finished_at IS DISTINCT FROM NEW.finished_at
              OR OLD.id IS DISTINCT FROM NEW.id OR OLD.project_id IS DISTINCT FROM NEW.project_id)
        EXECUTE FUNCTION memplan_notify_plan_changed()
    """)
    op.execute("""
        CREATE TRIGGER plan_deleted AFTER DELETE ON plan FOR EACH ROW
        EXECUTE FUNCTION memplan_notify_plan_changed()
    """)
    op.execute("""
        CREATE TRIGGER feedback_changed AFTER INSERT OR DELETE ON feedback FOR EACH ROW
        EXECUTE FUNCTION memplan_notify_plan_changed()
    """)
    # A revoked (or deleted, or re-scoped) token must stop working at once in every API process.
    op.execute(f"""
        CREATE FUNCTION memplan_notify_token_changed() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            PERFORM pg_notify('{TOKEN_CHANNEL}', OLD.id);
            RETURN NULL;
        END $$
    """)
    op.execute("""
        CREATE TRIGGER api_token_changed AFTER UPDATE OR DELETE ON api_token FOR EACH ROW
        EXECUTE FUNCTION memplan_notify_token_changed()
    """)


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute("DROP TRIGGER IF EXISTS api_token_changed ON api_token")
    op.execute("DROP FUNCTION IF EXISTS memplan_notify_token_changed()")
    op.execute("DROP TRIGGER IF EXISTS feedback_changed ON feedback")
    op.execute("DROP TRIGGER IF EXISTS plan_deleted ON plan")
    op.execute("DROP TRIGGER IF EXISTS plan_changed ON plan")
    op.execute("DROP FUNCTION IF EXISTS memplan_notify_plan_changed()")
