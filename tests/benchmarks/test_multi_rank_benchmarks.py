"""benchmarks/train_throughput.py and predict_vs_measure.py with `--world-size N` (issue 20): the arguments,
the launch of 2 gloo ranks in a tiny configuration, and how per-rank rows become a strategy's row."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from client.contract import Plan

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture()
def tt(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    return importlib.import_module("train_throughput")


@pytest.fixture()
def pvm(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    return importlib.import_module("predict_vs_measure")


@pytest.mark.parametrize("script", ["train_throughput", "predict_vs_measure"])
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--world-size", "2", "--batch", "3"], "--batch: 3 rows do not split evenly over --world-size 2"),
        (["--world-size", "0"], "--world-size: must be at least 1, got 0"),
    ],
)
def test_a_global_batch_that_does_not_split_over_the_ranks_is_refused(
    script: str,
    argv: list[str],
    message: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    module = importlib.import_module(script)
    monkeypatch.setattr(sys, "argv", [script, *argv, "--out", str(tmp_path / "r.json")])
    with pytest.raises(SystemExit) as exc:
        module.main()
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # refused before anything ran or was saved


def test_memplan_runs_on_two_gloo_ranks_each_with_its_rows_of_the_global_batch(tt: ModuleType) -> None:
    """Two ranks wrap under one group: both profile, rank 0 solves, both apply the same plan. Forked, not
    spawned as the benchmark's ranks are (the same entry and job; a spawned rank re-imports torch,
    transformers and the agent: ~25 s for two on the loaded CI box)."""
    spec = {
        "kind": "llama",
        "layers": 1,
        "hidden": 32,
        "seq": 16,
        "batch": 4,
        "steps": 1,
        "device_type": "cpu",
        "dtype": "fp32",
        "threads": 1,
        "strategy": "memplan",
        "limit_bytes": 2**30,
    }
    ranks = tt.launch(tt.run_rank, 2, spec, timeout_s=120, start_method="fork")
    assert [r.get("rank") for r in ranks] == [0, 1], ranks
    for r in ranks:
        assert r["iteration_s"] > 0 and r["peak_device_bytes"] > 0
        assert r["peak_rss_bytes"] > 0 and r["rss_before_bytes"] > 0
    plan = [{k: r[k] for k in tt.PLAN_FIELDS if k != "wrap_s"} for r in ranks]
    assert plan[0] == plan[1]  # rank 0 obtained the plan, rank 1 received it
    row = tt.combine_ranks(ranks)
    assert row["iteration_s"] == max(r["iteration_s"] for r in ranks)
    assert row["peak_device_bytes_per_rank"] == [r["peak_device_bytes"] for r in ranks]
    # each rank trained 2 of the 4 global rows
    full = {"input_ids": torch.arange(8).reshape(4, 2)}
    assert tt.split_batch(full, 1, 2)["input_ids"].tolist() == [[4, 5], [6, 7]]


def test_a_strategy_row_says_why_a_rank_failed_rather_than_that_its_peer_was_ended(tt: ModuleType) -> None:
    ranks = [
        {"skipped": "rank 0 ended without a result (ProcessExitedException: ...)"},
        {"skipped": "rank 1: OutOfMemoryError: CUDA out of memory", "out_of_memory": True},
    ]
    row = tt.combine_ranks(ranks)
    assert row["skipped"] == "rank 1: OutOfMemoryError: CUDA out of memory"
    assert row["out_of_memory"] is True and "iteration_s" not in row


def test_the_trials_are_combined_per_configuration_and_rank(pvm: ModuleType) -> None:
    """A rank is held to the targets on its own: rank 1's worse trials are not averaged with rank 0's."""

    def row(trial: int, rank: int, it: float, peak: float) -> dict[str, object]:
        return {
            "trial": trial,
            "kind": "llama",
            "layers": 4,
            "fraction": 0.5,
            "rank": rank,
            "iteration_error": it,
            "peak_error": peak,
        }

    rows = [row(t, 0, 0.01 * t, 0.0) for t in range(3)] + [
        row(t, 1, 0.2 + 0.01 * t, 0.03 * (t == 2)) for t in range(3)
    ]
    combined = pvm.combine_trials(rows)
    by_rank = {r["rank"]: r for r in combined["rows"]}
    assert by_rank[0]["iteration_error"] == pytest.approx(0.01)
    assert by_rank[1]["iteration_error"] == pytest.approx(0.21)
    assert by_rank[1]["peak_error"] == pytest.approx(0.03)
    summary = combined["summary"]
    assert summary["rows"] == 2 and summary["iteration_within_10pct"] == 1 and summary["peak_above_2pct"] == 1
    assert summary["worst_iteration_row"] == "llama-4L at 0.5 rank 1: +21.0%"


def test_predict_vs_measure_ranks_stay_in_step_past_a_fraction_with_no_plan(pvm: ModuleType) -> None:
    """A fraction with no feasible plan is a row on every rank (rank 0's reason), and the next fraction still
    runs on both ranks: no rank is left waiting in a collective the other skipped."""
    spec = {
        "device_type": "cpu",
        "kinds": ["llama"],
        "layers": [1],
        "fractions": [0.01, 3.0],  # 3x the un-managed peak: the tiny model fits with the headroom
        "hidden": 32,
        "seq": 16,
        "batch": 4,
        "steps": 4,
        "plain_steps": 1,
        "threads": 1,
        "breakdown": True,
    }
    results = pvm.launch(pvm.measure_rank, 2, spec, timeout_s=120, start_method="fork")
    assert [r.get("rank") for r in results] == [0, 1], results
    rows = [r["rows"] for r in results]
    assert [[row["fraction"] for row in rs] for rs in rows] == [[0.01, 3.0], [0.01, 3.0]]
    assert "PlanInfeasibleError" in rows[0][0]["error"]
    assert rows[1][0]["error"].startswith("RuntimeError: memplan: rank 0 could not obtain the plan")
    for rs in rows:
        assert rs[0]["status"] == "no plan"
        measured = rs[1]
        assert measured["rank"] in (0, 1) and measured["plan_world_size"] == rows[0][1]["plan_world_size"]
        assert measured["measured_peak_device_bytes"] > 0 and measured["steps_timed"] >= 1
        assert measured["peak_error"] <= 0.02
        times = measured["profiled_iteration_s"]  # every rank profiled; the trace is the slowest rank's
        assert len(times) == 2 and min(times) > 0 and measured["trace_iteration_s"] == max(times)
        # --breakdown: this rank's phases, sections and collective counters beside the plan's terms
        bd = measured["breakdown"]
        assert bd["iterations"] == 3  # 4 steps, the first a warm-up
        phases = ("forward", "backward", "step", "zero_grad", "iteration")
        assert all(bd["measured_ms"][k] > 0 for k in phases)
        assert bd["measured_ms"]["iteration"] >= bd["measured_ms"]["forward"]
        assert set(bd["counters_ms"]) == {
            "host_step",
            "grad_reduction",
            "grad_fill",
            "param_gather",
            "compute_barrier",
            "control",
        }
        assert bd["counters_ms"]["grad_reduction"] > 0  # every gradient is averaged across the 2 ranks
        # the runtime's control checks (a same-use check and the agreement at its end every backward) are timed, and the
        # plan prices them (session 10)
        assert bd["counters_ms"]["control"] > 0 and bd["predicted_ms"]["control"] > 0
        assert bd["predicted_ms"]["iteration"] == pytest.approx(measured["predicted_iteration_s"] * 1e3)
        assert bd["sections_ms"]["root_forward"] > 0
        # the same sections by the loop's phase they ended in: forward's hooks in forward, the step in step()
        by_phase = bd["sections_by_phase_ms"]
        assert set(by_phase) <= {"forward", "backward", "step", "zero_grad"}
        assert by_phase["forward"]["root_forward"] == pytest.approx(bd["sections_ms"]["root_forward"])
        assert "root_forward" not in by_phase.get("backward", {})
        assert sum(v for secs in by_phase.values() for v in secs.values()) == pytest.approx(
            sum(bd["sections_ms"].values())
        )
        assert measured["host_limit_bytes"] is None  # no --host-fraction: the machine's host memory
        assert pvm.breakdown_line(bd).startswith("ms measured/predicted: iteration ")
    # rank 0's row holds the plan it solved and broadcast (an outlier can be replayed); rank 1's does not
    plan = Plan.model_validate(rows[0][1]["plan"])
    assert plan.predictions is not None
    assert plan.predictions.peak_device_bytes == rows[1][1]["predicted_peak_device_bytes"]
    assert "plan" not in rows[1][1]


def test_host_fraction_needs_several_ranks_and_a_positive_fraction(
    pvm: ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    for argv in (["--host-fraction", "0.7"], ["--world-size", "2", "--host-fraction", "0"]):
        monkeypatch.setattr(sys, "argv", ["predict_vs_measure", *argv, "--out", str(tmp_path / "r.json")])
        with pytest.raises(SystemExit) as exc:
            pvm.main()
        assert exc.value.code == 2
        assert "--host-fraction: needs --world-size > 1 and a positive fraction" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_host_limits_are_the_fraction_of_what_the_ranks_replicated_chunks_would_hold(pvm: ModuleType) -> None:
    """`--host-fraction F`: per device fraction, F x world x the single-process plan's predicted host bytes
    (None without F, for a device limit no plan fits, and for a plan that holds nothing on the host)."""
    import agent
    from agent.planning import solve_embedded
    from agent.testing.model_zoo import sample_batch
    from client.contract import Constraints

    model, cfg = pvm.build_model("llama", 4, 128, 128)  # the benchmark's 4-layer llama, library defaults
    trace = agent.profile(model, sample_batch(cfg, 2, 128), allocation_trace=False)
    peak = trace.measurements.peak_device_bytes
    limits = pvm.host_limits(trace, peak, [0.0001, 0.45, 3.0], 2, 0.75)
    assert limits[0.0001] is None  # nothing fits a device of a few bytes
    assert limits[3.0] is None  # everything fits on the device: nothing on the host to shard
    plan = solve_embedded(trace, Constraints(device_memory_bytes=int(peak * 0.45)))
    assert plan.predictions is not None
    assert limits[0.45] == int(0.75 * 2 * plan.predictions.peak_host_bytes) > 0
    assert pvm.host_limits(trace, peak, [0.45], 2, None) == {0.45: None}
