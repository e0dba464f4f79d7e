"""Engine and session factory; one `session()` scope that commits on success and rolls back on error."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, Engine, create_engine, event
from sqlalchemy.orm import Session, sessionmaker

from planner_service.db.deadline import StatementDeadline


@dataclass(frozen=True)
class Timeouts:
    """Bounds on waiting for PostgreSQL (SQLite is a local file: its busy timeout is the only wait)."""

    connect_s: int = 5
    statement_s: float = 30.0
    pool_s: float = 10.0
    grace_s: float = 2.0  # a statement with no answer this long after the server's own timeout: server frozen

    def connect_args(self) -> dict[str, Any]:
        return {
            "connect_timeout": self.connect_s,
            "options": f"-c statement_timeout={int(self.statement_s * 1000)}",
        }


def make_engine(url: str, pool_size: int = 16, timeouts: Timeouts | None = None) -> Engine:
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
    # fails one request with 503 and SQLAlchemy then invalidates the whole pool (tests/planner_service/test_faults.py).
    # The pool holds what the API's thread limiter admits (settings.db_pool_size) plus a few for the worker
    # threads: an overflow connection is opened and closed per use, which costs PostgreSQL a process fork.
    if timeouts is None:
        return create_engine(url, pool_size=pool_size + 4, max_overflow=8, pool_recycle=1800)
    return create_engine(
        url,
        pool_size=pool_size + 4,
        max_overflow=8,
        pool_recycle=1800,
        pool_timeout=timeouts.pool_s,
        connect_args=timeouts.connect_args(),
    )


class Database:
    """Owns the engine; hands out sessions."""

    def __init__(self, url: str, pool_size: int = 16, timeouts: Timeouts | None = None) -> None:
        self.url = url
        self.timeouts = timeouts
        self.engine = make_engine(url, pool_size, timeouts)
        self._factory = sessionmaker(self.engine, expire_on_commit=False)
        self._deadline: StatementDeadline | None = None
        if timeouts is not None and self.engine.dialect.name == "postgresql":
            self._deadline = StatementDeadline(self.engine, timeouts.statement_s + timeouts.grace_s)

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
        if self._deadline is not None:
            self._deadline.close()
        self.engine.dispose()
