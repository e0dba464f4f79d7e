"""`memplan whatif`: fits or not, which limit binds, speed, the largest batch, comparisons, retargeting.

The 7B questions use the Llama-2-7B config (`planner_service.whatif.known_configs`, as its config.json
reads); the model is never built in memory: its parameters are fake tensors. Timing is benchmarks/whatif.py's job, not these tests'.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import agent
from client.contract import Hardware, Trace
from planner_service.whatif.answer import answer, largest_batch
from planner_service.whatif.catalog import CatalogError, load_catalog
from planner_service.whatif.known_configs import LLAMA_2_7B
from planner_service.whatif.modelled_trace import ModelledWorkload, iterate, trace_on
from planner_service.whatif.retarget import retarget, source_entry, time_scale

transformers = pytest.importorskip("transformers")

N_PARAMS_7B = 6_738_415_616
GiB = 2**30


def _memplan(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "memplan", *args],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "COLUMNS": "200"},
    )


@pytest.fixture(scope="module")
def llama_7b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("llama-2-7b") / "config.json"
    path.write_text(json.dumps(LLAMA_2_7B))
    return path


@pytest.fixture(scope="module")
def catalog() -> dict:  # type: ignore[type-arg]
    return load_catalog(use_env=False)


def test_7b_on_an_a100_80gb_fits_with_the_json_keys_the_issue_names(llama_7b: Path) -> None:
    out = _memplan(
        "whatif",
        "--config",
        str(llama_7b),
        "--hardware",
        "a100-80gb-sxm",
        "--batch",
        "1",
        "--seq",
        "4096",
        "--dtype",
        "bf16",
        "--json",
    )
    assert out.returncode == 0, out.stderr
    a = json.loads(out.stdout)
    for key in (
        "fits",
        "peak_device_bytes",
        "peak_host_bytes",
        "iteration_s",
        "tokens_per_s",
        "unmanaged_peak_device_bytes",
    ):
        assert key in a
    assert (
        a["fits"] is True and a["binding"] is None and a["source"] == "modelled" and a["calibrated"] is False
    )
    assert a["peak_device_bytes"] <= 80 * GiB
    assert a["tokens_per_s"] == pytest.approx(4096 / a["iteration_s"], rel=1e-9)
    # un-managed: bf16 parameters and gradients (2 + 2 bytes) and AdamW's two bf16 moments (4), plus activations
    states = 8 * N_PARAMS_7B
    assert states < a["unmanaged_peak_device_bytes"] < states + 40 * GiB


@pytest.mark.slow
def test_7b_comparison_table_and_host_memory_that_binds(llama_7b: Path) -> None:
    workload = ["--batch", "1", "--seq", "4096", "--host-memory", "16GiB", "--time-limit", "1"]
    out = _memplan(
        "whatif", "--config", str(llama_7b), "--hardware", "rtx-3090,h100-sxm", *workload, "--json"
    )
    assert out.returncode == 0, out.stderr
    rtx, h100 = json.loads(out.stdout)
    assert (rtx["hardware"], h100["hardware"]) == ("rtx-3090", "h100-sxm")
    # 54 GB of model states cannot live in 24 GiB of device + 16 GiB of host; with more host they can
    assert rtx["fits"] is False and rtx["binding"] == "host"
    assert 16 * GiB < rtx["min_host_memory_bytes"] < 80 * GiB
    assert h100["fits"] is True  # 80 GiB device + 16 GiB host hold the states with room for activations
    # the same question with --hardware given twice, answered as a table
    table = _memplan(
        "whatif", "--config", str(llama_7b), "--hardware", "rtx-3090", "--hardware", "h100-sxm", *workload
    )
    assert table.returncode == 0, table.stderr
    assert "rtx-3090" in table.stdout and "h100-sxm" in table.stdout and "host >=" in table.stdout


def test_larger_batch_binds_device_memory_with_the_minimum_that_fits(catalog: dict) -> None:  # type: ignore[type-arg]
    cfg = transformers.AutoConfig.for_model(
        "llama",
        num_hidden_layers=4,
        hidden_size=1024,
        num_attention_heads=8,
        intermediate_size=2816,
        vocab_size=32000,
    )
    l4 = catalog["l4"]

    def at(b: int):  # type: ignore[no-untyped-def]
        return answer(trace_on(iterate(cfg, ModelledWorkload(b, 4096, "bf16")), l4), l4, time_limit_s=1.0)

    search = largest_batch(at)
    assert search.largest is not None and search.largest.fits
    best = search.largest.batch
    misses = [a for a in search.tried if not a.fits]
    assert misses and min(a.batch for a in misses) == best + 1  # bisected to the edge
    edge = next(a for a in misses if a.batch == best + 1)
    assert edge.binding == "device" and edge.min_device_memory_bytes > l4.device_memory_bytes
    assert all(a.tokens_per_s and a.tokens_per_s > 0 for a in search.tried if a.fits)


@pytest.mark.slow
def test_batch_max_from_family_flags_prints_every_batch_tried() -> None:
    out = _memplan(
        "whatif",
        "--family",
        "gpt2",
        "--layers",
        "2",
        "--hidden",
        "1024",
        "--vocab",
        "8000",
        "--hardware",
        "l4",
        "--batch",
        "max",
        "--seq",
        "4096",
        "--time-limit",
        "0.5",
        "--json",
    )
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    assert r["largest_batch"] == r["largest"]["batch"] and r["largest"]["fits"]
    assert any(not t["fits"] for t in r["tried"]) and all(t["tokens_per_s"] for t in r["tried"] if t["fits"])


@pytest.mark.parametrize(
    "args,message",
    [
        (["--hardware", "h1000", "--batch", "1", "--seq", "8"], "not in the catalogue"),
        (["--hardware", "l4", "--batch", "0", "--seq", "8"], "--batch: must be at least 1"),
        (["--hardware", "l4", "--batch", "lots", "--seq", "8"], "not a number or 'max'"),
        (["--hardware", "l4", "--batch", "1"], "--seq: required"),
        (["--hardware", "l4", "--batch", "1", "--seq", "8", "--host-memory", "much"], "--host-memory"),
        (["--hardware", "l4", "--batch", "1", "--seq", "8", "--dtype", "fp8"], "--dtype: 'fp8'"),
        (["--hardware", "l4", "--batch", "1", "--seq", "0"], "--seq: must be at least 1"),
    ],
)
def test_bad_questions_exit_2_naming_the_option(llama_7b: Path, args: list[str], message: str) -> None:
    out = _memplan("whatif", "--config", str(llama_7b), *args)
    assert out.returncode == 2 and message in out.stderr, out.stderr


def test_unreadable_or_typeless_config_is_refused(tmp_path: Path) -> None:
    missing = _memplan(
        "whatif", "--config", str(tmp_path / "nope.json"), "--hardware", "l4", "--batch", "1", "--seq", "8"
    )
    assert missing.returncode == 2 and "cannot read" in missing.stderr
    typeless = tmp_path / "config.json"
    typeless.write_text('{"hidden_size": 64}')
    out = _memplan("whatif", "--config", str(tmp_path), "--hardware", "l4", "--batch", "1", "--seq", "8")
    assert out.returncode == 2 and "model_type" in out.stderr


# ---------------------------------------------------------------------------------------------- retarget
@pytest.fixture(scope="module")
def measured(cpu_hardware: Hardware) -> Trace:
    """A real measured trace (a small GPT-2 on this CPU), relabelled as taken on an A100 80GB SXM."""
    cfg = transformers.AutoConfig.for_model(
        "gpt2", n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=64
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    model.train()
    ids = torch.randint(0, 256, (2, 32))
    trace = agent.profile(
        model, {"input_ids": ids, "labels": ids}, allocation_trace=False, repeats=1, hardware=cpu_hardware
    )
    return trace


def test_retarget_keeps_memory_and_scales_times_by_the_two_entries(measured: Trace, catalog: dict) -> None:  # type: ignore[type-arg]
    a100, h100 = catalog["a100-80gb-sxm"], catalog["h100-sxm"]
    moved = retarget(measured, a100, h100)
    scale = time_scale(a100, h100, measured.workload.precision.value)
    assert 0 < scale < 1  # an H100 is faster than an A100 in FLOPs and bandwidth
    assert moved.source == "modelled" and moved.modelled.hardware_key == "h100-sxm"
    assert moved.modelled.factors["time_scale"] == pytest.approx(scale)
    assert (
        moved.hardware.device_name == h100.name
        and moved.hardware.device_memory_bytes == h100.device_memory_bytes
    )
    assert moved.model == measured.model and moved.workload == measured.workload
    for old, new in zip(measured.measurements.blocks, moved.measurements.blocks, strict=True):
        for f in (
            "activation_bytes",
            "input_bytes",
            "forward_transient_peak_bytes",
            "backward_transient_peak_bytes",
        ):
            assert getattr(new, f) == getattr(old, f)
        assert new.forward_s == pytest.approx(old.forward_s * scale)
        assert new.backward_s == pytest.approx(old.backward_s * scale)
    assert moved.measurements.peak_device_bytes == measured.measurements.peak_device_bytes
    Trace.model_validate_json(moved.model_dump_json())  # a valid wire trace


def test_retarget_from_the_command_line(measured: Trace, tmp_path: Path) -> None:
    path = tmp_path / "trace.json"
    path.write_text(measured.model_dump_json())
    out = _memplan(
        "whatif", "--trace", str(path), "--from", "a100-80gb-sxm", "--hardware", "h100-sxm", "--json"
    )
    assert out.returncode == 0, out.stderr
    a = json.loads(out.stdout)
    assert a["fits"] is True and a["hardware"] == "h100-sxm" and a["batch"] == 2 and a["seq"] == 32
    # a CPU trace names no catalogue entry: the user must say which GPU it stands for
    out = _memplan("whatif", "--trace", str(path), "--hardware", "h100-sxm")
    assert out.returncode == 2 and "--from" in out.stderr
    with pytest.raises(CatalogError, match="CPU trace"):
        source_entry(measured, load_catalog(use_env=False))


@pytest.mark.parametrize(
    "content,message",
    [
        ("not json", "is not JSON"),
        ('{"foo": 1}', "a JSON object with fields foo, not a Trace"),
        ('{"trace_hash": "x", "solver": {}, "constraints": {}}', "is a Plan (made by"),
        ('{"hardware": {}, "model": {}, "workload": {}, "measurements": {}}', "invalid fields:\n  hardware."),
    ],
    ids=["not-json", "other-json", "a-plan", "broken-trace"],
)
@pytest.mark.parametrize("option", ["--trace", "--calibrate-with"])
def test_a_file_that_is_no_trace_is_named_for_what_it_is(
    tmp_path: Path, llama_7b: Path, option: str, content: str, message: str
) -> None:
    """Defect: `--trace`/`--calibrate-with` answered only "not a valid Trace: 1 validation error for Trace"
    (the first line of pydantic's report): not which field, nor that the file was not JSON or was a plan,
    as `memplan plans solve` and `traces upload` say for the same file."""
    bad = tmp_path / "file.json"
    bad.write_text(content)
    workload = (
        ["--config", str(llama_7b), "--batch", "1", "--seq", "8"] if option == "--calibrate-with" else []
    )
    out = _memplan("whatif", *workload, option, str(bad), "--hardware", "a100-80gb-sxm")
    assert out.returncode == 2, out.stderr
    assert f"{option}: {bad}" in out.stderr and message in out.stderr, out.stderr
