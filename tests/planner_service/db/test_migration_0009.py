"""Migration 0009 (issue 20): hardware rows gain the job's process group; existing rows read as single-process
jobs; the downgrade drops the columns and keeps the rows (SQLite and PostgreSQL)."""

from __future__ import annotations

from datetime import UTC, datetime

from sqlalchemy import create_engine, inspect, text

from planner_service.db.migrate import downgrade, upgrade


def test_0009_adds_world_size_and_ranks_per_node_with_existing_rows_single_process(empty_db_url: str) -> None:
    upgrade(empty_db_url, "0008")
    engine = create_engine(empty_db_url)
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO hardware (project_id, key, device_type, device_name, device_memory_bytes, "
                "device_count, created_at) VALUES ('default', 'cpu:x:1GiB:x1', 'cpu', 'x', 1073741824, 1, :t)"
            ),
            {"t": datetime.now(UTC)},
        )
    upgrade(empty_db_url, "0009")
    with engine.connect() as conn:
        row = conn.execute(text("SELECT key, world_size, ranks_per_node FROM hardware")).one()
    assert tuple(row) == ("cpu:x:1GiB:x1", 1, 1)
    with engine.begin() as conn:  # a multi-rank row after the upgrade
        conn.execute(
            text(
                "INSERT INTO hardware (project_id, key, device_type, device_name, device_memory_bytes, "
                "device_count, created_at, world_size, ranks_per_node) VALUES "
                "('default', 'cpu:x:1GiB:x1:w4r2', 'cpu', 'x', 1073741824, 1, :t, 4, 2)"
            ),
            {"t": datetime.now(UTC)},
        )
    downgrade(empty_db_url, "0008")
    engine.dispose()
    engine = create_engine(empty_db_url)
    columns = {c["name"] for c in inspect(engine).get_columns("hardware")}
    assert "world_size" not in columns and "ranks_per_node" not in columns
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM hardware")).scalar_one() == 2
    engine.dispose()
