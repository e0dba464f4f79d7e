"""what-if sweeps: one row per sweep request, its points naming the plans that answer them

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-25 04:15:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "sweep",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("project_id", sa.String(64), sa.ForeignKey("project.id", ondelete="CASCADE"), nullable=False),
        sa.Column("request", sa.JSON(), nullable=False),
        sa.Column("points", sa.JSON(), nullable=False),
        sa.Column("n_points", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_sweep_project_id", "sweep", ["project_id"])


def downgrade() -> None:
    op.drop_index("ix_sweep_project_id", table_name="sweep")
    op.drop_table("sweep")
