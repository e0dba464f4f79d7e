"""The history pages on SQLite and PostgreSQL: list with filters and pagination, plan page, escaping, errors, tenancy."""

from __future__ import annotations

import re
from urllib.parse import parse_qs, urlparse

from client.contract import PlanRecord
from planner_service.solver.testing.synthetic import synthetic_trace

from .conftest import Dom, iteration_allocations

MiB = 2**20
FEEDBACK = {
    "iteration_s": 0.0021,
    "peak_device_bytes": 50 * MiB,
    "peak_host_bytes": 90 * MiB,
    "steps_measured": 20,
    "notes": "measured on the test rig",
}


def _trace(n_blocks: int = 6, name: str | None = None, device_gib: int = 80):  # type: ignore[no-untyped-def]
    return synthetic_trace(
        n_blocks=n_blocks,
        hidden=256,
        vocab=1000,
        batch=2,
        seq=128,
        name=name,
        device_memory_bytes=device_gib * 2**30,
    )


def _ids_on(html: str) -> list[str]:
    return re.findall(r'href="/ui/plans/([0-9a-f]+)"', html)


def test_root_redirects_to_the_plans_list(ui) -> None:  # type: ignore[no-untyped-def]
    r = ui.get("/", follow_redirects=False)
    assert r.status_code == 307 and r.headers["location"] == "/ui/plans"
    assert ui.get("/").url.path == "/ui/plans"


def test_list_filters_by_model_hardware_and_status(ui, solved) -> None:  # type: ignore[no-untyped-def]
    small, big = _trace(4, "small-model"), _trace(6, "big-model", device_gib=40)
    a = solved(ui, small, limit=64 * MiB)
    b = solved(ui, big, limit=64 * MiB)
    c = solved(ui, big, limit=1 * MiB)  # infeasible
    assert c["status"] == "infeasible"

    everything = ui.get("/ui/plans")
    assert everything.status_code == 200 and everything.headers["content-type"].startswith("text/html")
    assert set(_ids_on(everything.text)) == {a["id"], b["id"], c["id"]}
    dom = Dom(everything.text)
    assert {o.attrs["value"] for o in dom.all("option") if o.attrs.get("value", "").startswith("cuda:")} == {
        small.hardware.key,
        big.hardware.key,
    }

    assert _ids_on(ui.get("/ui/plans", params={"model": small.model.fingerprint}).text) == [a["id"]]
    assert set(_ids_on(ui.get("/ui/plans", params={"model": "big-model"}).text)) == {b["id"], c["id"]}
    assert set(_ids_on(ui.get("/ui/plans", params={"hardware": big.hardware.key}).text)) == {b["id"], c["id"]}
    assert _ids_on(ui.get("/ui/plans", params={"model": "big-model", "status": "infeasible"}).text) == [
        c["id"]
    ]
    none = ui.get("/ui/plans", params={"model": "no-such-model"})
    assert none.status_code == 200 and "No plans match these filters" in none.text


def test_pagination_visits_every_plan_once_in_order(ui, solved) -> None:  # type: ignore[no-untyped-def]
    trace = _trace(4)
    made = [solved(ui, trace, limit=(48 + 8 * i) * MiB)["id"] for i in range(5)]
    for sort, expected in (("-created_at", made[::-1]), ("created_at", made)):
        seen: list[str] = []
        url = f"/ui/plans?limit=2&sort={sort}"
        pages = 0
        while url:
            dom = Dom(ui.get(url).text)
            seen += [
                a.attrs["href"].rsplit("/", 1)[1]
                for a in dom.all("a")
                if re.fullmatch(r"/ui/plans/[0-9a-f]+", a.attrs.get("href", ""))
            ]
            nxt = [a for a in dom.all("a", "next")]
            url = nxt[0].attrs["href"] if nxt else ""
            if url:
                q = parse_qs(urlparse(url).query)
                assert q["limit"] == ["2"] and "cursor" in q  # the next link keeps the filters
                assert (sort == "-created_at") == ("sort" not in q)
            pages += 1
        assert pages == 3 and seen == expected


