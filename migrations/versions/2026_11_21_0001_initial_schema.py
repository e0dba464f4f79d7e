"""initial schema

Revision ID: 0001
Revises: (none)
Create Date: 2026-11-21 05:52:13.856020
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "hardware",
        sa.Column("key", sa.String(length=600), nullable=False),
        sa.Column("device_type", sa.String(length=16), nullable=False),
        sa.Column("device_name", sa.String(length=512), nullable=False),
        sa.Column("device_memory_bytes", sa.BigInteger(), nullable=False),
        sa.Column("device_count", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("key", name=op.f("pk_hardware")),
    )
    op.create_table(
        "model",
        sa.Column("fingerprint", sa.String(length=512), nullable=False),
        sa.Column("name", sa.String(length=512), nullable=False),
        sa.Column("architecture", sa.String(length=512), nullable=False),
        sa.Column("parameter_count", sa.BigInteger(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("fingerprint", name=op.f("pk_model")),
    )
    op.create_table(
        "trace",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("content_hash", sa.String(length=64), nullable=False),
        sa.Column("model_fingerprint", sa.String(length=512), nullable=False),
        sa.Column("hardware_key", sa.String(length=600), nullable=False),
        sa.Column("workload_key", sa.String(length=200), nullable=False),
        sa.Column("schema_version", sa.Integer(), nullable=False),
        sa.Column("payload_gzip", sa.LargeBinary(), nullable=False),
        sa.Column("payload_bytes", sa.BigInteger(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["hardware_key"], ["hardware.key"], name=op.f("fk_trace_hardware_key_hardware")
        ),
        sa.ForeignKeyConstraint(
            ["model_fingerprint"], ["model.fingerprint"], name=op.f("fk_trace_model_fingerprint_model")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_trace")),
        sa.UniqueConstraint("content_hash", name=op.f("uq_trace_content_hash")),
    )
    with op.batch_alter_table("trace", schema=None) as batch_op:
        batch_op.create_index("ix_trace_created", ["created_at", "id"], unique=False)
        batch_op.create_index("ix_trace_hardware_created", ["hardware_key", "created_at", "id"], unique=False)
        batch_op.create_index(
            "ix_trace_model_created", ["model_fingerprint", "created_at", "id"], unique=False
        )

    op.create_table(
        "plan",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("trace_id", sa.String(length=32), nullable=False),
        sa.Column("model_fingerprint", sa.String(length=512), nullable=False),
        sa.Column("hardware_key", sa.String(length=600), nullable=False),
        sa.Column("workload_key", sa.String(length=200), nullable=False),
        sa.Column("request_key", sa.String(length=64), nullable=False),
        sa.Column("solver", sa.String(length=64), nullable=False),
        sa.Column("solver_version", sa.String(length=64), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("constraints", sa.JSON(), nullable=False),
        sa.Column("objective", sa.String(length=64), nullable=False),
        sa.Column("result", sa.JSON(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("lease_owner", sa.String(length=128), nullable=True),
        sa.Column("lease_expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["trace_id"], ["trace.id"], name=op.f("fk_plan_trace_id_trace"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_plan")),
    )
    with op.batch_alter_table("plan", schema=None) as batch_op:
        batch_op.create_index("ix_plan_created", ["created_at", "id"], unique=False)
        batch_op.create_index("ix_plan_hardware_created", ["hardware_key", "created_at", "id"], unique=False)
        batch_op.create_index(
            "ix_plan_model_created", ["model_fingerprint", "created_at", "id"], unique=False
        )
        batch_op.create_index("ix_plan_request_key", ["request_key"], unique=False)
        batch_op.create_index("ix_plan_status_created", ["status", "created_at"], unique=False)

    op.create_table(
        "feedback",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("plan_id", sa.String(length=32), nullable=False),
        sa.Column("iteration_s", sa.Float(), nullable=False),
        sa.Column("peak_device_bytes", sa.BigInteger(), nullable=False),
        sa.Column("peak_host_bytes", sa.BigInteger(), nullable=False),
        sa.Column("steps_measured", sa.Integer(), nullable=False),
        sa.Column("notes", sa.Text(), nullable=False),
        sa.Column("iteration_error", sa.Float(), nullable=True),
        sa.Column("peak_device_error", sa.Float(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["plan_id"], ["plan.id"], name=op.f("fk_feedback_plan_id_plan"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_feedback")),
    )
    with op.batch_alter_table("feedback", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_feedback_plan_id"), ["plan_id"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("feedback", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_feedback_plan_id"))

    op.drop_table("feedback")
    with op.batch_alter_table("plan", schema=None) as batch_op:
        batch_op.drop_index("ix_plan_status_created")
        batch_op.drop_index("ix_plan_request_key")
        batch_op.drop_index("ix_plan_model_created")
        batch_op.drop_index("ix_plan_hardware_created")
        batch_op.drop_index("ix_plan_created")

    op.drop_table("plan")
    with op.batch_alter_table("trace", schema=None) as batch_op:
        batch_op.drop_index("ix_trace_model_created")
        batch_op.drop_index("ix_trace_hardware_created")
        batch_op.drop_index("ix_trace_created")

    op.drop_table("trace")
    op.drop_table("model")
    op.drop_table("hardware")
