"""FastAPI app factory: settings -> database (schema checked or upgraded) -> routers -> solve queue."""

from __future__ import annotations

import gc
import ipaddress
import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio.to_thread
from fastapi import FastAPI
from sqlalchemy import make_url

from client.contract import Trace
from planner_service import observability, ui
from planner_service.api import catalog, errors, health, plans, traces, whatif
from planner_service.api.body_limit import BodyLimit
from planner_service.api.poll_shortcut import PollShortcut
from planner_service.api.ratelimit import TokenBuckets
from planner_service.db import migrate
from planner_service.db.change_feed import ChangeFeed
from planner_service.db.session import Database, Timeouts
from planner_service.ingest import Ingestor
from planner_service.jobs.queue import solve_queue
from planner_service.lifeline import PARENT_ENV, die_with_parent
from planner_service.settings import Settings, get_settings
from planner_service.ui import sweep_pages

log = logging.getLogger("memplan.service")


def prepare_database(settings: Settings) -> Database:
    """Upgrade automatically for the embedded SQLite default; elsewhere refuse an out-of-date schema."""
    if settings.should_auto_upgrade:
        migrate.upgrade(settings.database_url)
    db = Database(
        settings.database_url,
        settings.db_pool_size,
        Timeouts(
            connect_s=settings.db_connect_timeout_s,
            statement_s=settings.db_statement_timeout_s,
            pool_s=settings.db_pool_timeout_s,
        ),
    )
    migrate.require_current(db.engine)
    return db


class InsecureBind(RuntimeError):
    """Serving beyond loopback without authentication."""


def check_bind(host: str, settings: Settings) -> None:
    """Refuse to serve a non-loopback address without auth: traces describe private models and clusters."""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback and not settings.auth:
        raise InsecureBind(
            f"refusing to serve on {host} without authentication: set MEMPLAN_AUTH=true and create "
            "tokens with `memplan tokens create --project NAME`, or bind to 127.0.0.1"
        )


def create_app(settings: Settings | None = None, *, workers: int | None = None) -> FastAPI:
    settings = settings or get_settings()
    n_workers = settings.workers if workers is None else workers

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        db = prepare_database(settings)
        # Blocking handlers and database calls run on AnyIO's thread pool: as many threads as pooled connections.
        anyio.to_thread.current_default_thread_limiter().total_tokens = settings.db_pool_size
        app.state.db = db
        app.state.settings = settings
        app.state.rate_limiter = TokenBuckets(settings.rate_limit_per_s, settings.rate_limit_burst)
        app.state.ingestor = Ingestor(
            settings.ingest_processes, settings.ingest_inline_max_bytes, settings.ingest_niceness
        )
        if settings.ingest_prestart:
            app.state.ingestor.prestart()
        app.state.change_feed = _change_feed(settings)
        if app.state.change_feed is not None:
            app.state.change_feed.start()
        app.state.solve_queue = solve_queue(db, settings, n_workers)
        app.state.solve_queue.start()
        # Everything imported and built so far lives as long as the process: keep it out of the cyclic
        # collector's full passes, which otherwise stall the event loop for tens of ms under load.
        gc.freeze()
        try:
            yield
        finally:
            app.state.solve_queue.stop()
            if app.state.change_feed is not None:
                await app.state.change_feed.stop()
            app.state.ingestor.close()
            db.dispose()

    app = FastAPI(
        title="memplan planner",
        version="0.1.0",
        lifespan=lifespan,
        description="Stores training traces, solves memory plans in workers, keeps the history.",
    )
    errors.install(app)
    for router in (
        traces.router,
        plans.router,
        catalog.router,
        whatif.router,
        health.router,
        ui.router,
        sweep_pages.router,
    ):
        app.include_router(router)
    # Inside the observability middleware (added after it, so it is outer): see api/poll_shortcut.py.
    plan_route = next(r for r in plans.router.routes if getattr(r, "endpoint", None) is plans.get_plan)
    app.add_middleware(PollShortcut, state=app.state, route=plan_route)
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)  # outside the shortcut: before any read
    observability.install(app)
    # Trace is read from the raw body (gzip support), so register its schema for the OpenAPI document.
    _register_trace_schema(app)
    return app


def _change_feed(settings: Settings) -> ChangeFeed | None:
    """On PostgreSQL, a listener for plan and token changes (polls of unchanged plans and tokens seen
    before answered from memory)."""
    if not settings.database_url.startswith("postgresql") or not settings.change_feed:
        return None
    url = make_url(settings.database_url).set(drivername="postgresql")
    return ChangeFeed(url.render_as_string(hide_password=False))


def _register_trace_schema(app: FastAPI) -> None:
    original = app.openapi

    def openapi() -> dict:
        if app.openapi_schema:
            return app.openapi_schema
        schema = original()
        defs = Trace.model_json_schema(ref_template="#/components/schemas/{model}")
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        components.update(defs.pop("$defs", {}))
        components["Trace"] = defs
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


def app_from_env() -> FastAPI:
    """Factory for multi-process serving (`uvicorn --factory`, in each worker process): settings from the
    environment; the process dies with uvicorn's supervisor (`memplan serve`), even if that is killed."""
    parent = os.environ.get(PARENT_ENV, "")  # set by `memplan serve --processes N` to its own pid
    die_with_parent(expected_parent=int(parent) if parent.isdigit() else None)
    return create_app(Settings())
