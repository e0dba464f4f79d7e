"""A client-side deadline on every PostgreSQL statement: a server that stops answering fails the statement.

PostgreSQL's own `statement_timeout` (set on every connection, `make_engine`) ends a slow statement cleanly,
but only a server that runs can enforce it. A frozen server (SIGSTOP, a stalled VM, a network path that
drops packets without resetting) leaves the statement waiting on its socket forever: the kernel still
acknowledges the bytes, so neither TCP keepalives nor TCP_USER_TIMEOUT notice. Each waiting request then
holds one of the API's threads and pooled connections until none is left, and the service stops answering.

`StatementDeadline` watches the statements in flight (SQLAlchemy cursor events) from one thread; a statement
still running `grace_s` after the server's own timeout has its socket shut down. The driver then fails it
like any lost connection (`OperationalError`), SQLAlchemy discards the connection, and the API answers 503
with Retry-After. Connecting has its own bound (libpq `connect_timeout`), and so has waiting for a pooled
connection (`pool_timeout`).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Any

from sqlalchemy import Engine, event

log = logging.getLogger("memplan.db")


class StatementDeadline:
    """Shuts down the socket of any statement on `engine` still running `seconds` after it started."""

    def __init__(self, engine: Engine, seconds: float, check_every_s: float = 0.25) -> None:
        self.seconds = seconds
        self._check_every_s = min(check_every_s, seconds / 4)
        self._running: dict[int, tuple[float, Any]] = {}  # id(DBAPI connection) -> (deadline, connection)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.expired = 0
        event.listen(engine, "before_cursor_execute", self._started)
        event.listen(engine, "after_cursor_execute", self._ended)
        event.listen(engine, "handle_error", self._failed)

    def _started(self, conn: Any, _cursor: Any, *_: Any) -> None:
        dbapi = conn.connection.dbapi_connection
        with self._lock:
            self._running[id(dbapi)] = (time.monotonic() + self.seconds, dbapi)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._watch, name="memplan-statement-deadline", daemon=True
                )
                self._thread.start()

    def _ended(self, conn: Any, *_: Any) -> None:
        with self._lock:
            self._running.pop(id(conn.connection.dbapi_connection), None)

    def _failed(self, context: Any) -> None:
        try:
            dbapi = context.connection.connection.dbapi_connection
        except Exception:  # noqa: BLE001 - no connection (it failed to connect): nothing was registered
            return
        with self._lock:
            self._running.pop(id(dbapi), None)

    def _watch(self) -> None:
        while not self._stop.wait(self._check_every_s):
            now = time.monotonic()
            with self._lock:
                late = [(key, dbapi) for key, (deadline, dbapi) in self._running.items() if deadline < now]
                for key, _ in late:
                    del self._running[key]
            for _, dbapi in late:
                self.expired += 1
                log.warning(
                    "database statement ran past %.1f s with no answer: dropping its connection", self.seconds
                )
                _shut_down(dbapi)

    def close(self) -> None:
        self._stop.set()


def _shut_down(dbapi: Any) -> None:
    """Wake a thread blocked on this connection's socket: reads return end-of-file, the driver raises."""
    try:
        fd = dbapi.pgconn.socket
        sock = socket.socket(
            fileno=socket.dup(fd)
        )  # a duplicate descriptor: shutdown acts on the socket itself
        try:
            sock.shutdown(socket.SHUT_RDWR)
        finally:
            sock.close()
    except Exception as exc:  # noqa: BLE001 - already closed or not a socket: nothing is waiting on it
        log.debug("could not shut down a late connection: %s", exc)
