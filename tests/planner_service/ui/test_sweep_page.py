"""`/ui/sweeps/{id}`: a what-if sweep's fit/speed table and its plot of tokens/s and peak device memory against
batch size per hardware, served by the real app on loopback once the sweep's plans are solved by its workers;
and in headless Chromium, drawn (a screenshot's pixels in the series colours)."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from tests.planner_service.sweeps import TINY_LLAMA

from .conftest import Dom

# wide enough that the GPUs' lines part: this small one is dispatch-bound (op count x 8 us) on both
WIDE = {
    **TINY_LLAMA,
    "hidden_size": 1024,
    "intermediate_size": 4096,
    "num_attention_heads": 8,
    "vocab_size": 32000,
    "head_dim": 128,
}


def _finished_sweep(server: str, config: dict[str, object] = TINY_LLAMA, seq: int = 64) -> str:
    with httpx.Client(base_url=server, timeout=120) as c:
        r = c.post(
            "/v1/sweeps",
            json={
                "config": config,
                "hardware": ["l4", "h100-sxm"],
                "batch_sizes": [1, 2, 4],
                "sequence_lengths": [seq],
                "time_limit_s": 1.0,
            },
        )
        assert r.status_code == 202, r.text
        sweep_id = r.json()["id"]
        deadline = time.monotonic() + 60
        while (p := c.get(f"/v1/sweeps/{sweep_id}").json()["progress"])["finished"] < p["total"]:
            assert time.monotonic() < deadline, p
            time.sleep(0.2)
    return str(sweep_id)


def test_sweep_page_shows_the_table_and_one_line_per_hardware(sweep_service: str) -> None:
    sweep_id = _finished_sweep(sweep_service)
    page = httpx.get(f"{sweep_service}/ui/sweeps/{sweep_id}", timeout=30)
    assert page.status_code == 200, page.text
    dom = Dom(page.text)
    assert len(dom.all("tr", "point-row")) == 6
    assert dom.all("svg", "sweep-chart")
    lines = dom.all("polyline", "series")
    assert sorted({ln.attrs["data-series"] for ln in lines}) == ["h100-sxm", "l4"]
    assert len(lines) == 4  # two panels (tokens/s, peak device memory) x two GPUs
    assert all(len(ln.attrs["points"].split()) == 3 for ln in lines)  # every batch fits this small model
    assert "6 of 6 points solved" in page.text
    # the project holds no measured trace from an L4 or an H100: every point says it is uncalibrated
    assert [c.text.strip() for c in dom.all("td", "calibration")] == ["uncalibrated"] * 6
    assert [a for a in dom.all("a") if a.attrs.get("href", "").startswith("/ui/plans/")]
    missing = httpx.get(f"{sweep_service}/ui/sweeps/nope", timeout=30)
    assert missing.status_code == 404 and "no sweep" in missing.text


@pytest.mark.slow
def test_headless_chromium_draws_the_sweep_plot(sweep_service: str, tmp_path: Path) -> None:
    from PIL import Image

    from .test_browser import _browse, _chromium

    chromium = _chromium()
    sweep_id = _finished_sweep(sweep_service, WIDE, 256)
    shot = tmp_path / "sweep.png"
    _browse(chromium, tmp_path / "shot", f"{sweep_service}/ui/sweeps/{sweep_id}", f"--screenshot={shot}")
    colours = [(0x1F, 0x77, 0xB4), (0xD6, 0x27, 0x28)]  # sweep_chart.COLOURS[:2]
    with Image.open(shot) as image:
        rgb = image.convert("RGB")
        width, height = rgb.size
        counts = [
            sum(
                1
                for x in range(0, width, 2)
                for y in range(0, min(height, 700), 2)
                if all(abs(a - b) <= 12 for a, b in zip(rgb.getpixel((x, y)), c, strict=True))
            )
            for c in colours
        ]
    assert all(n > 30 for n in counts), counts


def test_whatif_form_starts_a_sweep_and_names_bad_fields(sweep_service: str) -> None:
    """The what-if page as a person uses it: paste a config, tick GPUs, submit, land on the sweep's page; then
    pick the same config from the history."""
    import json

    with httpx.Client(base_url=sweep_service, timeout=120, follow_redirects=False) as c:
        form = c.get("/ui/whatif")
        assert form.status_code == 200 and 'name="config"' in form.text and 'value="h100-sxm"' in form.text
        sent = {
            "config": json.dumps(TINY_LLAMA),
            "hardware": ["l4", "h100-sxm"],
            "batch_sizes": "1,2",
            "sequence_lengths": "64",
            "dtype": "bf16",
        }
        r = c.post("/ui/whatif", data=sent)
        assert r.status_code == 303 and r.headers["location"].startswith("/ui/sweeps/"), r.text
        sweep_id = r.headers["location"].rsplit("/", 1)[1]
        page = c.get(r.headers["location"])
        assert page.status_code == 200 and len(Dom(page.text).all("tr", "point-row")) == 4

        again = c.get("/ui/whatif")
        assert f'value="{sweep_id}"' in again.text  # the config asked before is offered
        r2 = c.post("/ui/whatif", data={**sent, "config": "", "previous": sweep_id, "batch_sizes": "4"})
        assert r2.status_code == 303, r2.text

        for change, says in [
            ({"config": "{nope"}, "config: not JSON"),
            ({"hardware": ["nope"]}, "hardware[0]: &#39;nope&#39; is not in the catalogue"),
            ({"batch_sizes": "1,x"}, "batch sizes and sequence lengths"),
            ({"config": "", "previous": "missing"}, "previous: no sweep"),
            ({"config": json.dumps({"hidden_size": 8})}, "config: model_type: missing"),
        ]:
            bad = c.post("/ui/whatif", data={**sent, **change})
            assert bad.status_code == 400 and says in bad.text, (change, bad.text[-800:])
