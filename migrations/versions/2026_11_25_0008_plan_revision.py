"""plan revision: a finished plan's stored Plan can change once more, when the agent sends its managed iteration

The allocation a plan carries was the placement of the profiled (un-managed) iteration. The agent now
records one iteration run under the plan and sends it (`PUT /v1/plans/{id}/allocation`); the service places
it and stores it as the plan's allocation. That changes a finished plan's body, so its entity tag must change
too: `revision` counts such changes, is part of `plan_etag`, and (PostgreSQL) the plan-changed trigger
notifies on it like on the other inputs of the tag.

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-25 06:30:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_TRIGGER = """
    CREATE TRIGGER plan_changed AFTER UPDATE ON plan FOR EACH ROW
    WHEN (OLD.status IS DISTINCT FROM NEW.status OR OLD.attempts IS DISTINCT FROM NEW.attempts
          OR OLD.started_at IS DISTINCT FROM NEW.started_at OR OLD.finished_at IS DISTINCT FROM NEW.finished_at
          OR OLD.id IS DISTINCT FROM NEW.id OR OLD.project_id IS DISTINCT FROM NEW.project_id{extra})
    EXECUTE FUNCTION memplan_notify_plan_changed()
"""


def upgrade() -> None:
    with op.batch_alter_table("plan", schema=None) as batch_op:
        batch_op.add_column(sa.Column("revision", sa.Integer(), nullable=False, server_default="0"))
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP TRIGGER IF EXISTS plan_changed ON plan")
        op.execute(_TRIGGER.format(extra="\n          OR OLD.revision IS DISTINCT FROM NEW.revision"))


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP TRIGGER IF EXISTS plan_changed ON plan")
        op.execute(_TRIGGER.format(extra=""))
    with op.batch_alter_table("plan", schema=None) as batch_op:
        batch_op.drop_column("revision")
