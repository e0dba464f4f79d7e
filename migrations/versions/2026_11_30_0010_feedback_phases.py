"""feedback: the measured iteration by phase and each phase's error against the plan's prediction

Feedback stored before this revision has no phases (the agent measured the iteration and the peaks only): both
columns are NULL for it.

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-30 02:45:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("feedback") as batch:
        batch.add_column(sa.Column("phases", sa.JSON(), nullable=True))
        batch.add_column(sa.Column("phase_errors", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("feedback") as batch:
        batch.drop_column("phase_errors")
        batch.drop_column("phases")
