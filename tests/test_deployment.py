"""The production layout: docker-compose has postgres, one-shot migrations, api and workers, all health-checked."""

from __future__ import annotations

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
