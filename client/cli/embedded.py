"""Run the planner service in-process on a loopback port (the embedded default used by `memplan demo`)."""

from __future__ import annotations

import socket
import threading
import time
from types import TracebackType

from planner_service.settings import Settings


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class EmbeddedServer:
    """`with EmbeddedServer(settings) as url:` serves the real app with uvicorn on a background thread."""

    def __init__(self, settings: Settings, *, port: int | None = None, workers: int | None = None) -> None:
        import uvicorn

        from planner_service.app import create_app

        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(create_app(settings, workers=workers), host="127.0.0.1", port=self.port,
                                log_level="warning", lifespan="on")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="memplan-embedded-server", daemon=True)

    def __enter__(self) -> str:
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("embedded memplan server did not start (see the log above)")
            time.sleep(0.02)
        return self.url

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._server.should_exit = True
        self._thread.join(30)
