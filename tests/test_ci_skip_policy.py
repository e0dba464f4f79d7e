"""The CI skip policy of tests/conftest.py: with CI set, a skip fails the run unless it is allow-listed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import CI_ALLOWED_SKIPS, REPO, ci_skip_allowed

SAMPLE = """
import pytest

def test_skips_at_run_time():
    pytest.skip("no database")

@pytest.mark.skipif(True, reason="marker")
def test_skipped_by_a_marker():
    pass

@pytest.mark.xfail(reason="known")
def test_expected_failure():
    assert False

def test_passes():
    pass
"""


def _run(tmp_path: Path, ci: str | None) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    if ci is not None:
        env["CI"] = ci
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "tests.conftest",
            "-rA",
            str(tmp_path / "test_sample.py"),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )


@pytest.mark.parametrize("ci", [None, "0", "false"])
def test_outside_ci_a_skip_is_a_skip(tmp_path: Path, ci: str | None) -> None:
    out = _run(tmp_path, ci)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "1 passed, 2 skipped, 1 xfailed" in out.stdout


def test_in_ci_every_skip_fails_the_run_and_says_why(tmp_path: Path) -> None:
    out = _run(tmp_path, "true")
    assert out.returncode == 1, out.stdout + out.stderr
    assert "test_skips_at_run_time skipped in CI (Skipped: no database)" in out.stdout
    assert "test_skipped_by_a_marker skipped in CI (Skipped: marker)" in out.stdout
    assert "1 xfailed" in out.stdout and "1 passed" in out.stdout  # xfail and passes are untouched


def test_the_allow_list_names_real_tests_with_reasons() -> None:
    for prefix, why in CI_ALLOWED_SKIPS.items():
        path, _, name = prefix.partition("::")
        assert (REPO / path).is_file(), prefix
        assert name == "" or f"def {name}" in (REPO / path).read_text(), prefix
        assert len(why) > 20, prefix
    assert ci_skip_allowed(
        "tests/agent/allocator/test_build.py::test_the_cuda_backend_compiles_and_exports_x"
    )
    assert (
        ci_skip_allowed("tests/planner_service/solver/allocation/test_alloc_challenging.py::test_a") is None
    )
