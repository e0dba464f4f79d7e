"""hardware: the process group of multi-rank jobs (world size, ranks per node) beside the device (issue 20)

Every trace stored before this revision came from one process (the contract had no process group), so the
columns start at 1 for existing rows; the hardware key of a multi-rank trace already names its group.

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-25 06:40:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("hardware") as batch:
        batch.add_column(sa.Column("world_size", sa.Integer(), nullable=False, server_default="1"))
        batch.add_column(sa.Column("ranks_per_node", sa.Integer(), nullable=False, server_default="1"))


def downgrade() -> None:
    with op.batch_alter_table("hardware") as batch:
        batch.drop_column("ranks_per_node")
        batch.drop_column("world_size")
