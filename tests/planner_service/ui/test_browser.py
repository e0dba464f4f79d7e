"""The plan page in headless Chromium: the real server on loopback renders the chart and the mode strip.

Needs Debian's `chromium` (scripts/ensure_chromium.sh installs it). Without it the test is skipped
locally, with the reason, and fails in CI (CI=true), where the script has run.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from planner_service.solver.testing.synthetic import synthetic_trace

from .conftest import Dom, iteration_allocations

MiB = 2**20
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
    "--window-size=1280,1600",
)
SERIES_COLOUR = (0x17, 0x3E, 0x8C)  # --series in planner_service/ui/static/ui.css: used by the series alone


def _chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(
            "chromium is required in CI and is not installed (scripts/ensure_chromium.sh installs it)"
        )
    pytest.skip("chromium is not installed: run scripts/ensure_chromium.sh to run the browser test")


def _browse(chromium: str, profile: Path, url: str, *extra: str) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(
        [chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *extra, url],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return out


@pytest.fixture
def server(settings, monkeypatch) -> Iterator[str]:  # type: ignore[no-untyped-def]
    """The real app with the UI on a loopback port (uvicorn on a thread, its worker included)."""
    import planner_service.app
    from planner_service.embedded import EmbeddedServer

    from .conftest import with_ui

    original = planner_service.app.create_app
    monkeypatch.setattr(planner_service.app, "create_app", lambda *a, **k: with_ui(original(*a, **k)))
    with EmbeddedServer(settings) as url:
        yield url


@pytest.mark.slow
def test_headless_chromium_draws_the_memory_chart_and_the_mode_strip(server: str, tmp_path: Path) -> None:
    chromium = _chromium()
    trace = synthetic_trace(n_blocks=8, hidden=256, vocab=1000, batch=2, seq=128, name="browser-test-model")
    trace = trace.model_copy(update={"allocation_trace": iteration_allocations(trace)})
    with httpx.Client(base_url=server, timeout=60) as client:
        trace_id = client.post("/v1/traces", content=trace.canonical_json()).json()["id"]
        plan_id = client.post(
            "/v1/plans", json={"trace_id": trace_id, "constraints": {"device_memory_bytes": 64 * MiB}}
        ).json()["id"]
        done = client.get(f"/v1/plans/{plan_id}", params={"wait": 60}).json()
        assert done["status"] == "done", done
        fb = client.post(
            f"/v1/plans/{plan_id}/feedback",
            json={
                "iteration_s": 0.002,
                "peak_device_bytes": 50 * MiB,
                "peak_host_bytes": 90 * MiB,
                "steps_measured": 10,
            },
        )
        assert fb.status_code == 201, fb.text
    url = f"{server}/ui/plans/{plan_id}"

    dom = Dom(_browse(chromium, tmp_path / "dom", url, "--dump-dom").stdout)
    chart = dom.all("svg", "memory-chart")[0]
    assert chart.attrs["id"] == "memory-chart"
    polyline = dom.all("polyline", "series")[0]
    assert len(polyline.attrs["points"].split()) >= 2
    assert len(dom.all("g", "mode-cell")) == len(trace.model.blocks)
    assert len(dom.all("span", "chunk-cell")) == len(done["plan"]["policy"]["chunks"])
    assert "measured peak 50.00 MiB" in chart.text

    listing = Dom(_browse(chromium, tmp_path / "list", f"{server}/ui/plans", "--dump-dom").stdout)
    assert [a for a in listing.all("a") if a.attrs.get("href") == f"/ui/plans/{plan_id}"]

    # The chart is drawn, not just present in the markup: the series' stroke colour is on the screenshot,
    # inside the chart's box (the page is laid out so that the first chart starts above 1000 px).
    from PIL import Image

    shot = tmp_path / "plan.png"
    _browse(chromium, tmp_path / "shot", url, f"--screenshot={shot}")
    with Image.open(shot) as image:
        rgb = image.convert("RGB")
        width, height = rgb.size
        drawn = sum(
            1
            for x in range(0, width, 2)
            for y in range(150, min(height, 1000), 2)
            if all(abs(c - s) <= 12 for c, s in zip(rgb.getpixel((x, y)), SERIES_COLOUR, strict=True))
        )
    assert drawn > 150, f"only {drawn} series-coloured pixels on the screenshot"


DIFFERS_COLOUR = (0xFB, 0xEF, 0xB0)  # tr.differs td in planner_service/ui/static/ui.css: used by nothing else


@pytest.mark.slow
def test_headless_chromium_paints_the_compare_view_and_its_differences_only_toggle(
    server: str, tmp_path: Path
) -> None:
    from PIL import Image

    chromium = _chromium()
    trace = synthetic_trace(
        n_blocks=6, hidden=256, vocab=1000, batch=2, seq=128, name="compare-browser-model"
    )
    ids = []
    with httpx.Client(base_url=server, timeout=60) as client:
        trace_id = client.post("/v1/traces", content=trace.canonical_json()).json()["id"]
        for limit in (40 * MiB, 4096 * MiB):
            plan_id = client.post(
                "/v1/plans", json={"trace_id": trace_id, "constraints": {"device_memory_bytes": limit}}
            ).json()["id"]
            assert client.get(f"/v1/plans/{plan_id}", params={"wait": 60}).json()["status"] == "done"
            ids.append(plan_id)
    url = f"{server}/ui/compare?id={ids[0]}&id={ids[1]}"

    full = Dom(_browse(chromium, tmp_path / "full", url, "--dump-dom").stdout)
    rows, differing = full.all("tr", "compare-row"), full.all("tr", "differs")
    assert 0 < len(differing) < len(rows)
    only = Dom(_browse(chromium, tmp_path / "only", url + "&diff=1", "--dump-dom").stdout)
    assert len(only.all("tr", "compare-row")) == len(differing)

    shot = tmp_path / "compare.png"
    _browse(chromium, tmp_path / "shot", url + "&diff=1", f"--screenshot={shot}")
    with Image.open(shot) as image:
        rgb = image.convert("RGB")
        width, height = rgb.size
        painted = sum(
            1
            for x in range(0, width, 2)
            for y in range(0, height, 2)
            if all(abs(c - s) <= 6 for c, s in zip(rgb.getpixel((x, y)), DIFFERS_COLOUR, strict=True))
        )
    assert painted > 200, f"only {painted} pixels of the differences' highlight on the screenshot"
