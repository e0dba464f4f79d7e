"""A calibration: the roofline's efficiency factors for one catalogue entry and precision, and where they
come from (`calibrate.py` fits them). Its own module so that `modelled_trace.py`, which applies a calibration,
and `calibrate.py`, which fits one to modelled iterations, do not import each other."""

from __future__ import annotations

from dataclasses import dataclass

from client.contract import CatalogEntry
from planner_service.whatif import roofline


@dataclass(frozen=True)
class Calibration:
    """The efficiency factors for one catalogue entry and precision, and where they come from."""

    hardware_key: str
    precision: str
    efficiency: roofline.Efficiency
    traces: int  # measured traces fitted (0: uncalibrated, the estimates)
    blocks: int  # (block, phase) rows fitted
    residual: float | None  # relative RMS error of block times with `efficiency` (None: uncalibrated)
    estimate_residual: float | None  # the same with the estimates (roofline.DEFAULT_EFFICIENCY)
    fitted: bool = False  # the fitted factors were kept (they lowered the residual)
    feedback_count: int = 0
    feedback_iteration_error: float | None = None  # median |measured - predicted| / measured of the feedback
    models: tuple[str, ...] = ()  # the models of the measured traces fitted (any model: the factors are the
    # hardware's, per precision; calibrate.sample_of prices another model's trace from its recorded config)

    @property
    def calibrated(self) -> bool:
        return self.traces > 0

    def describe(self) -> str:
        if not self.calibrated:
            return "uncalibrated"
        what = "fitted" if self.fitted else "estimates kept (the fit did not lower the error)"
        of = f" of {', '.join(self.models)}" if self.models else ""
        return (
            f"calibrated on {self.traces} measured trace{'s' if self.traces != 1 else ''}{of} "
            f"({what}; block-time error {100 * (self.residual or 0.0):.0f}% RMS)"
        )

    def factors(self) -> dict[str, float]:
        """The factors and the calibration's figures, for `Trace.modelled.factors`."""
        out = self.efficiency.as_factors()
        if self.calibrated:
            out["calibration_traces"] = float(self.traces)
            out["calibration_blocks"] = float(self.blocks)
            out["calibration_residual"] = float(self.residual or 0.0)
        return out


def uncalibrated(entry: CatalogEntry, precision: str) -> Calibration:
    return Calibration(
        hardware_key=entry.key,
        precision=precision,
        efficiency=roofline.DEFAULT_EFFICIENCY,
        traces=0,
        blocks=0,
        residual=None,
        estimate_residual=None,
    )