def test_plan_page_shows_chart_modes_chunks_comparison_and_solver_report(ui, solved) -> None:  # type: ignore[no-untyped-def]
    trace = _trace(8)
    trace = trace.model_copy(update={"allocation_trace": iteration_allocations(trace)})
    done = solved(ui, trace, limit=64 * MiB, feedback=FEEDBACK)
    record = PlanRecord.model_validate(ui.get(f"/v1/plans/{done['id']}").json())
    plan = record.plan
    assert plan is not None and plan.policy is not None and plan.predictions is not None

    r = ui.get(f"/ui/plans/{done['id']}")
    assert r.status_code == 200
    dom = Dom(r.text)
    charts = dom.all("svg", "memory-chart")
    assert charts and charts[0].attrs["id"] == "memory-chart"
    assert charts[-1].attrs["data-source"] == "allocation"  # the allocation plan's live bytes are charted too
    assert len(dom.all("polyline", "series")) == len(charts)
    labels = " ".join(t.text for t in dom.all("text"))
    assert "device limit 64.00 MiB" in labels and "measured peak 50.00 MiB" in labels
    # the allocation the service planned is the profiled (un-managed) iteration's, and the page says so
    assert "arena of the profiled iteration" in labels and "allocation arena" not in labels
    assert "Allocation plan of the profiled iteration" in r.text
    assert "trace's host memory" not in r.text and "layout statuses" not in r.text
    assert re.search(r"device memory \((MiB|GiB)\)", labels)

    cells = dom.all("g", "mode-cell")
    assert [c.attrs["data-block"] for c in cells] == [str(i) for i in range(len(trace.model.blocks))]
    for cell, block, policy in zip(cells, trace.model.blocks, plan.policy.blocks, strict=True):
        assert f"mode-{policy.mode.value}" in cell.classes
        assert cell.text.strip().startswith(f"block {block.index}: {block.name} ({policy.mode.value})")
    assert "".join(c.text.strip()[-1] for c in cells) == plan.policy.mode_strip()

    chunks = dom.all("span", "chunk-cell")
    assert [("chunk-offloaded" in c.classes) for c in chunks] == [
        ch.placement.value == "offloaded" for ch in plan.policy.chunks
    ]
    assert all(c.attrs["title"].startswith(f"chunk {i}: ") for i, c in enumerate(chunks))

    compare = dom.one("table", "compare").text
    fb = record.feedback[0]
    assert fb.iteration_error is not None and fb.peak_device_error is not None
    assert f"{fb.iteration_error * 100:+.1f}%" in compare and f"{fb.peak_device_error * 100:+.1f}%" in compare
    assert "50.00 MiB" in compare and "2.10 ms" in compare

    report = dom.one("table", "solver-report").text
    for needle in (
        "status",
        plan.solver.status.value,
        "best bound",
        "gap",
        "solve time",
        plan.solver.solver_version,
        "message",
        plan.solver.message[:30],
    ):
        assert needle in report, needle


def test_queued_plan_page_says_so_and_refreshes_itself(settings) -> None:  # type: ignore[no-untyped-def]
    from fastapi.testclient import TestClient

    from planner_service.app import create_app

    from .conftest import with_ui

    with TestClient(with_ui(create_app(settings, workers=0))) as client:  # no worker: the plan stays queued
        trace_id = client.post("/v1/traces", content=_trace(4).canonical_json()).json()["id"]
        plan_id = client.post(
            "/v1/plans", json={"trace_id": trace_id, "constraints": {"device_memory_bytes": 64 * MiB}}
        ).json()["id"]
        dom = Dom(client.get(f"/ui/plans/{plan_id}").text)
    assert any(m.attrs.get("http-equiv") == "refresh" for m in dom.all("meta"))
    assert "Queued" in dom.one("p", "note").text and not dom.all("svg", "memory-chart")


def test_infeasible_plan_page_charts_the_memory_that_would_fit(ui, solved) -> None:  # type: ignore[no-untyped-def]
    done = solved(ui, _trace(4), limit=1 * MiB)
    dom = Dom(ui.get(f"/ui/plans/{done['id']}").text)
    assert dom.one("svg", "memory-chart").attrs["data-source"] == "requirement"
    assert all(m.attrs.get("http-equiv") != "refresh" for m in dom.all("meta"))
    assert "smallest device memory that fits" in dom.one("table", "solver-report").text
    assert not dom.all("g", "mode-cell")  # no policy, no strip


