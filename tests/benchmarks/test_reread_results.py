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
    assert line.startswith(
        f"{RUN.name}: Intel(R) Xeon(R) Processor, 2 rank(s), 24 rank-rows; switches not recorded;"
    )
    assert "entry points" in line and "outside" in line


def test_a_file_says_which_measuring_switches_it_ran_with(run: dict) -> None:  # type: ignore[type-arg]
    from _results import MEASURING_SWITCHES

    assert "switches" not in run  # session 30's file: recorded before the switches were
    assert phase_errors(run)["switches"] is None  # type: ignore[index]
    switched = {name: None for name in MEASURING_SWITCHES} | {"MEMPLAN_WHOLE_MODEL_PROBE": "0"}
    assert phase_errors({**run, "switches": switched})["switches"] == switched  # type: ignore[index]


def test_a_run_records_the_probe_switch_as_its_environment_sets_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    from _results import Run

    monkeypatch.setenv("MEMPLAN_WHOLE_MODEL_PROBE", "0")
    monkeypatch.setenv("MEMPLAN_TOKEN", "secret")
    doc = Run("predict_vs_measure", SimpleNamespace(world_size=2)).document()
    assert doc["switches"] == {"MEMPLAN_WHOLE_MODEL_PROBE": "0"}
    assert "secret" not in json.dumps(doc)
    monkeypatch.delenv("MEMPLAN_WHOLE_MODEL_PROBE")
    assert Run("predict_vs_measure", SimpleNamespace()).document()["switches"] == {
        "MEMPLAN_WHOLE_MODEL_PROBE": None
    }
