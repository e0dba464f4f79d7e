"""The SVG chart builder: well-formed, escaped SVG with byte-unit axes, reference lines and readable labels."""

from __future__ import annotations

import math
import re
import xml.etree.ElementTree as ET

from planner_service.ui.chart import (
    Band,
    Bar,
    Marker,
    MemoryChart,
    Point,
    Segment,
    _spread,
    byte_ticks,
    nice_step,
    render_svg,
)

MiB, GiB = 2**20, 2**30
SVG = "{http://www.w3.org/2000/svg}"


def _parse(markup: str) -> ET.Element:
    return ET.fromstring(str(markup))


def _line_chart(**changes) -> MemoryChart:  # type: ignore[no-untyped-def]
    points = tuple(Point(float(i), (40 + i) * MiB, f"fwd layers.{i}") for i in range(10))
    base = dict(
        source="timeline",
        title="t",
        x_label="step",
        points=points,
        markers=(Marker("device limit", 60 * MiB, "limit"), Marker("predicted peak", 49 * MiB, "predicted")),
    )
    base.update(changes)
    return MemoryChart(**base)  # type: ignore[arg-type]


def test_byte_ticks_use_one_binary_unit_at_round_steps_covering_the_maximum() -> None:
    ticks, unit = byte_ticks(int(52.6 * MiB))
    assert unit == "MiB"
    assert ticks[0] == 0 and ticks[-1] >= 52.6 * MiB
    steps = {b - a for a, b in zip(ticks, ticks[1:], strict=False)}
    assert steps == {20 * MiB}  # 52.6 / 5 parts = 10.5 -> the next round step, 20
    assert byte_ticks(3 * GiB)[1] == "GiB" and byte_ticks(0) == ([0, 1], "B")


def test_nice_steps_are_one_two_two_and_a_half_or_five_times_a_power_of_ten() -> None:
    for span in (0.3, 7, 52.6, 999, 12345):
        step = nice_step(span)
        mantissa = step / 10 ** math.floor(math.log10(step))
        assert round(mantissa, 6) in (1.0, 2.0, 2.5, 5.0), (span, step)
        assert 2.5 - 1e-9 <= span / step <= 5 + 1e-9  # about 5 parts: never more, at most twice fewer


def test_line_chart_is_wellformed_svg_with_the_series_polyline_and_labelled_axes() -> None:
    root = _parse(render_svg(_line_chart()))
    assert root.tag == f"{SVG}svg" and root.get("id") == "memory-chart"
    polyline = root.find(f".//{SVG}polyline")
    assert polyline is not None and len(polyline.get("points", "").split()) == 10
    texts = [t.text or "" for t in root.iter(f"{SVG}text")]
    assert "device memory (MiB)" in texts and "step" in texts
    assert any(re.fullmatch(r"\d+\.\d\d MiB", t) for t in texts), texts
    assert "device limit 60.00 MiB" in texts and "predicted peak 49.00 MiB" in texts
    assert len(root.findall(f".//{SVG}circle")) == 10  # few points: each has a hover circle with a title


def test_step_series_draws_horizontal_then_vertical_segments() -> None:
    pts = (Point(0, 10 * MiB), Point(5, 30 * MiB), Point(9, 20 * MiB))
    root = _parse(render_svg(_line_chart(points=pts, steps=True, markers=())))
    coords = [tuple(map(float, p.split(","))) for p in root.find(f".//{SVG}polyline").get("points").split()]  # type: ignore[union-attr]
    assert len(coords) == 2 * len(
        pts
    )  # every new level: one vertex at the old level, one at the new, plus the tail
    for (x0, y0), (x1, y1) in zip(coords, coords[1:], strict=False):
        assert x0 == x1 or y0 == y1  # only horizontal or vertical moves


def test_marker_far_above_the_data_is_listed_off_scale_instead_of_squashing_the_curve() -> None:
    chart = _line_chart(markers=(Marker("device limit", 80 * GiB, "limit"),))
    svg = str(render_svg(chart))
    root = _parse(svg)
    assert not root.findall(f".//{SVG}g[@class='marker limit']")
    assert "device limit 80.00 GiB (off scale, above)" in [t.text for t in root.iter(f"{SVG}text")]
    assert "device memory (MiB)" in svg  # the axis still fits the data


def test_close_marker_labels_are_pushed_apart() -> None:
    assert _spread([100.0, 101.0, 99.0], gap=12.0, lowest=0.0) == [111.0, 123.0, 99.0]
    root = _parse(
        render_svg(_line_chart(markers=(Marker("a", 50 * MiB, "limit"), Marker("b", 50 * MiB, "predicted"))))
    )
    ys = sorted(
        float(t.get("y", 0))
        for g in root.iter(f"{SVG}g")
        if "marker" in (g.get("class") or "")
        for t in g.iter(f"{SVG}text")
    )
    assert ys[1] - ys[0] >= 12


def test_every_user_text_is_escaped_and_the_svg_stays_wellformed() -> None:
    evil = '<script>alert("x")</script> & "q"'
    chart = MemoryChart(
        source="blocks",
        title=evil,
        x_label=evil,
        bars=(Bar(0, (Segment(5 * MiB, "seg-static", evil),), evil),),
        bands=(Band(0, 1, evil, "phase-forward"),),
        markers=(Marker(evil, 3 * MiB, "limit"),),
        legend=(("seg-static", evil),),
    )
    svg = str(render_svg(chart, element_id='x"><script>'))
    assert "<script>" not in svg
    root = _parse(svg)
    assert any(evil in (t.text or "") for t in root.iter(f"{SVG}text"))


def test_stacked_bars_draw_one_rect_per_nonempty_segment_with_a_tooltip_total() -> None:
    bars = tuple(
        Bar(
            float(b),
            (
                Segment(10 * MiB, "seg-static", "static"),
                Segment(0, "seg-retained", "kept"),
                Segment(b * MiB, "seg-own", "own"),
            ),
            f"block {b}",
        )
        for b in range(3)
    )
    root = _parse(render_svg(MemoryChart(source="blocks", title="t", x_label="block", bars=bars)))
    groups = [g for g in root.iter(f"{SVG}g") if g.get("class") == "bar"]
    assert [len(g.findall(f"{SVG}rect")) for g in groups] == [1, 2, 2]
    assert "total: 12.00 MiB" in (groups[2].find(f"{SVG}title").text or "")  # type: ignore[union-attr]
