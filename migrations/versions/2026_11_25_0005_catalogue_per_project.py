"""model and hardware catalogue per project

The model and hardware tables were shared by every project and keyed by what the client sends (the model
fingerprint, the hardware key): project B uploading with A's fingerprint saw A's model name in its lists,
records and pages, and A then saw B's. Each project now has its own rows, keyed (project_id, fingerprint)
and (project_id, key), and a trace points at its own project's rows.

Existing rows are split per project: each project that has traces of a model gets a row with the name (and
the other facts) from one of its own stored traces, so names given by different projects come apart again;
a trace that cannot be read falls back to the shared row. Downgrade merges them back into one row per
fingerprint and key (the default project's, else any).

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-25 03:10:00
"""

import json
import zlib
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

READ_LIMIT = 256 * 2**20  # inflate a stored trace at most this far (the service's default upload limit)

trace = sa.table("trace", sa.column("id", sa.String), sa.column("project_id", sa.String),
                 sa.column("model_fingerprint", sa.String), sa.column("hardware_key", sa.String),
                 sa.column("payload_gzip", sa.LargeBinary))
MODEL_COLUMNS = ("name", "architecture", "parameter_count", "created_at")
HARDWARE_COLUMNS = ("device_type", "device_name", "device_memory_bytes", "device_count", "created_at")


def _stored_facts(conn: sa.Connection, trace_id: str) -> dict[str, Any]:
    """The `model` and `hardware` objects of a stored trace ({} where it cannot be read)."""
    payload = conn.execute(sa.select(trace.c.payload_gzip).where(trace.c.id == trace_id)).scalar_one()
    try:
        d = zlib.decompressobj(16 + zlib.MAX_WBITS)
        raw = d.decompress(payload, READ_LIMIT)
        if d.unconsumed_tail:
            return {}
        doc = json.loads(raw)
    except (zlib.error, ValueError):
        return {}
    return {k: doc.get(k) for k in ("model", "hardware")} if isinstance(doc, dict) else {}


def _model_facts(doc: dict[str, Any], shared: dict[str, Any]) -> dict[str, Any]:
    model = doc.get("model") if isinstance(doc.get("model"), dict) else {}
    out = dict(shared)
    for column in ("name", "architecture", "parameter_count"):
        if isinstance(model.get(column), type(shared[column])):
            out[column] = model[column]
    return out


def _hardware_facts(doc: dict[str, Any], shared: dict[str, Any]) -> dict[str, Any]:
    hardware = doc.get("hardware") if isinstance(doc.get("hardware"), dict) else {}
    out = dict(shared)
    for column in ("device_type", "device_name", "device_memory_bytes", "device_count"):
        if isinstance(hardware.get(column), type(shared[column])):
            out[column] = hardware[column]
    return out


def _create_tables(per_project: bool) -> None:
    """model and hardware as of this revision (per_project) or the one before."""
    for name, key, columns in (
        ("model", "fingerprint", [
            sa.Column("fingerprint", sa.String(length=512), nullable=False),
            sa.Column("name", sa.String(length=512), nullable=False),
            sa.Column("architecture", sa.String(length=512), nullable=False),
            sa.Column("parameter_count", sa.BigInteger(), nullable=False)]),
        ("hardware", "key", [
            sa.Column("key", sa.String(length=600), nullable=False),
            sa.Column("device_type", sa.String(length=16), nullable=False),
            sa.Column("device_name", sa.String(length=512), nullable=False),
            sa.Column("device_memory_bytes", sa.BigInteger(), nullable=False),
            sa.Column("device_count", sa.Integer(), nullable=False)]),
    ):
        created = sa.Column("created_at", sa.DateTime(timezone=True), nullable=False)
        if per_project:
            op.create_table(
                name, sa.Column("project_id", sa.String(length=64), nullable=False), *columns, created,
                sa.ForeignKeyConstraint(["project_id"], ["project.id"], name=op.f(f"fk_{name}_project_id_project"),
                                        ondelete="CASCADE"),
                sa.PrimaryKeyConstraint("project_id", key, name=op.f(f"pk_{name}")))
        else:
            op.create_table(name, *columns, created, sa.PrimaryKeyConstraint(key, name=op.f(f"pk_{name}")))


