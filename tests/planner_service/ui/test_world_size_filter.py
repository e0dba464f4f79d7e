"""The plans page filters by the job's world size (issue 20), on SQLite and PostgreSQL."""

from __future__ import annotations

import re

from planner_service.solver.testing.synthetic import synthetic_distributed, synthetic_trace, with_distributed

from .conftest import Dom

MiB = 2**20


def _ids_on(html: str) -> list[str]:
    return re.findall(r'href="/ui/plans/([0-9a-f]+)"', html)


def test_plans_page_filters_by_world_size(ui, solved) -> None:  # type: ignore[no-untyped-def]
    base = synthetic_trace(n_blocks=3, hidden=128, vocab=500, batch=2, seq=64, name="ranks-model")
    one = solved(ui, base, limit=256 * MiB)
    two = solved(ui, with_distributed(base, synthetic_distributed(2, 2)), limit=256 * MiB)
    page = ui.get("/ui/plans")
    choices = [o.attrs.get("value") for o in Dom(page.text).all("option")]
    assert "1" in choices and "2" in choices
    assert _ids_on(ui.get("/ui/plans", params={"world_size": "2"}).text) == [two["id"]]
    assert _ids_on(ui.get("/ui/plans", params={"world_size": "1"}).text) == [one["id"]]
    filtered = ui.get("/ui/plans", params={"world_size": "4"})
    assert filtered.status_code == 200 and "No plans match these filters" in filtered.text
    bad = ui.get("/ui/plans", params={"world_size": "two"})
    assert bad.status_code == 400 and "world_size" in bad.text
