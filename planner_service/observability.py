"""Operations: Prometheus metrics, JSON logs with request ids, and the middleware that ties them to requests."""

from __future__ import annotations

import json
import logging
import time
import uuid
from contextvars import ContextVar

from fastapi import FastAPI, Response
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from planner_service.db.repositories import PlanRepository

request_id_var: ContextVar[str | None] = ContextVar("memplan_request_id", default=None)

# One registry per process; metric objects are module-level as prometheus_client expects.
REGISTRY = CollectorRegistry(auto_describe=True)
REQUEST_SECONDS = Histogram(
    "memplan_http_request_seconds",
    "HTTP request latency",
    ["method", "route", "status"],
    registry=REGISTRY,
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 60),
)
QUEUE_DEPTH = Gauge("memplan_plan_queue_depth", "plans waiting for a worker", registry=REGISTRY)
SOLVE_SECONDS = Histogram(
    "memplan_solve_seconds",
    "wall time of one plan solve",
    ["solver"],
    registry=REGISTRY,
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
)
POLL_ANSWERS = Counter(
    "memplan_plan_tag_reads_total",
    "plan entity tags read to answer polls, by source "
    "(shortcut: a 304 from memory before routing; memory: the route, from the change feed; "
    "database: one narrow query)",
    ["source"],
    registry=REGISTRY,
)
PLAN_OUTCOMES = Counter(
    "memplan_plan_outcomes_total", "finished plans by outcome", ["status"], registry=REGISTRY
)


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, request id and any `extra` fields."""

    _STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, object] = {
            "ts": self.formatTime(record, "%Y-%m-%dT%H:%M:%S"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        rid = request_id_var.get()
        if rid:
            out["request_id"] = rid
        for key, value in vars(record).items():
            if key not in self._STANDARD and not key.startswith("_"):
                out[key] = value if isinstance(value, int | float | str | bool | None) else str(value)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out)


def configure_logging(level: str = "INFO") -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger("memplan")
    root.handlers[:] = [handler]
    root.setLevel(level)
    root.propagate = False


access_log = logging.getLogger("memplan.access")


class ObserveMiddleware:
    """Pure ASGI middleware (cheaper than BaseHTTPMiddleware): request id, latency histogram, access log."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or ())
        rid = (headers.get(b"x-request-id", b"").decode("latin-1") or uuid.uuid4().hex)[:64]
        token = request_id_var.set(rid)
        start = time.perf_counter()
        status = 500

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message.setdefault("headers", [])
                message["headers"] = [*message["headers"], (b"x-request-id", rid.encode("latin-1"))]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            elapsed = time.perf_counter() - start
            route = scope.get("route")
            template = getattr(route, "path", "unmatched")
            REQUEST_SECONDS.labels(scope["method"], template, str(status)).observe(elapsed)
            if access_log.isEnabledFor(logging.INFO):
                # Never the headers (they carry tokens) nor the query string (it may carry cursors): path only.
                access_log.info(
                    "request",
                    extra={
                        "method": scope["method"],
                        "path": template,
                        "status": status,
                        "duration_ms": round(elapsed * 1e3, 2),
                    },
                )
            request_id_var.reset(token)


def install(app: FastAPI) -> None:
    app.add_middleware(ObserveMiddleware)

    @app.get("/metrics", include_in_schema=False)
    def metrics() -> Response:
        try:
            with app.state.db.session() as s:
                QUEUE_DEPTH.set(PlanRepository(s).queue_depth())
        except Exception:  # metrics must answer even when the database does not
            logging.getLogger("memplan.metrics").warning("queue depth unavailable")
        return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)