def test_user_text_is_escaped_on_every_page(ui, solved) -> None:  # type: ignore[no-untyped-def]
    evil = '<script>alert("owned")</script><img src=x onerror=alert(1)>'
    done = solved(ui, _trace(4, name=evil), limit=64 * MiB, feedback={**FEEDBACK, "notes": evil})
    for url in ("/ui/plans", f"/ui/plans/{done['id']}", "/ui/catalog", "/ui/plans?model=%3Cscript%3E"):
        html = ui.get(url).text
        assert "<script>" not in html and "<img src=x" not in html, url
    assert "&lt;script&gt;alert(&#34;owned&#34;)&lt;/script&gt;" in ui.get(f"/ui/plans/{done['id']}").text


def test_unknown_plans_are_404_and_bad_queries_400_naming_the_parameter(ui) -> None:  # type: ignore[no-untyped-def]
    r = ui.get("/ui/plans/0123456789abcdef")
    assert r.status_code == 404 and "plan_id" in r.text and r.headers["content-type"].startswith("text/html")
    for params, field in (
        ({"status": "exploded"}, "status:"),
        ({"limit": "0"}, "limit:"),
        ({"limit": "x"}, "limit:"),
        ({"sort": "name"}, "sort:"),
        ({"cursor": "garbage!"}, "cursor:"),
        ({"model": "m" * 700}, "model:"),
    ):
        r = ui.get("/ui/plans", params=params)
        assert r.status_code == 400, params
        assert field in Dom(r.text).one("p", "error-message").text, params


def test_stylesheet_is_served_as_css(ui) -> None:  # type: ignore[no-untyped-def]
    r = ui.get("/ui/static/ui.css")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/css")
    assert ".memory-chart" in r.text and ".mode-keep" in r.text


def test_pages_show_only_the_callers_project(settings, solved) -> None:  # type: ignore[no-untyped-def]
    from fastapi.testclient import TestClient

    from planner_service.app import create_app
    from planner_service.auth import create_token
    from planner_service.db.session import Database

    from .conftest import with_ui

    db = Database(settings.database_url)
    with db.session() as s:
        token_a, _ = create_token(s, "team-a")
        token_b, _ = create_token(s, "team-b")
    db.dispose()
    with TestClient(with_ui(create_app(settings.model_copy(update={"auth": True})))) as client:
        client.headers["authorization"] = f"Bearer {token_a}"
        mine = solved(client, _trace(4, "team-a-model"), limit=64 * MiB)
        other = solved(client, _trace(4, "team-a-model"), limit=72 * MiB)
        compare = f"/ui/compare?id={mine['id']}&id={other['id']}"
        assert client.get(compare).status_code == 200
        client.headers["authorization"] = f"Bearer {token_b}"
        assert client.get(compare).status_code == 404  # another project's plans are not found
        assert "team-a-model" not in client.get("/ui/plans", params={"search": "team-a"}).text
        listing = client.get("/ui/plans")
        assert (
            listing.status_code == 200
            and mine["id"] not in listing.text
            and "team-a-model" not in listing.text
        )
        assert client.get(f"/ui/plans/{mine['id']}").status_code == 404
        assert "team-a-model" not in client.get("/ui/catalog").text
        client.headers["authorization"] = f"Bearer {token_a}"
        assert mine["id"] in client.get("/ui/plans").text
        assert client.get(f"/ui/plans/{mine['id']}").status_code == 200
        assert "team-a-model" in client.get("/ui/catalog").text


def test_catalog_lists_models_and_hardware_with_counts_linking_to_their_plans(ui, solved) -> None:  # type: ignore[no-untyped-def]
    small, big = _trace(4, "small-model"), _trace(6, "big-model", device_gib=40)
    solved(ui, small, limit=64 * MiB)
    solved(ui, big, limit=64 * MiB)
    solved(ui, big, limit=72 * MiB)
    dom = Dom(ui.get("/ui/catalog").text)
    cells = [td.text.strip() for td in dom.all("td")]
    counts = {
        name: cells[cells.index(name) + 4 : cells.index(name) + 6] for name in ("big-model", "small-model")
    }
    assert counts == {"big-model": ["1", "2"], "small-model": ["1", "1"]}  # traces, plans
    assert len(dom.all("tr", "hardware-row")) == 2
    links = {a.attrs["href"] for a in dom.all("a")}
    assert f"/ui/plans?model={big.model.fingerprint}" in links
    assert any(h.startswith("/ui/plans?hardware=cuda%3A") for h in links)
