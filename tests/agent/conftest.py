"""Fixtures of the agent's tests: the real planner service (SQLite) on a loopback port, as a user's job meets it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from planner_service.embedded import EmbeddedServer


@pytest.fixture
def service(tmp_path: Path) -> Iterator[str]:
    """A fresh service of this test's own (its SQLite file in tmp_path, one worker); yields its URL."""
    from planner_service.settings import Settings

    with EmbeddedServer(Settings(database_url=f"sqlite:///{tmp_path / 'memplan.db'}", workers=1)) as url:
        yield url
