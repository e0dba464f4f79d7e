"""plan: at most one pending (queued or running) plan per project and request key

Identical `POST /v1/plans` requests at once each found no plan to reuse and each inserted one (duplicate plans,
each solved). The unique partial index lets one insert; the others roll back and reuse it. A database upgraded
here may already hold pending duplicates: the earliest of each stays, the later ones are failed with an error
naming it (they were never going to be answered on their own: every request got its own copy's id, and a failed
plan may be requested again), so the index can be built.

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-30 06:10:00
"""

from collections.abc import Sequence
from datetime import UTC, datetime

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

PENDING_WHERE = "status IN ('queued', 'running')"


def upgrade() -> None:
    plan = sa.table(
        "plan",
        sa.column("id", sa.String),
        sa.column("project_id", sa.String),
        sa.column("request_key", sa.String),
        sa.column("status", sa.String),
        sa.column("error", sa.Text),
        sa.column("created_at", sa.DateTime(timezone=True)),
        sa.column("finished_at", sa.DateTime(timezone=True)),
    )
    conn = op.get_bind()
    pending = conn.execute(
        sa.select(plan.c.id, plan.c.project_id, plan.c.request_key)
        .where(plan.c.status.in_(("queued", "running")))
        .order_by(plan.c.created_at, plan.c.id)
    ).all()
    kept: dict[tuple[str, str], str] = {}
    for plan_id, project_id, key in pending:
        first = kept.setdefault((project_id, key), plan_id)
        if first != plan_id:
            conn.execute(
                plan.update()
                .where(plan.c.id == plan_id)
                .values(
                    status="failed",
                    error=f"an identical request's plan {first} was pending too (duplicate closed by migration 0011)",
                    finished_at=datetime.now(UTC),
                )
            )
    op.create_index(
        "uq_plan_pending_request",
        "plan",
        ["project_id", "request_key"],
        unique=True,
        sqlite_where=sa.text(PENDING_WHERE),
        postgresql_where=sa.text(PENDING_WHERE),
    )


def downgrade() -> None:
    op.drop_index("uq_plan_pending_request", table_name="plan")
