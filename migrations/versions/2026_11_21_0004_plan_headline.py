"""plan headline: the predictions and solver report that lists show, without the whole plan

Lists (API, CLI, history pages) read every row's Plan before this: a page of 50 plans with allocations
loaded ~150 MB. The headline (a few hundred bytes) is written with the result; existing rows are filled
from their stored plans here.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-21 11:20:00
"""

import json
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _headline(result: Any) -> dict[str, Any] | None:
    # A frozen copy of planner_service.db.repositories.plan_headline as of this revision (migrations do
    # not import the application, whose code moves on).
    if isinstance(result, str):
        result = json.loads(result)
    if not isinstance(result, dict):
        return None
    predictions = result.get("predictions")
    if isinstance(predictions, dict):
        predictions = {k: v for k, v in predictions.items() if k not in ("device_memory_timeline", "breakdown")}
    return {"predictions": predictions, "solver": result.get("solver")}


def upgrade() -> None:
    with op.batch_alter_table("plan", schema=None) as batch_op:
        batch_op.add_column(sa.Column("headline", sa.JSON(), nullable=True))
    plan = sa.table("plan", sa.column("id", sa.String), sa.column("result", sa.JSON),
                    sa.column("headline", sa.JSON))
    conn = op.get_bind()
    ids = [row.id for row in conn.execute(sa.select(plan.c.id).where(plan.c.result.isnot(None)))]
    for i in range(0, len(ids), 100):  # a hundred plans (megabytes each) at a time
        rows = conn.execute(sa.select(plan.c.id, plan.c.result).where(plan.c.id.in_(ids[i:i + 100]))).all()
        for row in rows:
            conn.execute(plan.update().where(plan.c.id == row.id).values(headline=_headline(row.result)))


def downgrade() -> None:
    with op.batch_alter_table("plan", schema=None) as batch_op:
        batch_op.drop_column("headline")
