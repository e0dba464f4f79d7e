"""projects and api tokens

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-21 05:59:32.432328
"""

from collections.abc import Sequence
from datetime import UTC, datetime

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "project",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_project")),
        sa.UniqueConstraint("name", name=op.f("uq_project_name")),
    )
    # Every existing trace and plan moves to the default project (the tenant of an un-authenticated service).
    project = sa.table(
        "project",
        sa.column("id", sa.String),
        sa.column("name", sa.String),
        sa.column("created_at", sa.DateTime(timezone=True)),
    )
    op.bulk_insert(project, [{"id": "default", "name": "default", "created_at": datetime.now(UTC)}])
    op.create_table(
        "api_token",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("project_id", sa.String(length=64), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("prefix", sa.String(length=16), nullable=False),
        sa.Column("digest", sa.String(length=64), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["project_id"], ["project.id"], name=op.f("fk_api_token_project_id_project"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_api_token")),
        sa.UniqueConstraint("digest", name=op.f("uq_api_token_digest")),
    )
    with op.batch_alter_table("api_token", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_api_token_project_id"), ["project_id"], unique=False)

    with op.batch_alter_table("plan", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("project_id", sa.String(length=64), nullable=False, server_default="default")
        )
        batch_op.create_index(batch_op.f("ix_plan_project_id"), ["project_id"], unique=False)
        batch_op.create_foreign_key(
            batch_op.f("fk_plan_project_id_project"), "project", ["project_id"], ["id"], ondelete="CASCADE"
        )

    with op.batch_alter_table("trace", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("project_id", sa.String(length=64), nullable=False, server_default="default")
        )
        batch_op.drop_constraint(batch_op.f("uq_trace_content_hash"), type_="unique")
        batch_op.create_unique_constraint("uq_trace_project_content", ["project_id", "content_hash"])
        batch_op.create_foreign_key(
            batch_op.f("fk_trace_project_id_project"), "project", ["project_id"], ["id"], ondelete="CASCADE"
        )
    for table in ("plan", "trace"):
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.alter_column("project_id", server_default=None)


def downgrade() -> None:
    # Lossy by nature: content uploaded to several projects cannot stay unique once projects are gone.
    op.execute("DELETE FROM trace WHERE project_id <> 'default'")
    with op.batch_alter_table("trace", schema=None) as batch_op:
        batch_op.drop_constraint(batch_op.f("fk_trace_project_id_project"), type_="foreignkey")
        batch_op.drop_constraint("uq_trace_project_content", type_="unique")
        batch_op.create_unique_constraint(batch_op.f("uq_trace_content_hash"), ["content_hash"])
        batch_op.drop_column("project_id")

    with op.batch_alter_table("plan", schema=None) as batch_op:
        batch_op.drop_constraint(batch_op.f("fk_plan_project_id_project"), type_="foreignkey")
        batch_op.drop_index(batch_op.f("ix_plan_project_id"))
        batch_op.drop_column("project_id")

    with op.batch_alter_table("api_token", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_api_token_project_id"))

    op.drop_table("api_token")
    op.drop_table("project")
