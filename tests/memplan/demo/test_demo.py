"""`memplan demo` runs the whole loop on the embedded service and shows plan, predictions vs measurements, losses."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

pytestmark = pytest.mark.slow


def test_demo_trains_under_a_tight_limit_with_a_service_plan_and_matches_the_baseline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from memplan.cli import app

    monkeypatch.setenv("MEMPLAN_DATABASE_URL", f"sqlite:///{tmp_path / 'demo.db'}")
    from planner_service.settings import get_settings

    if hasattr(get_settings, "cache_clear"):
        get_settings.cache_clear()
    result = CliRunner().invoke(
        app,
        ["demo", "--layers", "3", "--hidden", "128", "--seq", "64", "--batch", "2", "--steps", "8"],
        catch_exceptions=False,
    )
    out = " ".join(result.output.split())  # the console wraps at its width: compare words
    assert result.exit_code == 0, result.output
    for expected in (
        "plan under",
        "block modes",
        "predicted vs measured",
        "iteration time",
        "peak device memory",
        "feedback: posted to http://127.0.0.1",
        "agrees within 1e-5",
    ):
        assert expected in out, f"{expected!r} missing from:\n{out}"
    # a word longer than the console's line (the database path, under a pytest worker's deeper tmp_path) is
    # broken across lines: compare it with every line break and space removed
    database = f"database sqlite:///{tmp_path / 'demo.db'}"
    assert "".join(database.split()) in "".join(result.output.split()), f"{database!r} missing from:\n{out}"
    for wrong in (r"\b1 buffers", "trace's host memory", "layout statuses"):  # not "491 buffers placed"
        assert re.search(wrong, out) is None, f"{wrong!r} in:\n{out}"
    if hasattr(get_settings, "cache_clear"):
        get_settings.cache_clear()
