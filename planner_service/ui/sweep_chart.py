"""A what-if sweep's plot: tokens/s and peak device memory against batch size, one line per hardware.

Plain Python returning escaped inline SVG (`markupsafe`), like chart.py: two panels side by side, x = batch
size (log2 spacing: sweeps double the batch), one polyline per series (a hardware key, with the sequence
length and host limit when the sweep has several), drawn through the points that fit; points that do not fit
are left out of the lines and listed in the page's table.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence

from markupsafe import Markup, escape

from client.contract import SweepPoint
from client.units import format_bytes

COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2")
MAX_SERIES = len(COLOURS)


def series(points: Sequence[SweepPoint]) -> dict[str, list[SweepPoint]]:
    """The points that fit, grouped into lines by hardware (and seq / host when the sweep varies them)."""
    seqs = {p.sequence_length for p in points}
    hosts: dict[str, set[int]] = defaultdict(set)  # per hardware: the defaults differ between entries
    devices: dict[str, set[int]] = defaultdict(set)
    for p in points:
        hosts[p.hardware].add(p.host_memory_bytes)
        devices[p.hardware].add(p.device_memory_bytes)
    out: dict[str, list[SweepPoint]] = defaultdict(list)
    for p in points:
        if not p.fits or p.tokens_per_s is None or p.peak_device_bytes is None:
            continue
        label = p.hardware
        if len(seqs) > 1:
            label += f" seq {p.sequence_length}"
        if len(hosts[p.hardware]) > 1:
            label += f" host {format_bytes(p.host_memory_bytes)}"
        if len(devices[p.hardware]) > 1:
            label += f" device {format_bytes(p.device_memory_bytes)}"
        out[label].append(p)
    for line in out.values():
        line.sort(key=lambda q: q.batch_size)
    return dict(list(out.items())[:MAX_SERIES])


def _panel(
    lines: dict[str, list[SweepPoint]],
    value: str,
    title: str,
    x0: int,
    width: int,
    height: int,
    batches: list[int],
) -> str:
    pad_l, pad_r, pad_t, pad_b = 70, 10, 24, 36
    vals = [getattr(p, value) for ps in lines.values() for p in ps]
    top = max(vals) * 1.1 if vals else 1.0
    lo, hi = math.log2(min(batches)), math.log2(max(batches))
    span = hi - lo or 1.0

    def x(b: int) -> float:
        return x0 + pad_l + (math.log2(b) - lo) / span * (width - pad_l - pad_r)

    def y(v: float) -> float:
        return pad_t + (1 - v / top) * (height - pad_t - pad_b)

    fmt = (lambda v: format_bytes(int(v))) if value == "peak_device_bytes" else (lambda v: f"{v:,.0f}")
    parts = [
        f'<text class="panel-title" x="{x0 + pad_l}" y="14">{escape(title)}</text>',
        f'<line class="axis" x1="{x0 + pad_l}" y1="{height - pad_b}" x2="{x0 + width - pad_r}" '
        f'y2="{height - pad_b}" stroke="#555"/>',
        f'<line class="axis" x1="{x0 + pad_l}" y1="{pad_t}" x2="{x0 + pad_l}" y2="{height - pad_b}" '
        f'stroke="#555"/>',
    ]
    for i in range(5):
        v = top * i / 4
        parts.append(
            f'<text class="tick" x="{x0 + pad_l - 4}" y="{y(v) + 4:.1f}" text-anchor="end" '
            f'font-size="10">{escape(fmt(v))}</text>'
        )
    for b in batches:
        parts.append(
            f'<text class="tick" x="{x(b):.1f}" y="{height - pad_b + 14}" text-anchor="middle" '
            f'font-size="10">{b}</text>'
        )
    parts.append(
        f'<text x="{x0 + (width + pad_l) / 2:.0f}" y="{height - 4}" text-anchor="middle" '
        f'font-size="11">batch size</text>'
    )
    for colour, (label, ps) in zip(COLOURS, lines.items(), strict=False):
        coords = " ".join(f"{x(p.batch_size):.1f},{y(getattr(p, value)):.1f}" for p in ps)
        parts.append(
            f'<polyline class="series" data-series="{escape(label)}" fill="none" stroke="{colour}" '
            f'stroke-width="2" points="{coords}"/>'
        )
        for p in ps:
            parts.append(
                f'<circle cx="{x(p.batch_size):.1f}" cy="{y(getattr(p, value)):.1f}" r="3" '
                f'fill="{colour}"><title>{escape(label)}: batch {p.batch_size}: '
                f"{escape(fmt(getattr(p, value)))}</title></circle>"
            )
    return "".join(parts)


def render_sweep_svg(points: Sequence[SweepPoint], *, width: int = 960, height: int = 300) -> Markup:
    """Two panels (tokens/s, peak device memory) against batch size; a legend below."""
    lines = series(points)
    batches = sorted({p.batch_size for p in points}) or [1]
    half = width // 2
    legend_h = 18 * ((len(lines) + 2) // 3)
    body = _panel(lines, "tokens_per_s", "tokens/s", 0, half, height, batches) + _panel(
        lines, "peak_device_bytes", "peak device memory", half, half, height, batches
    )
    legend = []
    for i, (colour, label) in enumerate(zip(COLOURS, lines, strict=False)):
        lx, ly = 70 + (i % 3) * 300, height + 14 + 18 * (i // 3)
        legend.append(
            f'<rect x="{lx}" y="{ly - 9}" width="12" height="3" fill="{colour}"/>'
            f'<text x="{lx + 18}" y="{ly}" font-size="11">{escape(label)}</text>'
        )
    if not lines:
        legend.append(f'<text x="70" y="{height + 14}" font-size="11">no point fits yet</text>')
    return Markup(
        f'<svg id="sweep-chart" class="sweep-chart" xmlns="http://www.w3.org/2000/svg" '
        f'viewBox="0 0 {width} {height + legend_h + 10}" width="{width}" '
        f'height="{height + legend_h + 10}" role="img" aria-label="tokens per second and peak '
        f'device memory against batch size">{body}{"".join(legend)}</svg>'
    )
