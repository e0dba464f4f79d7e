"""The layers hold (`.importlinter`, run by scripts/lint.sh too): client imports neither agent nor planner_service,
planner_service never imports agent, nothing imports the `memplan` command's composition root; inside the service,
`db` imports nothing above it and `plans` (the plan rules) neither the endpoints nor the jobs."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_import_contracts_are_kept() -> None:
    lint_imports = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    assert lint_imports, "import-linter is not installed (it is in the dev extra: pip install -e '.[dev]')"
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    res = subprocess.run(
        [lint_imports, "--no-cache", str(REPO / ".importlinter")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "5 kept, 0 broken" in res.stdout
