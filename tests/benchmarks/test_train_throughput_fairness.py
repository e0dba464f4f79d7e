"""benchmarks/train_throughput.py: an indexed CUDA device, ratios only between strategies that fit, each
strategy in its own process (issue 19 defects 1 and 7; the CUDA parts cannot run here)."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture()
def tt(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    return importlib.import_module("train_throughput")


def test_an_unindexed_cuda_device_becomes_cuda_0(tt: ModuleType) -> None:
    """Defect 1: torch.device("cuda") compares unequal to cuda:0 (swap silently off) and set_device refuses it."""
    assert torch.device("cuda") != torch.device("cuda", 0)
    assert tt.resolve_device("cuda") == torch.device("cuda", 0)
    assert tt.resolve_device("cuda:1") == torch.device("cuda", 1)
    assert tt.resolve_device("cpu") == torch.device("cpu")


def test_a_ratio_is_printed_only_when_both_strategies_fit(tt: ModuleType) -> None:
    rows = {
        "cpsat": {"tokens_per_s": 300.0, "iteration_s": 1.0, "fits": True},
        "protrain": {"tokens_per_s": 200.0, "iteration_s": 1.0, "fits": True},
        "fsdp2_offload": {"tokens_per_s": 100.0, "iteration_s": 1.0, "fits": False},
        "fsdp2_offload_ckpt": {"skipped": "out of memory under the limit"},
    }
    lines = tt.ratio_lines(rows)
    assert lines[0] == "cpsat / protrain: 1.50x"
    assert lines[1] == "cpsat / fsdp2_offload: no ratio (fsdp2_offload did not fit)"
    assert lines[2] == "cpsat / fsdp2_offload_ckpt: no ratio (fsdp2_offload_ckpt did not run)"


def test_a_strategy_runs_in_a_fresh_process_with_the_model_built_on_the_cpu(tt: ModuleType) -> None:
    spec = {
        "kind": "llama",
        "layers": 1,
        "hidden": 32,
        "seq": 16,
        "batch": 1,
        "steps": 1,
        "device": "cpu",
        "dtype": "fp32",
        "threads": 1,
        "strategy": "plain",
        "limit_bytes": None,
    }
    row = tt.in_fresh_process(spec)
    assert row["iteration_s"] > 0 and row["peak_device_bytes"] > 0
    bad = tt.in_fresh_process({**spec, "strategy": "cpsat", "plan_file": "/nonexistent/plan.json"})
    assert "the cpsat process failed" in bad["skipped"] and "No such file" in bad["skipped"]


def test_predict_vs_measure_uses_an_indexed_device_and_counts_no_foreign_bytes_on_cpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    pvm = importlib.import_module("predict_vs_measure")
    assert pvm.resolve_device("cuda") == torch.device("cuda", 0)
    assert pvm.foreign_device_bytes(torch.device("cpu"), {"input_ids": torch.zeros(4, dtype=torch.long)}) == 0
    assert "no row had a feasible plan" in pvm.summary_line(pvm.summarize([]))


def test_gpu_check_lists_its_steps_and_writes_a_report_of_what_ran(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """scripts/gpu_check.py needs a GPU for a real run; its dry run and its report are checked here."""
    import subprocess

    root = BENCHMARKS.parent
    done = subprocess.run(
        ["bash", "scripts/gpu_check.sh", "--dry-run", "--device", "cuda:1"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    names = [line.split(":")[0] for line in done.stdout.splitlines()]
    assert names == [
        "nvidia-smi",
        "torch",
        "check_cuda_build",
        "cuda_tests",
        "predict_vs_measure",
        "gpu_timeline",
        "train_throughput",
        "train_throughput_bf16_states",
        "copy_bandwidth",
    ]
    assert "benchmarks/train_throughput.py --device cuda:1" in done.stdout and "--dtype bf16" in done.stdout

    spec = importlib.util.spec_from_file_location("gpu_check", root / "scripts" / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    gc = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_check", gc)  # dataclasses look their module up there
    spec.loader.exec_module(gc)
    outcomes = [
        gc.run_step(gc.Step("ok", [sys.executable, "-c", "print('fine')"]), tmp_path),
        gc.run_step(gc.Step("fails", [sys.executable, "-c", "raise SystemExit(3)"]), tmp_path),
        gc.run_step(gc.Step("absent", ["/nonexistent/nvidia-smi"]), tmp_path),
    ]
    js, md = gc.write_report(outcomes, tmp_path, {"device": "cuda:1"})
    import json

    steps = json.loads(js.read_text())["steps"]
    assert [(s["name"], s["returncode"]) for s in steps] == [("ok", 0), ("fails", 3), ("absent", None)]
    assert "fine" in steps[0]["output_tail"] and "| fails | 3 |" in md.read_text()


def test_memplan_rows_plan_and_run_the_same_optimizer_arithmetic(tt: ModuleType) -> None:
    """Session 17 (one H200): memplan's rows were solved for the plain profiled workload while the runtime ran an
    fp32 master with undo backups, and FSDP2's rows step bf16 moments. The plan is now solved for the options the
    rows run (`job_trace`), and `--bf16-states` gives memplan FSDP2's arithmetic."""
    from agent.runtime.options import job_workload
    from planner_service.solver.testing.synthetic import synthetic_trace

    default, same = tt.memplan_options(None, False), tt.memplan_options(None, True)
    assert default.fp32_master and default.undo_host_steps
    assert not same.fp32_master and not same.undo_host_steps
    workload = synthetic_trace(n_blocks=2).workload  # bf16
    assert job_workload(workload, default).master_bytes_per_param == 4
    assert job_workload(workload, default).undo_backup_bytes_per_param > 0
    assert job_workload(workload, same).master_bytes_per_param == 0
    assert job_workload(workload, same).undo_backup_bytes_per_param == 0
