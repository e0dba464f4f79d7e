"""Calibration: fit the roofline's efficiency factors to measured traces of one catalogue entry, per precision.

A modelled block time is (roofline.py) the larger of the sum over its ops of max(FLOPs / (peak * matmul),
bytes / (bandwidth * memory)) and its op count * dispatch_s. A measured trace of the same model under the same
workload, taken on the entry's device, gives the true forward and backward seconds of every profiled block.
`calibrate` fits the factors to those seconds by non-negative least squares over blocks, per precision, on
the linear form

    t(block, phase) ~ C / matmul + M / memory + n * dispatch_s

where C is the FLOPs over dense peak of the ops that are compute-bound (at the current factors), M the bytes
over bandwidth of the others and n the op count. Rows are weighted by 1 / t, so the fit minimises the relative
error (a block of 10 us counts as much as one of 10 ms). The op split depends on the factors, so the fit is
repeated with the split of the last fit (three rounds at most). The host optimizer rate per core is the median
of the traces' measured fused-optimizer rates over their cores.

The residual is the relative RMS error of the block times the roofline predicts with the fitted factors (the
real `max` form, not the linear one) against the measured ones. Beside the least-squares factors, a uniform
scale of the estimates (and of the fit) is tried: s minimising the same residual when every block time is
multiplied by s (`_scaled`), which a noisy or loaded machine still identifies when the three factors are not.
The candidate with the lowest residual is kept only where it lowers the residual below the estimates' (the
linear form can miss on a machine where one op dominates); a calibration always says from how many traces
and blocks it comes, of which models, and both residuals.

The traces may be of any model (`sample_of`): the factors are the device's, per precision, and each trace is
priced from the FLOPs and bytes of its own model's operations (its recorded Hugging Face config).

Feedback (a plan's measured iteration seconds against its prediction) does not enter the fit: the plan's
iteration includes the runtime's copies and waits, not the efficiency of the kernels. `calibrate` reports the
median relative error of the feedback it is given next to the fit, for the same hardware.

A sample pairs a measured trace with the fake iteration of the same model under the same workload
(`modelled_trace.iterate(config, ModelledWorkload(batch, seq, dtype), gpu_attention=False)` for a CPU trace,
whose attention kernels are this CPU's); `same_model` says whether a measured trace and an iteration describe
one model (the profiler's and the what-if fingerprints are computed differently: this compares the
architecture and the parameter names and shapes).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
from scipy.optimize import nnls  # type: ignore[import-untyped]

from client.contract import CatalogEntry, DeviceType, Feedback, Phase, Trace
from planner_service.whatif import roofline
from planner_service.whatif.architecture import ArchitectureError, config_from_dict
from planner_service.whatif.calibration import Calibration, uncalibrated
from planner_service.whatif.fake_iteration import OpCosts
from planner_service.whatif.modelled_trace import ModelIteration, ModelledWorkload, iterate

__all__ = [
    "Calibration",
    "CalibrationError",
    "CalibrationSample",
    "calibrate",
    "same_model",
    "sample_of",
    "samples_from_config",
    "uncalibrated",
]

_ROUNDS = 3


class CalibrationError(ValueError):
    """A sample does not describe the entry, the precision or the model it is paired with."""


@dataclass(frozen=True)
class CalibrationSample:
    """A measured trace and the fake iteration of the same model under the same workload."""

    measured: Trace
    modelled: ModelIteration


def same_model(measured: Trace, it: ModelIteration) -> bool:
    """Whether a measured trace and a fake iteration are one model (architecture, parameter names and shapes)."""
    if measured.model.architecture != it.architecture:
        return False
    want = sorted((p.name, tuple(p.shape)) for p in measured.model.parameters)
    got = sorted((p.name, tuple(p.shape)) for p in it.record.parameters)
    return want == got


def _check(i: int, s: CalibrationSample, entry: CatalogEntry) -> None:
    m, w = s.measured, s.modelled.workload
    where = f"samples[{i}]"
    if m.modelled is not None:
        raise CalibrationError(f"{where}.measured: a modelled trace; calibration needs measured ones")
    if m.hardware.device_name != entry.name:
        raise CalibrationError(
            f"{where}.measured.hardware.device_name: {m.hardware.device_name!r} is not "
            f"{entry.key}'s device {entry.name!r}"
        )
    if m.workload.precision.value != w.dtype:
        raise CalibrationError(
            f"{where}.modelled.workload.dtype: {w.dtype} but the trace was measured in "
            f"{m.workload.precision.value}"
        )
    if (m.workload.batch_size, m.workload.sequence_length) != (w.batch_size, w.sequence_length):
        raise CalibrationError(
            f"{where}.modelled.workload: batch {w.batch_size} x seq {w.sequence_length} but the "
            f"trace was measured at {m.workload.batch_size} x {m.workload.sequence_length}"
        )
    if not same_model(m, s.modelled):
        raise CalibrationError(
            f"{where}.modelled: {s.modelled.name} is not the measured model {m.model.name} "
            "(architecture or parameters differ)"
        )
    if len(m.model.blocks) != s.modelled.record.n_blocks:
        raise CalibrationError(
            f"{where}.modelled: {s.modelled.record.n_blocks} blocks, the trace has {len(m.model.blocks)}"
        )


@dataclass(frozen=True)
class _Row:
    costs: OpCosts
    measured_s: float


def _rows(samples: Sequence[CalibrationSample]) -> list[_Row]:
    rows: list[_Row] = []
    for s in samples:
        m = s.measured.measurements
        profiled = set(m.profiled_blocks) if m.extrapolated and m.profiled_blocks else None
        rec = s.modelled.record
        for b, bm in enumerate(m.blocks):
            if profiled is not None and b not in profiled:
                continue  # an extrapolated block's figures are a copy, not a measurement
            for phase, t in ((Phase.forward, bm.forward_s), (Phase.backward, bm.backward_s)):
                costs = (rec.forward if phase == Phase.forward else rec.backward)[b]
                if t > 0 and costs.flops:
                    rows.append(_Row(costs, float(t)))
    return rows


def _terms(
    costs: OpCosts, entry: CatalogEntry, dtype: str, eff: roofline.Efficiency
) -> tuple[float, float, float]:
    """(C, M, n): compute seconds at full peak of the ops compute-bound under `eff`, memory seconds at full
    bandwidth of the others, and the op count."""
    flops, nbytes, _ = costs.arrays()
    compute = flops / roofline.peak_flops(entry, dtype)
    memory = nbytes / entry.memory_bandwidth_bytes_per_s
    bound = compute / eff.matmul >= memory / eff.memory
    return float(compute[bound].sum()), float(memory[~bound].sum()), float(flops.size)


def _residual(rows: list[_Row], entry: CatalogEntry, dtype: str, eff: roofline.Efficiency) -> float:
    rel = [(roofline.block_seconds(r.costs, entry, dtype, eff) - r.measured_s) / r.measured_s for r in rows]
    return float(math.sqrt(sum(x * x for x in rel) / len(rel)))


def _fit(
    rows: list[_Row], entry: CatalogEntry, dtype: str, start: roofline.Efficiency
) -> roofline.Efficiency:
    eff = start
    for _ in range(_ROUNDS):
        a = np.array([_terms(r.costs, entry, dtype, eff) for r in rows], dtype=np.float64)
        t = np.array([r.measured_s for r in rows], dtype=np.float64)
        a_w = a / t[:, None]
        used = np.flatnonzero(np.abs(a_w).sum(axis=0) > 0)
        scale = np.abs(a_w[:, used]).max(axis=0)  # columns of very different magnitudes: scale for nnls
        x_used, _ = nnls(a_w[:, used] / scale, np.ones_like(t))
        x = np.zeros(3)
        x[used] = x_used / scale
        new = replace(
            eff,
            matmul=float(1.0 / x[0]) if x[0] > 0 else eff.matmul,  # unidentified: keep what we had
            memory=float(1.0 / x[1]) if x[1] > 0 else eff.memory,
            dispatch_s=float(x[2]),
        )
        if new == eff:
            break
        eff = new
    return eff


def _scaled(
    rows: list[_Row], entry: CatalogEntry, dtype: str, eff: roofline.Efficiency
) -> roofline.Efficiency:
    """`eff` with every block time scaled by the one factor s that minimises the relative RMS error of the
    rows: s = sum(p/m) / sum((p/m)^2) for predicted p and measured m (the compute and memory efficiencies
    divided by s, the dispatch time multiplied by it: a block's time, a max of sums of those terms, scales by
    s exactly). Where the noise of a loaded machine leaves the three factors unidentified, one throughput
    scale still is: "this device runs at s times the figures"."""
    ratios = np.array(
        [roofline.block_seconds(r.costs, entry, dtype, eff) / r.measured_s for r in rows], dtype=np.float64
    )
    denominator = float((ratios * ratios).sum())
    if denominator <= 0:
        return eff
    scale = float(ratios.sum()) / denominator
    if not math.isfinite(scale) or scale <= 0:
        return eff
    return replace(
        eff, matmul=eff.matmul / scale, memory=eff.memory / scale, dispatch_s=eff.dispatch_s * scale
    )


def _host_rate_per_core(samples: Sequence[CalibrationSample]) -> float | None:
    rates = [
        s.measured.measurements.optimizer.host_bytes_per_s / s.measured.hardware.cpu_cores
        for s in samples
        if s.measured.measurements.optimizer.host_bytes_per_s > 0
    ]
    return float(np.median(rates)) if rates else None


def _feedback_error(feedback: Sequence[tuple[float, Feedback]]) -> float | None:
    errs = [abs(f.iteration_s - predicted) / f.iteration_s for predicted, f in feedback if f.iteration_s > 0]
    return float(np.median(errs)) if errs else None


def calibrate(
    samples: Sequence[CalibrationSample],
    entry: CatalogEntry,
    precision: str,
    feedback: Sequence[tuple[float, Feedback]] = (),
) -> Calibration:
    """The efficiency factors for `entry` in `precision` fitted to the samples of that precision.

    Samples of other precisions are left out (the fit is per precision); a sample of another device or whose
    iteration is not the measured model and workload is an error naming it. `feedback` is (predicted iteration
    seconds, feedback) of plans on this hardware: reported, not fitted (see the module docstring). With no
    sample of `precision` (or none with a measured block) the result is `uncalibrated`.
    """
    for i, s in enumerate(samples):
        _check(i, s, entry)
    mine = [s for s in samples if s.measured.workload.precision.value == precision]
    rows = _rows(mine)
    fb = {"feedback_count": len(feedback), "feedback_iteration_error": _feedback_error(feedback)}
    if not rows:
        return replace(uncalibrated(entry, precision), **fb)  # type: ignore[arg-type]
    host_rate = _host_rate_per_core(mine)
    start = roofline.DEFAULT_EFFICIENCY
    if host_rate is not None:
        start = replace(start, host_adam_bytes_per_s_per_core=host_rate)
    estimate = _residual(rows, entry, precision, start)
    nnls_fit = _fit(rows, entry, precision, start)
    candidates = [nnls_fit, _scaled(rows, entry, precision, start), _scaled(rows, entry, precision, nnls_fit)]
    fitted, fitted_residual = min(
        ((c, _residual(rows, entry, precision, c)) for c in candidates), key=lambda x: x[1]
    )
    keep = fitted_residual < estimate
    return Calibration(
        hardware_key=entry.key,
        precision=precision,
        efficiency=fitted if keep else start,
        traces=len(mine),
        blocks=len(rows),
        residual=fitted_residual if keep else estimate,
        estimate_residual=estimate,
        fitted=keep,
        models=tuple(sorted({s.measured.model.name for s in mine})),
        **fb,  # type: ignore[arg-type]
    )


def _iteration_for(measured: Trace, config: object, *, exact: bool) -> ModelIteration:
    w = measured.workload
    return iterate(
        config,
        ModelledWorkload(w.batch_size, w.sequence_length, w.precision.value, w.optimizer),
        exact=exact,
        gpu_attention=measured.hardware.device_type != DeviceType.cpu,
    )


def sample_of(
    measured: Trace, config: object | None = None, *, exact: bool = False
) -> CalibrationSample | None:
    """The sample of a measured trace: the trace with the fake iteration of its own model under its own workload
    (this CPU's attention kernels for a CPU trace, CUDA's fused ones otherwise).

    The model is the one the trace records (`ModelInfo.config`, written by the profiler for Hugging Face models),
    so a trace of any model calibrates the entry it was taken on: the factors are the hardware's. A trace that
    records no config (one taken before the field existed, or of a model without a Hugging Face config) is
    priced with `config` when that is its model (`same_model`); None when neither describes it."""
    if measured.model.config is not None:
        try:
            own = config_from_dict(measured.model.config, "model.config")
            it = _iteration_for(measured, own, exact=exact)
        except (ArchitectureError, ValueError):
            it = None  # a recorded config this library cannot build: try the caller's
        if it is not None and same_model(measured, it):
            return CalibrationSample(measured, it)
    if config is not None:
        it = _iteration_for(measured, config, exact=exact)
        if same_model(measured, it):
            return CalibrationSample(measured, it)
    return None


def samples_from_config(
    config: object, measured: Sequence[Trace], entry: CatalogEntry, *, exact: bool = False
) -> list[CalibrationSample]:
    """The samples for `entry` from measured traces (`sample_of`): each trace taken on the entry's device is
    paired with the fake iteration of its recorded model (any model), or of `config` when it records none.
    Traces of other devices are left out; a trace that records no config and is not the model of `config` is an
    error naming it (`measured[i]`)."""
    out: list[CalibrationSample] = []
    for i, m in enumerate(measured):
        if m.hardware.device_name != entry.name:
            continue
        sample = sample_of(m, config, exact=exact)
        if sample is None:
            raise CalibrationError(
                f"measured[{i}]: {m.model.name} ({m.model.architecture}) records no config and is not the "
                "model of the config"
            )
        out.append(sample)
    return out
