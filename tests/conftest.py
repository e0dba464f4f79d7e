"""Shared fixtures (databases: SQLite file, real PostgreSQL; a migrated database per test; the app) and the CI
skip policy: with CI set, a skipped test fails unless `CI_ALLOWED_SKIPS` names it with a reason."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
POSTGRES_ADMIN_URL = os.environ.get(
    "MEMPLAN_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
)


def in_ci() -> bool:
    """CI is set (GitHub Actions, GitLab and `.ci/run` set CI=true); "", "0", "false" and "no" mean unset."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


# Skips that are allowed in CI: node id prefix -> why the test cannot run on some CI machines. Anything else
# that skips with CI set fails, so a test can never pass CI by not running.
CI_ALLOWED_SKIPS: dict[str, str] = {
    "tests/agent/allocator/test_build.py::test_the_cuda_backend_compiles": "CUDA-only: needs the CUDA runtime headers and libcudart",
    "tests/agent/allocator/test_switching.py::test_installing_without_cuda_fails_with_a_clear_error": "CPU-only: on a GPU machine it would really swap this process's CUDA allocator",
    "tests/agent/gpu/test_cuda_training.py": "CUDA-only: trains on a real GPU (scripts/gpu_check.sh runs it there)",
    "tests/agent/gpu/test_cuda_ranks.py": "CUDA-only: two ranks train on a real GPU (scripts/gpu_check.sh runs it there)",
}


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist (`scripts/test.sh` runs the suite on several worker processes) each worker gets its
    share of the cores for torch's intra-op threads: without it every worker's OpenMP pool spans all the
    cores and the workers' spinning threads slow each other down. Set before any test imports torch; the
    variables reach the processes the tests spawn (ranks, fresh interpreters). A value already in the
    environment is the user's and is kept."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or "1")
    if workers <= 1:
        return
    threads = str(max(1, len(os.sched_getaffinity(0)) // workers))
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(name, threads)


def ci_skip_allowed(nodeid: str) -> str | None:
    """The reason a skip of this test is allowed in CI, or None."""
    return next((why for prefix, why in CI_ALLOWED_SKIPS.items() if nodeid.startswith(prefix)), None)


def _fail_skip_in_ci(report: pytest.TestReport | pytest.CollectReport) -> None:
    if not (report.skipped and in_ci()) or hasattr(report, "wasxfail"):
        return
    if ci_skip_allowed(report.nodeid):
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    report.outcome = "failed"
    report.longrepr = (
        f"{report.nodeid} skipped in CI ({reason}); a skip in CI is a failure unless "
        "tests/conftest.py CI_ALLOWED_SKIPS names the test with a reason"
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    outcome = yield
    _fail_skip_in_ci(outcome.get_result())


def pytest_collectreport(report: pytest.CollectReport) -> None:
    _fail_skip_in_ci(report)


@pytest.fixture(autouse=True, scope="session")
def _local_feedback_file(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """agent.wrap records feedback locally when no service takes it: keep that out of the user's home."""
    old = os.environ.get("MEMPLAN_FEEDBACK_PATH")
    os.environ["MEMPLAN_FEEDBACK_PATH"] = str(tmp_path_factory.mktemp("feedback") / "feedback.jsonl")
    yield
    if old is None:
        os.environ.pop("MEMPLAN_FEEDBACK_PATH", None)
    else:
        os.environ["MEMPLAN_FEEDBACK_PATH"] = old


def _postgres_reachable() -> str | None:
    try:
        import psycopg

        dsn = POSTGRES_ADMIN_URL.replace("postgresql+psycopg://", "postgresql://")
        with psycopg.connect(dsn, connect_timeout=3):
            return None
    except Exception as exc:  # noqa: BLE001 - any failure means "not reachable"
        return f"{type(exc).__name__}: {exc}"


@pytest.fixture(scope="session")
def postgres_admin() -> str:
    """URL of a reachable PostgreSQL admin database. `.ci/run` (via scripts/ensure_postgres.sh) provides one."""
    problem = _postgres_reachable()
    if problem:
        if os.environ.get("CI"):
            pytest.fail(
                f"PostgreSQL is required in CI and is not reachable at {POSTGRES_ADMIN_URL}: {problem}"
            )
        pytest.skip(
            f"PostgreSQL not reachable at {POSTGRES_ADMIN_URL} (run scripts/ensure_postgres.sh): {problem}"
        )
    return POSTGRES_ADMIN_URL


def _fresh_postgres(admin_url: str) -> Iterator[str]:
    import psycopg

    name = f"memplan_test_{uuid.uuid4().hex[:12]}"
    dsn = admin_url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    base = admin_url.rsplit("/", 1)[0]
    try:
        yield f"{base}/{name}"
    finally:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def empty_db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A URL of an empty database (no schema), on each backend."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'memplan.db'}"
    else:
        yield from _fresh_postgres(request.getfixturevalue("postgres_admin"))


@pytest.fixture
def postgres_url(postgres_admin: str) -> Iterator[str]:
    """A fresh PostgreSQL database migrated to head (for what only PostgreSQL does: LISTEN/NOTIFY)."""
    from planner_service.db.migrate import upgrade

    for url in _fresh_postgres(postgres_admin):
        upgrade(url)
        yield url


@pytest.fixture
def db_url(empty_db_url: str) -> str:
    """A database migrated to head by the real Alembic migrations."""
    from planner_service.db.migrate import upgrade

    upgrade(empty_db_url)
    return empty_db_url


@pytest.fixture
def settings(db_url: str):  # type: ignore[no-untyped-def]
    from planner_service.settings import Settings

    # ingest_prestart off: hundreds of short-lived test apps need no ingest processes until one uploads
    return Settings(
        database_url=db_url,
        workers=1,
        poll_interval_s=0.05,
        stalled_after_s=5.0,
        auto_upgrade=False,
        ingest_prestart=False,
    )


@pytest.fixture
def api(settings):  # type: ignore[no-untyped-def]
    """The real app (with its in-process worker) behind Starlette's test client."""
    from fastapi.testclient import TestClient

    from planner_service.app import create_app

    with TestClient(create_app(settings)) as client:
        yield client


@pytest.fixture
def trace():  # type: ignore[no-untyped-def]
    from planner_service.solver.testing.synthetic import synthetic_trace

    return synthetic_trace(n_blocks=4, hidden=256, vocab=1000, batch=2, seq=128)
