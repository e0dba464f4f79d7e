"""`memplan profile` builds a model from config, profiles it and writes a valid Trace file."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from typer.testing import CliRunner

from client.contract import Trace
from memplan.cli import app
from planner_service.embedded import free_port


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


def _command_rank(rank: int, port: int, out: str) -> None:
    """One rank as torchrun starts it: the launcher's variables, then the command as a person runs it."""
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.pop("LOCAL_WORLD_SIZE", None)
    torch.set_num_threads(1)
    result = CliRunner().invoke(
        app,
        [
            "profile",
            *("--model", "gpt2", "--layers", "2", "--hidden", "32", "--batch", "2", "--seq", "16"),
            *("--vocab", "128", "--repeats", "1", "--no-allocation-trace", "--process-group"),
            *("-o", str(Path(out) / f"trace{rank}.json")),
        ],
    )
    assert result.exit_code == 0, result.output


def test_profile_command_under_a_launcher_writes_the_jobs_multi_rank_trace_on_rank_zero(
    tmp_path: Path,
) -> None:
    port = free_port()
    mp.start_processes(_command_rank, args=(port, str(tmp_path)), nprocs=2, join=True, start_method="fork")
    trace = Trace.model_validate_json((tmp_path / "trace0.json").read_text())
    d = trace.hardware.distributed
    assert d is not None and (d.world_size, d.ranks_per_node) == (2, 2) and d.collectives is not None
    assert trace.hardware.key.endswith(":x2:w2r2")
    assert not (
        tmp_path / "trace1.json"
    ).exists()  # one trace for the job (the slowest rank's), written by rank 0


def test_profile_command_with_process_group_needs_a_launcher(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    result = CliRunner().invoke(
        app,
        ["profile", "--model", "gpt2", "--layers", "2", "--hidden", "32", "--process-group"]
        + ["-o", str(tmp_path / "t.json")],
    )
    assert result.exit_code == 2
    said = " ".join(result.output.replace("│", " ").split())  # the error box wraps lines
    assert (
        "needs the environment of a launcher such as torchrun (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT"
        in said
    )
