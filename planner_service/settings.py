"""Service settings from the environment (`MEMPLAN_` prefix) via pydantic-settings."""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


def default_data_dir() -> Path:
    """The user's data directory: $XDG_DATA_HOME/memplan, else ~/.local/share/memplan."""
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "memplan"


def default_database_url() -> str:
    return f"sqlite:///{default_data_dir() / 'memplan.db'}"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="MEMPLAN_", extra="ignore")

    database_url: str = Field(
        default_factory=default_database_url,
        description="SQLAlchemy URL; SQLite file under the user's data dir by default",
    )
    auto_upgrade: bool | None = Field(
        default=None, description="run migrations at start; default: yes for SQLite, never otherwise"
    )
    workers: int = Field(
        default=1, ge=0, le=64, description="in-process solve workers (0: only external workers)"
    )
    stalled_after_s: float = Field(
        default=30.0,
        gt=0,
        description=(
            "PostgreSQL: a solve whose worker sent no heartbeat for this long is queued again for another worker "
            "(workers beat every quarter of it)"
        ),
    )
    retry_backoff_s: float = Field(
        default=1.0,
        gt=0,
        description="first wait before a failed solve job runs again; doubled per retry, at most 60 s",
    )
    db_pool_size: int = Field(
        default=16,
        ge=1,
        le=256,
        description=(
            "database connections each API process keeps open; also the number of threads that run blocking "
            "handlers, so a burst queues for a thread instead of opening (and closing) connections"
        ),
    )
    db_connect_timeout_s: int = Field(
        default=5,
        ge=1,
        le=300,
        description=(
            "PostgreSQL: give up connecting after this long (a database that accepts and never answers gives 503)"
        ),
    )
    db_statement_timeout_s: float = Field(
        default=30.0,
        gt=0,
        le=3600,
        description=(
            "PostgreSQL: the server cancels a statement after this long; one with no answer 2 s later (a frozen "
            "server) has its connection dropped by the client (503)"
        ),
    )
    db_pool_timeout_s: float = Field(
        default=10.0, gt=0, description="wait at most this long for a pooled connection (503 beyond)"
    )
    readiness_timeout_s: float = Field(
        default=3.0,
        gt=0,
        le=60,
        description="/readyz answers 503 when the database has not answered within this long",
    )
    poll_interval_s: float = Field(
        default=0.2, gt=0, description="how often idle workers look for queued jobs (besides being notified)"
    )
    max_attempts: int = Field(default=3, ge=1, description="solve attempts before a plan is marked failed")
    max_body_bytes: int = Field(
        default=64 * 2**20, gt=0, description="largest request body accepted (413 beyond)"
    )
    max_decompressed_bytes: int = Field(
        default=256 * 2**20, gt=0, description="largest gunzipped body accepted"
    )
    max_wait_s: float = Field(default=60.0, gt=0, description="longest long-poll `?wait=` honoured")
    list_limit_max: int = Field(default=200, gt=0)
    fault_solve_delay_s: float = Field(
        default=0.0,
        ge=0,
        description="FAULT INJECTION for tests: hold each solve this long (the worker keeps beating)",
    )
    ingest_processes: int = Field(
        default=2, ge=0, le=64, description="processes that validate large uploads (0: in the API process)"
    )
    ingest_prestart: bool = Field(
        default=True,
        description="start the ingest processes with the service (else on the first large upload)",
    )
    ingest_niceness: int = Field(
        default=5,
        ge=0,
        le=19,
        description="nice increment of the ingest processes "
        "(request handling goes first; a poll is ~1 ms, validating a 1 MB trace ~0.1 s)",
    )
    ingest_inline_max_bytes: int = Field(
        default=256 * 2**10, ge=0, description="bodies up to this size are validated in the API process"
    )
    change_feed: bool = Field(
        default=True,
        description="on PostgreSQL, LISTEN for plan and token changes and "
        "answer polls of unchanged plans and known tokens from memory (off: every request "
        "asks the database)",
    )
    auth: bool = Field(default=False, description="require a bearer token on /v1 (mandatory off loopback)")
    rate_limit_per_s: float = Field(
        default=50.0, gt=0, description="sustained requests/s per token (or client)"
    )
    rate_limit_burst: int = Field(default=200, gt=0, description="requests a token may make at once")

    @property
    def is_sqlite(self) -> bool:
        return self.database_url.startswith("sqlite")

    @property
    def should_auto_upgrade(self) -> bool:
        return self.is_sqlite if self.auto_upgrade is None else self.auto_upgrade


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()
