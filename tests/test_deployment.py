"""The production layout: docker-compose has postgres, one-shot migrations, api and workers, all health-checked;
set-up puts the `memplan` command on PATH."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]


def test_compose_runs_migrations_once_before_the_api_and_checks_health() -> None:
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    services = compose["services"]
    assert {"postgres", "migrate", "api", "worker"} <= set(services)
    assert services["migrate"]["command"] == ["memplan", "db", "upgrade"]
    assert services["migrate"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    for name in ("api", "worker"):
        assert services[name]["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
    for name in ("postgres", "api", "worker"):
        assert "healthcheck" in services[name], name
    assert "/readyz" in " ".join(services["api"]["healthcheck"]["test"])
    assert "--workers" in services["api"]["command"]  # the API leaves solving to the worker service
    assert compose["x-memplan"]["environment"]["MEMPLAN_AUTH"] == "true"  # serving 0.0.0.0 requires auth


def test_ci_runs_the_readme_test_command() -> None:
    readme = (REPO / "README.md").read_text()
    ci = (REPO / ".ci" / "run").read_text()
    assert "./scripts/test.sh" in readme and "./scripts/test.sh" in ci
    assert "./scripts/demo.sh" in readme


def _link(tmp_path: Path, path: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HOME": str(tmp_path), "PATH": path}
    env.pop("MEMPLAN_BIN_DIR", None)
    return subprocess.run(
        [str(REPO / "scripts" / "link_memplan.sh")],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    )


def test_setup_puts_memplan_on_path_or_prints_the_line_to_add(tmp_path: Path) -> None:
    assert "./scripts/link_memplan.sh" in (REPO / "scripts" / "setup.sh").read_text()
    bin_dir = tmp_path / ".local" / "bin"
    out = _link(tmp_path, f"{bin_dir}:{os.environ['PATH']}").stdout
    link = bin_dir / "memplan"
    assert link.is_symlink() and Path(os.readlink(link)) == REPO / ".venv" / "bin" / "memplan", out
    assert "on PATH" in out
    _link(tmp_path, f"{bin_dir}:{os.environ['PATH']}")  # again: the link is replaced, no error
    assert link.is_symlink()

    elsewhere = tmp_path / "other"
    elsewhere.mkdir()
    out = _link(
        elsewhere, os.environ["PATH"]
    ).stdout  # ~/.local/bin not on PATH: nothing linked, one line to add
    assert not (elsewhere / ".local").exists()
    assert f'export PATH="{REPO}/.venv/bin:$PATH"' in out

    link.unlink()
    link.write_text("someone else's memplan")
    out = _link(tmp_path, f"{bin_dir}:{os.environ['PATH']}").stdout
    assert link.read_text() == "someone else's memplan" and "left alone" in out


def test_the_console_script_is_the_assembled_command() -> None:
    import tomllib

    import typer

    entry = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]["memplan"]
    module, attr = entry.split(":")
    app = getattr(importlib.import_module(module), attr)
    assert isinstance(app, typer.Typer)
    help_text = subprocess.run(
        [sys.executable, "-m", module.rsplit(".", 1)[0], "--help"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
        env={**os.environ, "COLUMNS": "200"},
    ).stdout
    for command in ("serve", "worker", "plans", "traces", "models", "hardware", "profile", "demo", "alloc"):
        assert command in help_text, command
