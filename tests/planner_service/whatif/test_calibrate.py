"""Calibration of the roofline's efficiency factors on real measured traces (`agent.profile` on this CPU).

This machine's CPU is the "catalogue entry" (its device name as the profiler reports it; nominal throughput
figures: the fit absorbs how far they are from the truth). The modelled side of each sample is the fake
iteration of the same Hugging Face config under the same workload with this CPU's attention kernels.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from client.contract import Feedback, Hardware, HardwareCatalog, Trace
from planner_service.whatif.answer import answer
from planner_service.whatif.calibrate import (
    CalibrationError,
    CalibrationSample,
    calibrate,
    same_model,
    uncalibrated,
)
from planner_service.whatif.catalog import shipped
from planner_service.whatif.modelled_trace import ModelledWorkload, iterate, trace_on
from tests.planner_service.whatif.conftest import cpu_entry as _cpu_entry
from tests.planner_service.whatif.conftest import small_llama_config as _config

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def measured(measured_small_llama: list[Trace]) -> list[Trace]:
    return measured_small_llama


@pytest.fixture(scope="module")
def samples(measured: list[Trace]) -> list[CalibrationSample]:
    return [
        CalibrationSample(
            m,
            iterate(
                _config(),
                ModelledWorkload(m.workload.batch_size, m.workload.sequence_length, "fp32"),
                gpu_attention=False,
            ),
        )
        for m in measured
    ]


def test_fit_on_measured_traces_says_from_how_many_and_the_residual(
    samples: list[CalibrationSample], cpu_hardware: Hardware
) -> None:
    entry = _cpu_entry(cpu_hardware)
    assert all(same_model(s.measured, s.modelled) for s in samples)
    cal = calibrate(samples, entry, "fp32")
    assert cal.calibrated and cal.traces == 2
    n_blocks = len(samples[0].measured.model.blocks)
    assert cal.blocks == 2 * 2 * n_blocks  # every block, forward and backward, of both traces
    assert cal.residual is not None and cal.estimate_residual is not None and math.isfinite(cal.residual)
    assert cal.residual <= cal.estimate_residual  # the estimates are kept unless the fit is better
    eff = cal.efficiency
    assert eff.matmul > 0 and eff.memory > 0 and eff.dispatch_s >= 0
    # the host optimizer rate comes from the traces' measured fused-optimizer rate
    rates = sorted(
        s.measured.measurements.optimizer.host_bytes_per_s / cpu_hardware.cpu_cores for s in samples
    )
    assert eff.host_adam_bytes_per_s_per_core == pytest.approx(sum(rates) / 2)
    assert "calibrated on 2 measured traces" in cal.describe()

    # a modelled plan on this entry says it is calibrated, from how many traces and with which residual
    it = samples[1].modelled
    trace = trace_on(it, entry, calibration=cal)
    assert trace.modelled is not None and trace.modelled.calibrated
    assert trace.modelled.factors["calibration_traces"] == 2.0
    a = answer(trace, entry, time_limit_s=1.0).to_json()
    assert a["calibrated"] is True and a["calibration_traces"] == 2
    assert a["calibration_residual"] == pytest.approx(cal.residual)


def test_no_samples_of_the_precision_is_uncalibrated(
    samples: list[CalibrationSample], cpu_hardware: Hardware
) -> None:
    entry = _cpu_entry(cpu_hardware)
    cal = calibrate(samples, entry, "bf16")  # both traces are fp32
    assert not cal.calibrated and cal.residual is None and cal.describe() == "uncalibrated"
    trace = trace_on(samples[0].modelled, entry)
    assert trace.modelled is not None and not trace.modelled.calibrated
    a = answer(trace, entry, time_limit_s=1.0).to_json()
    assert a["calibrated"] is False and a["calibration_traces"] == 0 and a["calibration_residual"] is None
    assert uncalibrated(entry, "fp32").traces == 0


def test_feedback_is_reported_not_fitted(samples: list[CalibrationSample], cpu_hardware: Hardware) -> None:
    entry = _cpu_entry(cpu_hardware)
    fb = [
        (0.5, Feedback(iteration_s=1.0, peak_device_bytes=1, peak_host_bytes=1, steps_measured=5)),
        (1.0, Feedback(iteration_s=1.0, peak_device_bytes=1, peak_host_bytes=1, steps_measured=5)),
        (1.2, Feedback(iteration_s=1.0, peak_device_bytes=1, peak_host_bytes=1, steps_measured=5)),
    ]
    with_fb = calibrate(samples, entry, "fp32", feedback=fb)
    without = calibrate(samples, entry, "fp32")
    assert with_fb.feedback_count == 3 and with_fb.feedback_iteration_error == pytest.approx(0.2)
    assert with_fb.efficiency == without.efficiency


def test_mismatched_samples_are_refused_naming_the_sample(
    samples: list[CalibrationSample], cpu_hardware: Hardware
) -> None:
    entry = _cpu_entry(cpu_hardware)
    h100 = next(e for e in shipped().entries if e.key == "h100-sxm")
    with pytest.raises(CalibrationError, match=r"samples\[0\]\.measured\.hardware\.device_name"):
        calibrate(samples, h100, "fp32")
    swapped = [samples[0], CalibrationSample(samples[1].measured, samples[0].modelled)]
    with pytest.raises(CalibrationError, match=r"samples\[1\]\.modelled\.workload: batch 2 x seq 32"):
        calibrate(swapped, entry, "fp32")
    other = iterate(
        transformers.AutoConfig.for_model(
            "gpt2", n_layer=3, n_embd=64, n_head=4, vocab_size=256, n_positions=64
        ),
        ModelledWorkload(2, 32, "fp32"),
        gpu_attention=False,
    )
    with pytest.raises(CalibrationError, match=r"samples\[0\]\.modelled: .* is not the measured model"):
        calibrate([CalibrationSample(samples[0].measured, other)], entry, "fp32")
    modelled = trace_on(samples[0].modelled, entry)
    with pytest.raises(CalibrationError, match=r"samples\[0\]\.measured: a modelled trace"):
        calibrate([CalibrationSample(modelled, samples[0].modelled)], entry, "fp32")
    with pytest.raises(ValueError, match="calibration: fitted for this-cpu in fp32, not h100-sxm"):
        trace_on(samples[0].modelled, h100, calibration=calibrate(samples, entry, "fp32"))


def test_memplan_whatif_calibrate_with_measured_traces(
    measured: list[Trace], cpu_hardware: Hardware, tmp_path: Path
) -> None:
    """The user's path: `memplan whatif --config ... --calibrate-with trace.json` (the command as typed)."""
    cfg_dir = tmp_path / "model"
    _config().save_pretrained(cfg_dir)  # type: ignore[attr-defined]
    cat = tmp_path / "cpu.json"
    cat.write_text(HardwareCatalog(entries=[_cpu_entry(cpu_hardware)]).model_dump_json())
    files = []
    for i, m in enumerate(measured):
        files += ["--calibrate-with", str(tmp_path / f"t{i}.json")]
        (tmp_path / f"t{i}.json").write_text(m.model_dump_json())
    args = [
        "whatif",
        "--config",
        str(cfg_dir),
        "--hardware",
        "this-cpu,h100-sxm",
        "--catalog",
        str(cat),
        "--batch",
        "2",
        "--seq",
        "32",
        "--dtype",
        "fp32",
        "--time-limit",
        "1",
    ]
    out = subprocess.run(
        [sys.executable, "-m", "memplan", *args, *files, "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    cpu, h100 = json.loads(out.stdout)
    assert cpu["hardware"] == "this-cpu" and cpu["calibrated"] is True and cpu["calibration_traces"] == 2
    assert cpu["calibration_residual"] is not None
    assert h100["calibrated"] is False and h100["calibration_traces"] == 0  # no trace from an H100
    table = subprocess.run(
        [sys.executable, "-m", "memplan", *args, *files], capture_output=True, text=True, timeout=300
    )
    assert table.returncode == 0, table.stderr
    assert (
        "this-cpu calibrated on 2 measured traces" in table.stdout and "h100-sxm uncalibrated" in table.stdout
    )
    other = tmp_path / "gpt2"
    transformers.AutoConfig.for_model(
        "gpt2", n_layer=3, n_embd=64, n_head=4, vocab_size=256, n_positions=64, bos_token_id=0, eos_token_id=0
    ).save_pretrained(other)
    # another model's what-if: the Llama traces record their config, so they calibrate this CPU for a GPT-2
    # (the factors are the device's)
    crossed = subprocess.run(
        [sys.executable, "-m", "memplan", *args[:2], str(other), *args[3:], *files],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert crossed.returncode == 0, crossed.stderr
    assert f"this-cpu calibrated on 2 measured traces of {measured[0].model.name}" in " ".join(
        crossed.stdout.split()
    )
    # traces that record no config (taken before the field) only calibrate their own model
    bare_files = []
    for i, m in enumerate(measured):
        bare = m.model_copy(update={"model": m.model.model_copy(update={"config": None})})
        (tmp_path / f"bare{i}.json").write_text(bare.model_dump_json())
        bare_files += ["--calibrate-with", str(tmp_path / f"bare{i}.json")]
    bad = subprocess.run(
        [sys.executable, "-m", "memplan", *args[:2], str(other), *args[3:], *bare_files],
        capture_output=True,
        text=True,
        timeout=300,
    )
    said = " ".join(bad.stderr.split())  # rich wraps the message at the terminal width
    assert bad.returncode == 2 and "--calibrate-with: measured[0]: LlamaForCausalLM" in said
    assert "records no config and is not the model of the config" in said