def _tables(per_project: bool) -> tuple[sa.TableClause, sa.TableClause]:
    def extra() -> list[sa.ColumnClause[Any]]:
        return [sa.column("project_id", sa.String)] if per_project else []

    model = sa.table("model", *extra(), sa.column("fingerprint", sa.String), sa.column("name", sa.String),
                     sa.column("architecture", sa.String), sa.column("parameter_count", sa.BigInteger),
                     sa.column("created_at", sa.DateTime(timezone=True)))
    hardware = sa.table("hardware", *extra(), sa.column("key", sa.String), sa.column("device_type", sa.String),
                        sa.column("device_name", sa.String), sa.column("device_memory_bytes", sa.BigInteger),
                        sa.column("device_count", sa.Integer), sa.column("created_at", sa.DateTime(timezone=True)))
    return model, hardware


def upgrade() -> None:
    conn = op.get_bind()
    old_model, old_hardware = _tables(per_project=False)
    models = {r.fingerprint: dict(r._mapping) for r in conn.execute(sa.select(old_model))}
    hardware = {r.key: dict(r._mapping) for r in conn.execute(sa.select(old_hardware))}
    model_pairs = conn.execute(sa.select(trace.c.project_id, trace.c.model_fingerprint, sa.func.max(trace.c.id))
                               .group_by(trace.c.project_id, trace.c.model_fingerprint)).all()
    hardware_pairs = conn.execute(sa.select(trace.c.project_id, trace.c.hardware_key, sa.func.max(trace.c.id))
                                  .group_by(trace.c.project_id, trace.c.hardware_key)).all()
    with op.batch_alter_table("trace", schema=None) as batch_op:
        batch_op.drop_constraint("fk_trace_model_fingerprint_model", type_="foreignkey")
        batch_op.drop_constraint("fk_trace_hardware_key_hardware", type_="foreignkey")
    op.drop_table("model")
    op.drop_table("hardware")
    _create_tables(per_project=True)
    new_model, new_hardware = _tables(per_project=True)
    facts: dict[str, dict[str, Any]] = {}  # per trace read: its model and hardware objects

    def stored(trace_id: str) -> dict[str, Any]:
        if trace_id not in facts:
            facts[trace_id] = _stored_facts(conn, trace_id)
        return facts[trace_id]

    for project_id, fingerprint, trace_id in model_pairs:
        conn.execute(new_model.insert().values(project_id=project_id,
                                               **_model_facts(stored(trace_id), models[fingerprint])))
    for project_id, key, trace_id in hardware_pairs:
        conn.execute(new_hardware.insert().values(project_id=project_id,
                                                  **_hardware_facts(stored(trace_id), hardware[key])))
    with op.batch_alter_table("trace", schema=None) as batch_op:
        batch_op.create_foreign_key(op.f("fk_trace_project_id_model"), "model", ["project_id", "model_fingerprint"],
                                    ["project_id", "fingerprint"])
        batch_op.create_foreign_key(op.f("fk_trace_project_id_hardware"), "hardware", ["project_id", "hardware_key"],
                                    ["project_id", "key"])


def downgrade() -> None:
    conn = op.get_bind()
    new_model, new_hardware = _tables(per_project=True)
    # One row per fingerprint and key: the default project's if it has one, else the first project's.
    order = sa.case((new_model.c.project_id == "default", 0), else_=1)
    models: dict[str, dict[str, Any]] = {}
    for r in conn.execute(sa.select(new_model).order_by(order, new_model.c.project_id)):
        models.setdefault(r.fingerprint, {k: v for k, v in r._mapping.items() if k != "project_id"})
    order = sa.case((new_hardware.c.project_id == "default", 0), else_=1)
    hardware: dict[str, dict[str, Any]] = {}
    for r in conn.execute(sa.select(new_hardware).order_by(order, new_hardware.c.project_id)):
        hardware.setdefault(r.key, {k: v for k, v in r._mapping.items() if k != "project_id"})
    with op.batch_alter_table("trace", schema=None) as batch_op:
        batch_op.drop_constraint("fk_trace_project_id_model", type_="foreignkey")
        batch_op.drop_constraint("fk_trace_project_id_hardware", type_="foreignkey")
    op.drop_table("model")
    op.drop_table("hardware")
    _create_tables(per_project=False)
    old_model, old_hardware = _tables(per_project=False)
    if models:
        conn.execute(old_model.insert(), list(models.values()))
    if hardware:
        conn.execute(old_hardware.insert(), list(hardware.values()))
    with op.batch_alter_table("trace", schema=None) as batch_op:
        batch_op.create_foreign_key(op.f("fk_trace_model_fingerprint_model"), "model", ["model_fingerprint"],
                                    ["fingerprint"])
        batch_op.create_foreign_key(op.f("fk_trace_hardware_key_hardware"), "hardware", ["hardware_key"], ["key"])
