"""`memplan alloc solve` and `memplan alloc simulate` end to end through the real CLI."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from typer.testing import CliRunner

from memplan.cli import app
from tests.planner_service.solver.allocation.conftest import event, trace

runner = CliRunner()


def flat(text: str) -> str:
    """Output with rich's line wrapping undone."""
    return " ".join(text.split())


def test_solve_writes_offsets_that_fit(tmp_path: Path) -> None:
    src = tmp_path / "in.csv"
    src.write_text("id,lower,upper,size\nb1,0,3,4\nb2,3,9,4\nb3,0,9,4\nb4,9,21,4\nb5,0,21,4\n")
    out = tmp_path / "out.csv"
    result = runner.invoke(app, ["alloc", "solve", str(src), "--capacity", "12", "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert "optimal" in result.output
    rows = list(csv.DictReader(out.open()))
    assert [r["id"] for r in rows] == ["b1", "b2", "b3", "b4", "b5"]
    assert all(int(r["offset"]) + int(r["size"]) <= 12 for r in rows)


def test_solve_bad_row_names_the_line(tmp_path: Path) -> None:
    src = tmp_path / "bad.csv"
    src.write_text("id,lower,upper,size\nb1,0,3,4\nb2,4,2,4\n")
    result = runner.invoke(app, ["alloc", "solve", str(src), "-o", str(tmp_path / "o.csv")])
    assert result.exit_code == 2
    assert "line 3 (id b2): upper (2) must be greater than lower (4)" in flat(result.output)


def test_solve_reports_infeasible_capacity(tmp_path: Path) -> None:
    src = tmp_path / "in.csv"
    src.write_text("id,lower,upper,size\na,0,3,8\nb,1,4,8\n")
    result = runner.invoke(
        app, ["alloc", "solve", str(src), "--capacity", "10", "-o", str(tmp_path / "o.csv")]
    )
    assert result.exit_code == 1
    assert "infeasible" in result.output and "16 B needed" in flat(result.output)


def test_simulate_prints_plan_beside_caching_allocator(tmp_path: Path) -> None:
    tr = trace(4, event(0, 3 << 20, 0, None, "param"), event(1, 600 << 10, 1, 3), event(2, 600 << 10, 2, 4))
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(tr.model_dump(mode="json")))
    result = runner.invoke(app, ["alloc", "simulate", str(path)], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "caching allocator" in result.output and "peak reserved" in result.output
    assert "22.00 MiB" in result.output  # 20 MiB large segment + 2 MiB small segment


def test_solve_fit_only_stops_at_the_first_fit_under_capacity(tmp_path: Path) -> None:
    src = tmp_path / "in.csv"
    src.write_text("id,lower,upper,size\na,0,3,8\nb,1,4,8\nc,3,6,8\n")
    out = tmp_path / "out.csv"
    result = runner.invoke(
        app, ["alloc", "solve", str(src), "--capacity", "64", "--fit-only", "-o", str(out)]
    )
    assert result.exit_code == 0, result.output
    rows = list(csv.DictReader(out.open()))
    assert all(int(r["offset"]) + int(r["size"]) <= 64 for r in rows)
