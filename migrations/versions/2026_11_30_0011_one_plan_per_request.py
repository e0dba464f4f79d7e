"""plan: at most one plan that did not fail per project and request key

Identical `POST /v1/plans` requests at once each found no plan to reuse and each inserted one (duplicate plans,
each solved). The unique partial index (every status but `failed`, the plans a request reuses) lets one insert;
the others roll back and reuse it. A database upgraded here may already hold such duplicates: the earliest of
each keeps the request key (it is the one reuse returned: the earliest first), the later ones get a key of their
own (the old key hashed with their id), so the index can be built. No plan changes status or loses anything:
every duplicate keeps its result, feedback and id (a requester that got one still reads it), it is only no
longer found by reuse, which it never was.

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-30 06:10:00
"""

import hashlib
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

REUSABLE_WHERE = "status <> 'failed'"


def upgrade() -> None:
    plan = sa.table(
        "plan",
        sa.column("id", sa.String),
        sa.column("project_id", sa.String),
        sa.column("request_key", sa.String),
        sa.column("status", sa.String),
        sa.column("created_at", sa.DateTime(timezone=True)),
    )
    conn = op.get_bind()
    reusable = conn.execute(
        sa.select(plan.c.id, plan.c.project_id, plan.c.request_key)
        .where(plan.c.status != "failed")
        .order_by(plan.c.created_at, plan.c.id)
    ).all()
    first: dict[tuple[str, str], str] = {}
    for plan_id, project_id, key in reusable:
        if first.setdefault((project_id, key), plan_id) != plan_id:
            own = hashlib.sha256(f"{key}:{plan_id}".encode()).hexdigest()
            conn.execute(plan.update().where(plan.c.id == plan_id).values(request_key=own))
    op.create_index(
        "uq_plan_request",
        "plan",
        ["project_id", "request_key"],
        unique=True,
        sqlite_where=sa.text(REUSABLE_WHERE),
        postgresql_where=sa.text(REUSABLE_WHERE),
    )


def downgrade() -> None:
    op.drop_index("uq_plan_request", table_name="plan")
