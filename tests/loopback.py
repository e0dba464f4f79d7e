"""A Starlette app served by uvicorn on a loopback port in a thread: the small real HTTP servers tests stand up
where a real memplan service cannot show the behaviour (a flaky one, one of another version)."""

from __future__ import annotations

import threading
import time

import uvicorn
from starlette.types import ASGIApp

from planner_service.embedded import free_port


class LoopbackServer:
    """`with LoopbackServer(app) as url:` serves `app` at `url` until the block ends."""

    def __init__(self, app: ASGIApp) -> None:
        self.port = free_port()
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        while not self.server.started:
            time.sleep(0.01)
        return f"http://127.0.0.1:{self.port}"

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)
