"""Engine and session factory; one `session()` scope that commits on success and rolls back on error."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, Engine, create_engine, event
from sqlalchemy.orm import Session, sessionmaker


def make_engine(url: str, pool_size: int = 16) -> Engine:
    if url.startswith("sqlite"):
        path = url.split("///", 1)[1] if "///" in url else ""
        if path and path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA journal_mode=WAL")  # readers do not block the writer (API + workers)
            cur.execute("PRAGMA busy_timeout=30000")
            cur.close()

        return engine
    # No pre-ping (it doubled the round trips of every request): a connection broken by a database restart
    # fails one request with 503 and SQLAlchemy then invalidates the whole pool (tests/service/test_faults.py).
    # The pool holds what the API's thread limiter admits (settings.db_pool_size) plus a few for the worker
    # threads: an overflow connection is opened and closed per use, which costs PostgreSQL a process fork.
    return create_engine(url, pool_size=pool_size + 4, max_overflow=8, pool_recycle=1800)


class Database:
    """Owns the engine; hands out sessions."""

    def __init__(self, url: str, pool_size: int = 16) -> None:
        self.url = url
        self.engine = make_engine(url, pool_size)
        self._factory = sessionmaker(self.engine, expire_on_commit=False)

    @contextmanager
    def session(self) -> Iterator[Session]:
        s = self._factory()
        try:
            yield s
            s.commit()
        except BaseException:
            s.rollback()
            raise
        finally:
            s.close()

    @contextmanager
    def reader(self) -> Iterator[Connection]:
        """A pooled connection in autocommit for one-statement reads: no ORM session, and no COMMIT round
        trip (a hot poll is a single indexed SELECT)."""
        with self.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            yield conn

    def dispose(self) -> None:
        self.engine.dispose()
