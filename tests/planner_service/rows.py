"""Counting a table's rows straight from the database (what a test checks was, or was not, written)."""

from __future__ import annotations

from sqlalchemy import create_engine, func, select


def count_rows(db_url: str, model: type) -> int:
    """The number of rows of `model`'s table in the database at `db_url`."""
    engine = create_engine(db_url)
    with engine.connect() as conn:
        n = conn.execute(select(func.count()).select_from(model)).scalar_one()
    engine.dispose()
    return int(n)
