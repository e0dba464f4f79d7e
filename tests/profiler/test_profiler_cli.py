"""`memplan profile` builds a model from config, profiles it and writes a valid Trace file."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from memplan.cli import app
from client.contract import Trace


def test_profile_command_writes_a_valid_trace(tmp_path: Path) -> None:
    out = tmp_path / "trace.json"
    result = CliRunner().invoke(app, ["profile", "--model", "gpt2", "--layers", "2", "--hidden", "32",
                                      "--batch", "2", "--seq", "16", "--vocab", "128", "--repeats", "1",
                                      "-o", str(out)])
    assert result.exit_code == 0, result.output
    trace = Trace.model_validate_json(out.read_text())
    assert trace.model.name == "gpt2-2L-32H"
    assert len(trace.model.repeated_blocks) == 2
    assert (trace.workload.batch_size, trace.workload.sequence_length) == (2, 16)
    assert trace.allocation_trace is not None


def test_profile_command_rejects_an_unknown_architecture(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["profile", "--model", "bert", "--layers", "2", "--hidden", "32",
                                      "-o", str(tmp_path / "t.json")])
    assert result.exit_code == 2
    assert "bert" in result.output
