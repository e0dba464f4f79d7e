"""scripts/check_local_imports.py (run by scripts/lint.sh): an import inside a function fails unless a
`# local import: <reason>` comment says why, on its line or just above it (or above the run of imports it
opens). No file is exempt."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "check_local_imports.py"


def _check(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args, str(root)], capture_output=True, text=True, check=False
    )


def _tree(tmp_path: Path, source: str) -> Path:
    (tmp_path / "agent").mkdir()
    (tmp_path / "agent" / "mod.py").write_text(source)
    return tmp_path


BARE = """import os


def f():
    import json

    return json, os
"""


def test_a_bare_import_inside_a_function_fails_naming_the_file_and_line(tmp_path: Path) -> None:
    result = _check(_tree(tmp_path, BARE))
    assert result.returncode == 1
    assert "agent/mod.py:5: import inside a function without a reason: import json" in result.stderr


def test_a_reason_on_the_line_above_or_above_the_run_of_imports_passes(tmp_path: Path) -> None:
    source = """def f():
    import json  # local import: an optional dependency

    return json


def g():
    # local import: torch loads when the command runs,
    # not for `memplan --help`
    import copy

    from pathlib import Path

    return copy, Path


def h():
    x = 1
    import json  # local import: said on its own line

    return x, json
"""
    result = _check(_tree(tmp_path, source))
    assert result.returncode == 0, result.stderr
    assert "4 in functions, 4 with a reason" in result.stdout


def test_a_reason_above_a_statement_does_not_cover_an_import_after_it(tmp_path: Path) -> None:
    source = """def f():
    # local import: covers nothing, a statement comes first
    x = 1
    import json

    return x, json
"""
    result = _check(_tree(tmp_path, source))
    assert result.returncode == 1
    assert "agent/mod.py:4:" in result.stderr


def test_a_comment_that_only_looks_like_a_reason_inside_a_string_does_not_count(tmp_path: Path) -> None:
    source = """def f():
    text = "# local import: not a comment"; import json

    return text, json
"""
    assert _check(_tree(tmp_path, source)).returncode == 1


def test_the_tree_passes_the_check() -> None:
    result = _check(ROOT)
    assert result.returncode == 0, result.stderr
