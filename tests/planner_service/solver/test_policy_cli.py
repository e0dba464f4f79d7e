"""`memplan plan solve`: reads a Trace file, prints the plan summary, writes the Plan JSON."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from client.contract import Plan, SolverStatus
from memplan.cli import app
from planner_service.solver.cpsat_solve import RELATIVE_GAP_LIMIT
from planner_service.solver.testing.synthetic import synthetic_trace


def _trace_file(tmp_path: Path) -> Path:
    path = tmp_path / "trace.json"
    path.write_text(synthetic_trace(n_blocks=6, hidden=1024, batch=8, seq=1024).model_dump_json())
    return path


def test_plan_solve_writes_the_plan_and_prints_modes_and_prediction(tmp_path: Path):
    out = tmp_path / "plan.json"
    result = CliRunner().invoke(
        app,
        [
            "plan",
            "solve",
            str(_trace_file(tmp_path)),
            "--device-memory",
            "3GiB",
            "--host-memory",
            "64GiB",
            "--time-limit",
            "10",
            "-o",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    plan = Plan.model_validate_json(out.read_text())
    assert plan.solver.status in (SolverStatus.optimal, SolverStatus.feasible)
    assert plan.solver.gap is not None and plan.solver.gap <= RELATIVE_GAP_LIMIT
    assert plan.constraints.device_memory_bytes == 3 * 2**30
    assert plan.policy is not None and plan.policy.mode_strip() in result.output
    assert "persistent chunks" in result.output and "ms/iter" in result.output


def test_plan_solve_with_protrain_and_too_little_memory_exits_1_with_the_minimum(tmp_path: Path):
    out = tmp_path / "plan.json"
    result = CliRunner().invoke(
        app,
        [
            "plans",
            "solve",
            str(_trace_file(tmp_path)),
            "--device-memory",
            "64MiB",
            "--solver",
            "protrain",
            "-o",
            str(out),
        ],
    )
    assert result.exit_code == 1, result.output
    plan = Plan.model_validate_json(out.read_text())
    assert plan.solver.status == SolverStatus.infeasible and plan.solver.min_device_memory_bytes
    assert "fits from" in result.output


def test_plan_solve_rejects_bad_input_with_a_clear_message(tmp_path: Path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema_version": 1}')
    result = CliRunner().invoke(app, ["plan", "solve", str(bad), "--device-memory", "8GiB"])
    assert result.exit_code == 2 and "hardware" in result.output
    result = CliRunner().invoke(
        app, ["plan", "solve", str(_trace_file(tmp_path)), "--device-memory", "8GiB", "--solver", "gurobi"]
    )
    assert result.exit_code == 2 and "unknown 'gurobi'" in result.output
    result = CliRunner().invoke(app, ["plan", "solve", str(_trace_file(tmp_path)), "--device-memory", "lots"])
    assert result.exit_code == 2 and "not a byte size" in result.output
