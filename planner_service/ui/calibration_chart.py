"""The calibration plot: predicted against measured iteration time and peak device memory, per hardware, over
all of a project's feedback (a plan's predictions against what its run measured). Two log-log scatter panels
with the y = x diagonal; escaped inline SVG like chart.py."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import median

from markupsafe import Markup, escape

from client.units import format_bytes
from planner_service.ui.sweep_chart import COLOURS


@dataclass(frozen=True)
class FeedbackPoint:
    hardware: str
    predicted_s: float
    measured_s: float
    predicted_peak: int
    measured_peak: int


@dataclass(frozen=True)
class HardwareError:
    hardware: str
    count: int
    iteration_error: float  # median |measured - predicted| / measured
    peak_error: float


def errors(points: Sequence[FeedbackPoint]) -> list[HardwareError]:
    by: dict[str, list[FeedbackPoint]] = defaultdict(list)
    for p in points:
        by[p.hardware].append(p)
    return [
        HardwareError(
            h,
            len(ps),
            median(abs(p.measured_s - p.predicted_s) / p.measured_s for p in ps),
            median(abs(p.measured_peak - p.predicted_peak) / max(p.measured_peak, 1) for p in ps),
        )
        for h, ps in sorted(by.items())
    ]


def _panel(
    points: Sequence[FeedbackPoint], colour_of: dict[str, str], which: str, title: str, x0: int, size: int
) -> str:
    pad = 72
    pairs = [
        (p.predicted_s, p.measured_s)
        if which == "time"
        else (float(p.predicted_peak), float(p.measured_peak))
        for p in points
    ]
    vals = [v for pair in pairs for v in pair if v > 0]
    lo = math.floor(math.log10(min(vals))) if vals else 0
    hi = math.ceil(math.log10(max(vals))) if vals else 1
    hi = max(hi, lo + 1)
    inner = size - pad - 40  # room for the last x tick label

    def pos(v: float) -> float:
        return (math.log10(max(v, 10.0**lo)) - lo) / (hi - lo) * inner

    fmt = (lambda v: f"{v:.3g} s") if which == "time" else (lambda v: format_bytes(int(v)))
    ox, oy = x0 + pad, 20 + inner
    parts = [
        f'<text x="{ox}" y="14">{escape(title)}</text>',
        f'<rect x="{ox}" y="20" width="{inner}" height="{inner}" fill="none" stroke="#555"/>',
        f'<line class="diagonal" x1="{ox}" y1="{oy}" x2="{ox + inner}" y2="20" stroke="#aaa" '
        f'stroke-dasharray="4 3"/>',
        f'<text x="{ox + inner / 2:.0f}" y="{oy + 30}" text-anchor="middle" font-size="11">predicted</text>',
        f'<text x="{x0 + 12}" y="{20 + inner / 2:.0f}" font-size="11" transform="rotate(-90 {x0 + 12} '
        f'{20 + inner / 2:.0f})" text-anchor="middle">measured</text>',
    ]
    for k in range(lo, hi + 1):
        t = pos(10.0**k)
        parts.append(
            f'<text x="{ox + t:.1f}" y="{oy + 14}" text-anchor="middle" font-size="9">'
            f"{escape(fmt(10.0**k))}</text>"
        )
        parts.append(
            f'<text x="{ox - 4}" y="{oy - t + 3:.1f}" text-anchor="end" font-size="9">'
            f"{escape(fmt(10.0**k))}</text>"
        )
    for p, (pred, meas) in zip(points, pairs, strict=True):
        parts.append(
            f'<circle class="feedback-point" data-hardware="{escape(p.hardware)}" cx="{ox + pos(pred):.1f}" '
            f'cy="{oy - pos(meas):.1f}" r="3.5" fill="{colour_of[p.hardware]}"><title>'
            f"{escape(p.hardware)}: predicted {escape(fmt(pred))}, measured {escape(fmt(meas))}"
            f"</title></circle>"
        )
    return "".join(parts)


def render_calibration_svg(points: Sequence[FeedbackPoint], *, size: int = 420) -> Markup:
    hardware = sorted({p.hardware for p in points})
    colour_of = {h: COLOURS[i % len(COLOURS)] for i, h in enumerate(hardware)}
    body = _panel(points, colour_of, "time", "iteration time", 0, size) + _panel(
        points, colour_of, "peak", "peak device memory", size + 20, size
    )
    legend = "".join(
        f'<rect x="{60 + 200 * i}" y="{size + 34}" width="10" height="10" fill="{colour_of[h]}"/>'
        f'<text x="{76 + 200 * i}" y="{size + 43}" font-size="11">{escape(h)}</text>'
        for i, h in enumerate(hardware)
    )
    width = 2 * size + 20
    return Markup(
        f'<svg id="calibration-chart" class="calibration-chart" xmlns="http://www.w3.org/2000/svg" '
        f'viewBox="0 0 {width} {size + 56}" width="{width}" height="{size + 56}" role="img" '
        f'aria-label="predicted against measured iteration time and peak memory">{body}{legend}</svg>'
    )
