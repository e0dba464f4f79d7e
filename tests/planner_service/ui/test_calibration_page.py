"""`/ui/calibration`: predicted against measured iteration time and peak device memory, per hardware, over all of
the project's feedback, from plans solved by the real worker and feedback posted through the API."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from planner_service.solver.testing.synthetic import synthetic_trace

from .conftest import Dom

MiB = 2**20


def test_calibration_page_plots_every_feedback_per_hardware(
    ui: Any, solved: Callable[..., dict[str, Any]]
) -> None:
    empty = ui.get("/ui/calibration")
    assert empty.status_code == 200 and "No feedback yet" in empty.text
    plans = []
    for i, (n_blocks, measured_s) in enumerate([(4, 0.02), (6, 0.05)]):
        trace = synthetic_trace(n_blocks=n_blocks, hidden=256, vocab=1000, batch=2, seq=128, name=f"cal-{i}")
        done = solved(
            ui,
            trace,
            feedback={
                "iteration_s": measured_s,
                "peak_device_bytes": 40 * MiB,
                "peak_host_bytes": 10 * MiB,
                "steps_measured": 5,
            },
        )
        assert done["status"] == "done", done
        plans.append(done)
    ui.post(
        f"/v1/plans/{plans[0]['id']}/feedback",
        json={
            "iteration_s": 0.03,
            "peak_device_bytes": 45 * MiB,
            "peak_host_bytes": 10 * MiB,
            "steps_measured": 5,
        },
    )
    page = ui.get("/ui/calibration")
    assert page.status_code == 200
    dom = Dom(page.text)
    points = dom.all("circle", "feedback-point")
    assert len(points) == 2 * 3  # two panels, three feedbacks
    hardware = {p["hardware_key"] for p in plans}
    assert {p.attrs["data-hardware"] for p in points} == hardware
    rows = dom.all("tr", "hardware-error")
    assert len(rows) == len(hardware)
    # each hardware's row: the median relative iteration error of its feedbacks
    fed = [(plans[0], 0.02), (plans[1], 0.05), (plans[0], 0.03)]
    for h in hardware:
        errs = sorted(
            abs(m - p["plan"]["predictions"]["iteration_s"]) / m for p, m in fed if p["hardware_key"] == h
        )
        want = (
            errs[len(errs) // 2] if len(errs) % 2 else (errs[len(errs) // 2 - 1] + errs[len(errs) // 2]) / 2
        )
        row = next(r for r in rows if h in r.text)
        assert f"{100 * want:.1f}%" in row.text, (row.text, want)
