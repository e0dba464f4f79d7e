"""Run the planner service in-process on a loopback port (the embedded default used by `memplan demo`)."""

from __future__ import annotations

import socket
import subprocess
import threading
import time
from types import TracebackType

import httpx
import uvicorn
from sqlalchemy.engine import make_url

from planner_service.app import create_app
from planner_service.settings import Settings


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until_ready(url: str, process: subprocess.Popen[str], timeout_s: float = 60.0) -> None:
    """Until `url`/readyz answers 200 (a `memplan serve` started as `process`). RuntimeError with the
    process's captured output if it exits first or `timeout_s` passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            if process.poll() is None:
                process.kill()  # out of time: stop it, so its captured output can be read to the end
            stream = process.stderr or process.stdout
            raise RuntimeError(f"server did not start:\n{stream.read() if stream else ''}")
        time.sleep(0.2)


class EmbeddedServer:
    """`with EmbeddedServer(settings) as url:` serves the real app with uvicorn on a background thread."""

    def __init__(self, settings: Settings, *, port: int | None = None, workers: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # the database it serves, password hidden: what a person is told it writes to
        self.database = make_url(settings.database_url).render_as_string(hide_password=True)
        config = uvicorn.Config(
            create_app(settings, workers=workers),
            host="127.0.0.1",
            port=self.port,
            log_level="warning",
            lifespan="on",
        )
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

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._server.should_exit = True
        self._thread.join(30)
