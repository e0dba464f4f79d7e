"""Device-memory chart as inline SVG: a byte series over steps (or per-block bars), reference lines, labelled axes.

Plain Python with no browser code: `render_svg(chart)` returns escaped SVG markup (a `markupsafe.Markup`)
that a template inserts as is. Every piece of text in the chart (step labels, module names, marker
labels) passes through `markupsafe.escape`, because model and module names are user input.

Geometry: the plot area is `width - LEFT - RIGHT` by `height - TOP - BOTTOM` user units; x is the
series' own coordinate (step index, logical time, block index), y is bytes. The y axis is ticked in
one binary unit (KiB/MiB/GiB) chosen from the largest value shown, and labelled with
`client.units.format_bytes`. A reference line far above the data (more than `OFF_SCALE_FACTOR` times
the data's maximum, typically the device limit of a small model) is not allowed to squash the curve
to the floor: it is listed in the legend as "off scale" instead of being drawn.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from markupsafe import Markup, escape

from client.units import format_bytes

LEFT, RIGHT, TOP, BOTTOM = 84.0, 24.0, 40.0, 52.0
OFF_SCALE_FACTOR = 3.0
MAX_MARKED_POINTS = 160  # points get a hover circle (with a <title>) only when there are this few

ChartSource = Literal["timeline", "allocation", "blocks", "requirement"]


@dataclass(frozen=True)
class Point:
    """One sample of the series: device bytes in use at `x` (label shown on hover)."""

    x: float
    y_bytes: int
    label: str = ""


@dataclass(frozen=True)
class Segment:
    """A stacked part of a bar: `bytes` of one kind (css class picks the colour)."""

    bytes: int
    css: str
    label: str


@dataclass(frozen=True)
class Bar:
    """A stacked bar centred on `x`, its segments bottom to top."""

    x: float
    segments: tuple[Segment, ...]
    label: str

    @property
    def total_bytes(self) -> int:
        return sum(s.bytes for s in self.segments)


@dataclass(frozen=True)
class Band:
    """A shaded span of x (a phase of the iteration: forward, backward, optimizer)."""

    start: float
    stop: float
    label: str
    css: str


@dataclass(frozen=True)
class Marker:
    """A horizontal reference line at `value_bytes` (device limit, predicted peak, measured peak, arena)."""

    label: str
    value_bytes: int
    css: str


@dataclass(frozen=True)
class MemoryChart:
    """What to draw. `points` (a line, or steps when `steps`) and/or `bars`; the rest annotates them."""

    source: ChartSource
    title: str
    x_label: str
    points: tuple[Point, ...] = ()
    steps: bool = False
    bars: tuple[Bar, ...] = ()
    bands: tuple[Band, ...] = ()
    markers: tuple[Marker, ...] = ()
    legend: tuple[tuple[str, str], ...] = ()  # (css class, label) of the series and bar segments
    integer_x: bool = True
    x_ticks: bool = True  # False: no numbers on the x axis (a single bar)

    @property
    def data_max_bytes(self) -> int:
        return max([p.y_bytes for p in self.points] + [b.total_bytes for b in self.bars] + [0])


# ------------------------------------------------------------------------------------------- scales
_BINARY_UNITS: tuple[tuple[str, int], ...] = (
    ("TiB", 2**40),
    ("GiB", 2**30),
    ("MiB", 2**20),
    ("KiB", 2**10),
    ("B", 1),
)


def byte_unit(max_bytes: int) -> tuple[str, int]:
    """The largest binary unit not above `max_bytes` (B for 0)."""
    for name, size in _BINARY_UNITS:
        if max_bytes >= size:
            return name, size
    return "B", 1


def nice_step(span: float, target_ticks: int = 5) -> float:
    """A 1, 2, 2.5 or 5 times a power of ten step that cuts `span` into about `target_ticks` parts."""
    if span <= 0:
        return 1.0
    raw = span / target_ticks
    power = 10 ** math.floor(math.log10(raw))
    for m in (1.0, 2.0, 2.5, 5.0, 10.0):
        if m * power >= raw:
            return m * power
    return 10.0 * power


def byte_ticks(max_bytes: int) -> tuple[list[int], str]:
    """Tick values (bytes, from 0 to at least `max_bytes`) at round numbers of one binary unit, and that unit."""
    unit_name, unit = byte_unit(max_bytes)
    top = max(max_bytes, 1) / unit
    step = nice_step(top)
    if unit == 1:
        step = float(max(1, math.ceil(step)))  # no fractions of a byte
    n = max(1, math.ceil(top / step - 1e-9))
    return [round(i * step * unit) for i in range(n + 1)], unit_name


def x_ticks(lo: float, hi: float, integer: bool) -> list[float]:
    if hi <= lo:
        return [lo]
    step = nice_step(hi - lo, 8)
    if integer:
        step = max(1.0, round(step))
    first = math.ceil(lo / step) * step
    out: list[float] = []
    v = first
    while v <= hi + 1e-9:
        out.append(v)
        v += step
    return out


def _num(v: float) -> str:
    return f"{v:.1f}".rstrip("0").rstrip(".")


# ------------------------------------------------------------------------------------------- render
def render_svg(
    chart: MemoryChart, *, width: int = 960, height: int = 340, element_id: str = "memory-chart"
) -> Markup:
    """The chart as one `<svg>` element (viewBox sized, scales with its container)."""
    pw, ph = width - LEFT - RIGHT, height - TOP - BOTTOM
    data_max = chart.data_max_bytes
    on_scale = [m for m in chart.markers if data_max == 0 or m.value_bytes <= OFF_SCALE_FACTOR * data_max]
    off_scale = [m for m in chart.markers if m not in on_scale]
    ticks, unit_name = byte_ticks(max([data_max] + [m.value_bytes for m in on_scale]))
    y_top = ticks[-1] or 1

    xs = [p.x for p in chart.points] + [b.x - 0.5 for b in chart.bars] + [b.x + 0.5 for b in chart.bars]
    xs += [b.start for b in chart.bands] + [b.stop for b in chart.bands]
    x_lo, x_hi = (min(xs), max(xs)) if xs else (0.0, 1.0)
    if x_hi <= x_lo:
        x_hi = x_lo + 1.0

    def sx(x: float) -> float:
        return LEFT + (x - x_lo) / (x_hi - x_lo) * pw

    def sy(y: float) -> float:
        return TOP + ph - min(y, y_top) / y_top * ph

    out: list[str] = [
        f'<svg id="{escape(element_id)}" class="memory-chart chart-{escape(chart.source)}" '
        f'xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {height}" width="100%" '
        f'role="img" aria-labelledby="{escape(element_id)}-title" data-source="{escape(chart.source)}">',
        f'<title id="{escape(element_id)}-title">{escape(chart.title)}</title>',
    ]
    # phase bands behind everything
    for band in chart.bands:
        x0, x1 = sx(band.start), sx(band.stop)
        out.append(
            f'<g class="band {escape(band.css)}"><title>{escape(band.label)}</title>'
            f'<rect x="{x0:.1f}" y="{TOP:.1f}" width="{max(0.0, x1 - x0):.1f}" height="{ph:.1f}"/>'
            f'<text class="band-label" x="{(x0 + x1) / 2:.1f}" y="{TOP + ph - 6:.1f}" text-anchor="middle">'
            f"{escape(band.label)}</text></g>"
        )
    # y grid and tick labels
    out.append('<g class="axis y-axis">')
    for t in ticks:
        y = sy(t)
        out.append(
            f'<line class="grid" x1="{LEFT:.1f}" x2="{LEFT + pw:.1f}" y1="{y:.1f}" y2="{y:.1f}"/>'
            f'<text x="{LEFT - 6:.1f}" y="{y + 4:.1f}" text-anchor="end">{escape(format_bytes(t))}</text>'
        )
    out.append(
        f'<text class="axis-title" transform="translate(14 {TOP + ph / 2:.1f}) rotate(-90)" '
        f'text-anchor="middle">device memory ({escape(unit_name)})</text></g>'
    )
    # x ticks
    out.append('<g class="axis x-axis">')
    out.append(
        f'<line class="axis-line" x1="{LEFT:.1f}" x2="{LEFT + pw:.1f}" y1="{TOP + ph:.1f}" y2="{TOP + ph:.1f}"/>'
    )
    tick_xs = (
        sorted({b.x for b in chart.bars})
        if chart.bars and len(chart.bars) <= 40
        else x_ticks(x_lo, x_hi, chart.integer_x)
    )
    for tx in tick_xs if chart.x_ticks else []:
        x = sx(tx)
        out.append(
            f'<line class="tick" x1="{x:.1f}" x2="{x:.1f}" y1="{TOP + ph:.1f}" y2="{TOP + ph + 4:.1f}"/>'
            f'<text x="{x:.1f}" y="{TOP + ph + 16:.1f}" text-anchor="middle">{escape(_num(tx))}</text>'
        )
    out.append(
        f'<text class="axis-title" x="{LEFT + pw / 2:.1f}" y="{height - 10:.1f}" text-anchor="middle">'
        f"{escape(chart.x_label)}</text></g>"
    )
    # bars
    if chart.bars:
        slot = pw / max(1.0, x_hi - x_lo)
        bw = min(72.0, max(1.0, slot * 0.7))
        out.append('<g class="bars">')
        for bar in chart.bars:
            tip = bar.label + "\n" + "\n".join(f"{s.label}: {format_bytes(s.bytes)}" for s in bar.segments)
            tip += f"\ntotal: {format_bytes(bar.total_bytes)}"
            out.append(f'<g class="bar"><title>{escape(tip)}</title>')
            base = 0
            for seg in bar.segments:
                if seg.bytes <= 0:
                    continue
                y0, y1 = sy(base + seg.bytes), sy(base)
                out.append(
                    f'<rect class="{escape(seg.css)}" x="{sx(bar.x) - bw / 2:.1f}" y="{y0:.1f}" '
                    f'width="{bw:.1f}" height="{max(0.5, y1 - y0):.1f}"/>'
                )
                base += seg.bytes
            if len(chart.bars) <= 4:  # few bars: print the total above each
                out.append(
                    f'<text class="bar-total" x="{sx(bar.x):.1f}" y="{sy(base) - 4:.1f}" '
                    f'text-anchor="middle">{escape(format_bytes(base))}</text>'
                )
            out.append("</g>")
        out.append("</g>")
    # the series
    if chart.points:
        coords: list[tuple[float, float]] = []
        for i, p in enumerate(chart.points):
            if chart.steps and i > 0:
                coords.append((sx(p.x), sy(chart.points[i - 1].y_bytes)))
            coords.append((sx(p.x), sy(p.y_bytes)))
        if chart.steps:
            coords.append((LEFT + pw, coords[-1][1]))
        pts = " ".join(f"{x:.1f},{y:.1f}" for x, y in coords)
        area = f"{coords[0][0]:.1f},{TOP + ph:.1f} {pts} {coords[-1][0]:.1f},{TOP + ph:.1f}"
        out.append(f'<polygon class="series-area" points="{area}"/>')
        out.append(f'<polyline class="series" points="{pts}"/>')
        if len(chart.points) <= MAX_MARKED_POINTS:
            out.append('<g class="points">')
            for p in chart.points:
                tip = f"{p.label}: {format_bytes(p.y_bytes)}" if p.label else format_bytes(p.y_bytes)
                out.append(
                    f'<circle cx="{sx(p.x):.1f}" cy="{sy(p.y_bytes):.1f}" r="3"><title>{escape(tip)}</title></circle>'
                )
            out.append("</g>")
    # reference lines on top, labels pushed apart so that close values stay readable
    label_ys = _spread([sy(m.value_bytes) - 4 for m in on_scale], gap=12.0, lowest=TOP + 10)
    for m, label_y in zip(on_scale, label_ys, strict=True):
        y = sy(m.value_bytes)
        text = f"{m.label} {format_bytes(m.value_bytes)}"
        out.append(
            f'<g class="marker {escape(m.css)}"><title>{escape(text)}</title>'
            f'<line x1="{LEFT:.1f}" x2="{LEFT + pw:.1f}" y1="{y:.1f}" y2="{y:.1f}"/>'
            f'<text x="{LEFT + pw - 4:.1f}" y="{label_y:.1f}" text-anchor="end">{escape(text)}</text></g>'
        )
    out.append(_legend(chart, off_scale, width))
    out.append("</svg>")
    return Markup("".join(out))


def _spread(ys: Sequence[float], *, gap: float, lowest: float) -> list[float]:
    """Label baselines near `ys` (same order), at least `gap` apart and none above `lowest`."""
    order = sorted(range(len(ys)), key=lambda i: ys[i])
    out = list(ys)
    prev = lowest - gap
    for i in order:  # top to bottom: push each label down below the one above it
        out[i] = max(out[i], prev + gap)
        prev = out[i]
    return out


def _legend(chart: MemoryChart, off_scale: Sequence[Marker], width: int) -> str:
    """One row above the plot: series swatches, then off-scale markers with their values."""
    items: list[tuple[str, str]] = list(chart.legend)
    items += [(m.css, f"{m.label} {format_bytes(m.value_bytes)} (off scale, above)") for m in off_scale]
    out = ['<g class="legend">']
    x = LEFT
    for css, label in items:
        out.append(
            f'<rect class="swatch {escape(css)}" x="{x:.1f}" y="12" width="12" height="12"/>'
            f'<text x="{x + 16:.1f}" y="22">{escape(label)}</text>'
        )
        x += 16 + 6.5 * len(label) + 18
        if x > width - 80:
            break
    out.append("</g>")
    return "".join(out)
