"""`benchmarks/reread_results.py phase-errors` on a saved 2-rank run of the issue's command (session 30)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUN = ROOT / "benchmarks" / "results" / "predict_vs_measure-20261202T001509Z.json"

sys.path.insert(0, str(ROOT / "benchmarks"))
from reread_results import phase_errors  # noqa: E402


@pytest.fixture(scope="module")
def run() -> dict:  # type: ignore[type-arg]
    return json.loads(RUN.read_text())


def test_one_row_gives_its_own_differences_and_its_overhead_split_adds_up(run: dict) -> None:  # type: ignore[type-arg]
    row = run["rows"][0]
    got = phase_errors({**run, "rows": [row]})
    assert got is not None and got["world_size"] == 2 and got["rank_rows"] == 1
    m = got["median_ms"]
    bd = row["breakdown"]
    assert m["iteration"] == pytest.approx(bd["measured_ms"]["iteration"] - bd["predicted_ms"]["iteration"])
    assert m["host_step"] == pytest.approx(bd["counters_ms"]["host_step"] - bd["predicted_ms"]["host_step"])
    assert m["overhead_measured"] == pytest.approx(m["overhead_entry_points"] + m["overhead_outside"])
    assert m["overhead_measured"] == pytest.approx(bd["measured_ms"]["iteration"] - 1e3 * row["plain_now_s"])
    assert 0 < m["overhead_entry_points"] < m["overhead_measured"]


def test_rows_without_a_breakdown_or_a_plan_give_none(run: dict) -> None:  # type: ignore[type-arg]
    assert phase_errors({**run, "rows": [{**r, "breakdown": None} for r in run["rows"]]}) is None
    assert (
        phase_errors({**run, "rows": [{k: v for k, v in r.items() if k != "plan"} for r in run["rows"]]})
        is None
    )


def test_the_command_prints_one_line_per_file() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "reread_results.py"), "phase-errors", str(RUN)],
        capture_output=True,
        text=True,
        check=True,
    )
    (line,) = out.stdout.splitlines()
    assert line.startswith(f"{RUN.name}: Intel(R) Xeon(R) Processor, 2 rank(s), 24 rank-rows;")
    assert "entry points" in line and "outside" in line
