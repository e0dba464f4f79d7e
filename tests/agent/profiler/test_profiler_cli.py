"""`memplan profile` builds a model from config, profiles it and writes a valid Trace file."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from client.contract import Trace
from memplan.cli import app


def test_profile_command_writes_a_valid_trace(tmp_path: Path) -> None:
    out = tmp_path / "trace.json"
    result = CliRunner().invoke(
        app,
        [
            "profile",
            "--model",
            "gpt2",
            "--layers",
            "2",
            "--hidden",
            "32",
            "--batch",
            "2",
            "--seq",
            "16",
            "--vocab",
            "128",
            "--repeats",
            "1",
            "-o",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    trace = Trace.model_validate_json(out.read_text())
    # one name per model, whoever profiles it: the command names it as agent.wrap's profile does
    assert trace.model.name == "GPT2LMHeadModel-2L-32H"
    assert len(trace.model.repeated_blocks) == 2
    assert (trace.workload.batch_size, trace.workload.sequence_length) == (2, 16)
    assert trace.allocation_trace is not None


def test_profile_command_rejects_an_unknown_architecture(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        app, ["profile", "--model", "bert", "--layers", "2", "--hidden", "32", "-o", str(tmp_path / "t.json")]
    )
    assert result.exit_code == 2
    assert "bert" in result.output


def test_the_command_and_agent_profile_give_a_zoo_model_one_name(tmp_path: Path) -> None:
    import agent
    from agent.testing.model_zoo import build, sample_batch

    out = tmp_path / "trace.json"
    result = CliRunner().invoke(
        app,
        [
            "profile",
            "--model",
            "qwen2",
            "--layers",
            "2",
            "--hidden",
            "64",
            "--batch",
            "1",
            "--seq",
            "16",
            "--vocab",
            "128",
            "--repeats",
            "1",
            "--no-allocation-trace",
            "-o",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    net, config = build("qwen2", 2, 64, vocab=128, seq=16)
    by_agent = agent.profile(
        net, sample_batch(config, 1, 16), repeats=1, allocation_trace=False
    )  # as wrap calls it
    assert (
        Trace.model_validate_json(out.read_text()).model.name
        == by_agent.model.name
        == "Qwen2ForCausalLM-2L-64H"
    )
