"""The history list sorted by any column (measured errors included) and searched, and the compare view, rendered
by the real app on SQLite and PostgreSQL and read back as a DOM."""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import parse_qs, urlparse

from client.contract import PlanRecord
from planner_service.solver.testing.synthetic import synthetic_trace

from .conftest import Dom

MiB = 2**20


def _trace(n_blocks: int, name: str):  # type: ignore[no-untyped-def]
    return synthetic_trace(n_blocks=n_blocks, hidden=256, vocab=1000, batch=2, seq=128, name=name)


def _feedback(ui: Any, plan: dict[str, Any], ratio: float, notes: str) -> None:
    pred = plan["plan"]["predictions"]
    fb = ui.post(
        f"/v1/plans/{plan['id']}/feedback",
        json={
            "iteration_s": pred["iteration_s"] * ratio,
            "peak_device_bytes": pred["peak_device_bytes"],
            "peak_host_bytes": pred["peak_host_bytes"],
            "steps_measured": 10,
            "notes": notes,
        },
    )
    assert fb.status_code == 201, fb.text


def _row_ids(html: str) -> list[str]:
    return [
        a.attrs["href"].rsplit("/", 1)[1]
        for a in Dom(html).all("a")
        if re.fullmatch(r"/ui/plans/[0-9a-f]+", a.attrs.get("href", ""))
    ]


def test_list_shows_measured_errors_sorts_by_every_column_and_searches(ui, solved) -> None:  # type: ignore[no-untyped-def]
    small = solved(ui, _trace(4, "llama-small"), limit=64 * MiB)
    big = solved(ui, _trace(6, "qwen2-big"), limit=64 * MiB)
    none = solved(ui, _trace(5, "llama-unmeasured"), limit=72 * MiB)
    _feedback(ui, small, 1.40, "slow node")
    _feedback(ui, big, 0.95, "warm cache")

    page = ui.get("/ui/plans", params={"sort": "-error"})
    assert page.status_code == 200, page.text
    assert _row_ids(page.text) == [small["id"], big["id"], none["id"]]  # worst first, unmeasured last
    dom = Dom(page.text)
    cells = [c.text.strip() for c in dom.all("td", "measured-error")]
    assert cells[:2] == ["+40.0%", "+0.0%"] and cells[2:4] == ["-5.0%", "+0.0%"] and cells[4:] == ["—", "—"]
    assert "err-bad" in dom.all("td", "measured-error")[0].classes
    # every sortable header links to its sort; the current one reverses, with an arrow
    headers = {a.text.strip(): a.attrs["href"] for a in dom.all("a", "sort")}
    assert headers["iteration error ▼"].endswith("sort=error")
    assert parse_qs(urlparse(headers["model"]).query)["sort"] == ["model"]
    for header, href in headers.items():
        r = ui.get(href)
        assert r.status_code == 200 and len(_row_ids(r.text)) == 3, (header, href)
    by_name = [small["id"], none["id"], big["id"]]  # llama-small, llama-unmeasured, qwen2-big
    assert _row_ids(ui.get("/ui/plans", params={"sort": "model"}).text) == by_name

    # keyset pages under a sort: the next link keeps it, every plan once
    seen: list[str] = []
    url = "/ui/plans?sort=-error&limit=1"
    while url:
        html = ui.get(url).text
        d = Dom(html)
        seen += _row_ids(html)
        nxt = d.all("a", "next")
        url = nxt[0].attrs["href"] if nxt else ""
        if url:
            assert parse_qs(urlparse(url).query)["sort"] == ["-error"]
    assert seen == [small["id"], big["id"], none["id"]]

    found = ui.get("/ui/plans", params={"search": "llama"})
    assert set(_row_ids(found.text)) == {small["id"], none["id"]}
    search_box = [i for i in Dom(found.text).all("input") if i.attrs.get("name") == "search"]
    assert search_box[0].attrs["value"] == "llama"
    assert _row_ids(ui.get("/ui/plans", params={"search": "warm cache"}).text) == [big["id"]]
    empty = ui.get("/ui/plans", params={"search": "%"})
    assert empty.status_code == 200 and "No plans match these filters" in empty.text


def test_compare_view_side_by_side_with_differences_only(ui, solved) -> None:  # type: ignore[no-untyped-def]
    trace = _trace(6, "compare-model")
    tight = solved(ui, trace, limit=40 * MiB)
    loose = solved(ui, trace, limit=4096 * MiB)
    _feedback(ui, tight, 1.2, "tight run")
    records = [PlanRecord.model_validate(ui.get(f"/v1/plans/{p['id']}").json()) for p in (tight, loose)]
    assert all(r.plan is not None and r.plan.policy is not None for r in records)

    # the list's checkboxes submit to the compare view
    listing = Dom(ui.get("/ui/plans").text)
    boxes = {b.attrs["value"] for b in listing.all("input") if b.attrs.get("name") == "id"}
    assert boxes == {tight["id"], loose["id"]}

    full = ui.get("/ui/compare", params=[("id", tight["id"]), ("id", loose["id"])])
    assert full.status_code == 200, full.text
    dom = Dom(full.text)
    labels = [dom_th.text.strip() for dom_th in dom.all("th") if dom_th.text.strip()]
    for label in ("model", "hardware", "workload", "device memory", "iteration", "iteration error", "gap"):
        assert label in labels, label
    n_blocks = len(records[0].plan.policy.blocks)  # type: ignore[union-attr]
    assert sum(1 for x in labels if x.startswith("block ")) == n_blocks
    assert sum(1 for x in labels if re.fullmatch(r"chunk \d+", x)) == max(
        len(r.plan.policy.chunks)  # type: ignore[union-attr]
        for r in records
    )
    assert "+20.0%" in full.text and "tight run" in full.text
    differing = dom.all("tr", "differs")
    assert 0 < len(differing) < len(dom.all("tr", "compare-row"))

    only = Dom(ui.get("/ui/compare", params=[("id", tight["id"]), ("id", loose["id"]), ("diff", "1")]).text)
    shown = only.all("tr", "compare-row")
    assert len(shown) == len(differing) and all("differs" in r.classes for r in shown)
    shown_labels = {r.text.strip().splitlines()[0].strip() for r in shown}
    assert "device memory" in shown_labels and "model" not in shown_labels and "workload" not in shown_labels
    toggle = only.one("a", "toggle")
    assert "diff" not in parse_qs(urlparse(toggle.attrs["href"]).query)

    for params, status, says in (
        ([("id", tight["id"])], 400, "id: pick 2"),
        ([("id", tight["id"]), ("id", tight["id"])], 400, "id: pick 2"),
        ([("id", tight["id"]), ("id", "a\x00b")], 400, "NUL"),
        ([("id", tight["id"]), ("id", "f" * 5000)], 400, "longer than a plan id"),
        ([("id", tight["id"]), ("id", "0" * 32)], 404, "no plan"),
        ([("id", f"{i:032x}") for i in range(9)], 400, "id: pick 2 to 8"),
        ([("id", tight["id"]), ("id", loose["id"]), ("diff", "yes")], 400, "diff:"),
    ):
        r = ui.get("/ui/compare", params=params)
        assert r.status_code == status and says in r.text, (params, r.status_code, r.text[:300])
