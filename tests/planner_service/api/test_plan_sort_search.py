"""GET /v1/plans sorted by any column and searched, on a real server on loopback, SQLite and PostgreSQL; the
SDK and `memplan plans list --sort --search` through the same server; hostile sort, search and cursors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from client.contract import Constraints, Feedback
from client.sdk import Client
from planner_service.embedded import EmbeddedServer
from planner_service.solver.testing.synthetic import synthetic_trace

MiB = 2**20
# (model name, measured / predicted iteration, notes): None: no feedback
PLANS: list[tuple[str, float | None, str]] = [
    ("llama-7b-like", 1.30, "first run on the rig"),
    ("llama-13b-like", 0.90, "dataloader stalls"),
    ("qwen2-small", 1.05, "clean"),
    ("gpt2_100%_wild", None, ""),
]


@pytest.fixture
def served(settings) -> Iterator[tuple[str, dict[str, dict[str, Any]]]]:  # type: ignore[no-untyped-def]
    """A real server with one solved plan per PLANS row (by model name), feedback posted as the row says."""
    with EmbeddedServer(settings) as url, Client(url) as c:
        made: dict[str, dict[str, Any]] = {}
        for i, (name, ratio, notes) in enumerate(PLANS):
            trace = synthetic_trace(n_blocks=3 + i, hidden=256, vocab=1000, batch=2, seq=128, name=name)
            tid = c.upload_trace(trace).id
            pid = c.request_plan(tid, Constraints(device_memory_bytes=(48 + 8 * i) * MiB)).id
            record = c.wait_for_plan(pid, timeout_s=120)
            assert record.plan is not None and record.plan.predictions is not None, record
            pred = record.plan.predictions
            if ratio is not None:
                c.post_feedback(
                    pid,
                    Feedback(
                        iteration_s=pred.iteration_s * ratio,
                        peak_device_bytes=int(pred.peak_device_bytes * (2 - ratio)),
                        peak_host_bytes=pred.peak_host_bytes,
                        steps_measured=5,
                        notes=notes,
                    ),
                )
            made[name] = {"id": pid, "ratio": ratio, "pred": pred}
        yield url, made


def _all_pages(url: str, **params: Any) -> list[dict[str, Any]]:
    """Every item of the list, one plan per page (every cursor exercised)."""
    items, cursor = [], None
    for _ in range(20):
        q = {**params, "limit": 1, **({"cursor": cursor} if cursor else {})}
        r = httpx.get(f"{url}/v1/plans", params=q)
        assert r.status_code == 200, r.text
        body = r.json()
        items += body["items"]
        cursor = body["next_cursor"]
        if cursor is None:
            return items
    raise AssertionError("pagination did not end")


def test_sort_by_measured_error_and_other_columns_pages_through_every_plan_once(served) -> None:  # type: ignore[no-untyped-def]
    url, made = served
    by_id = {m["id"]: name for name, m in made.items()}
    measured = sorted(
        (n for n, m in made.items() if m["ratio"] is not None), key=lambda n: abs(made[n]["ratio"] - 1)
    )
    unmeasured = [n for n, m in made.items() if m["ratio"] is None]

    up = _all_pages(url, sort="error")
    assert [by_id[i["id"]] for i in up] == measured + unmeasured  # smallest error first, unmeasured last
    down = _all_pages(url, sort="-error")
    assert [by_id[i["id"]] for i in down] == measured[::-1] + unmeasured  # nulls last both ways
    for item in up:  # the measured-error column: the latest feedback's measured / predicted - 1
        ratio = made[by_id[item["id"]]]["ratio"]
        if ratio is None:
            assert item["iteration_error"] is None and item["peak_device_error"] is None
        else:
            assert item["iteration_error"] == pytest.approx(ratio - 1, rel=1e-9)
            assert item["peak_device_error"] == pytest.approx(1 - ratio, abs=1e-6)

    names = [by_id[i["id"]] for i in _all_pages(url, sort="-model")]
    assert names == sorted(made, reverse=True)
    preds = [made[by_id[i["id"]]]["pred"].iteration_s for i in _all_pages(url, sort="iteration")]
    assert preds == sorted(preds)
    default = [i["id"] for i in _all_pages(url)]  # the created_at cursors keep working
    assert default == [made[n]["id"] for n in reversed(list(made))]


def test_search_matches_names_notes_and_id_prefixes_with_wildcards_taken_literally(served) -> None:  # type: ignore[no-untyped-def]
    url, made = served

    def found(search: str, **extra: Any) -> set[str]:
        r = httpx.get(f"{url}/v1/plans", params={"search": search, **extra})
        assert r.status_code == 200, r.text
        by_id = {m["id"]: n for n, m in made.items()}
        return {by_id[i["id"]] for i in r.json()["items"]}

    assert found("llama") == {"llama-7b-like", "llama-13b-like"}
    assert found("LLAMA 13b") == {"llama-13b-like"}  # every word, any case
    assert found("stalls") == {"llama-13b-like"}  # a feedback note
    assert found(made["qwen2-small"]["id"][:10]) == {"qwen2-small"}  # an id prefix
    assert found("%") == {"gpt2_100%_wild"}  # LIKE's wildcards are escaped
    assert found("_") == {"gpt2_100%_wild"}
    assert found("cuda") == set(made)  # the hardware key
    assert found("llama", sort="-error") == {"llama-7b-like", "llama-13b-like"}
    assert found("no-such-thing") == set()


def test_sdk_and_cli_list_with_the_services_sort_and_search(served) -> None:  # type: ignore[no-untyped-def]
    url, made = served
    with Client(url) as c:
        rows = list(c.list_plans(sort="-error", search="llama", limit=1))
    assert [r.id for r in rows] == [made["llama-7b-like"]["id"], made["llama-13b-like"]["id"]]
    out = subprocess.run(
        [sys.executable, "-m", "memplan", "plans", "list", "--sort=-error", "--search", "llama", "--json"],
        env={**os.environ, "MEMPLAN_SERVER": url},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    listed = json.loads(out.stdout)
    assert [r["id"] for r in listed] == [made["llama-7b-like"]["id"], made["llama-13b-like"]["id"]]
    assert listed[0]["iteration_error"] == pytest.approx(0.30, rel=1e-9)
    table = subprocess.run(
        [sys.executable, "-m", "memplan", "plans", "list", "--sort", "error"],
        env={**os.environ, "MEMPLAN_SERVER": url, "COLUMNS": "240"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert table.returncode == 0, table.stderr
    assert "+5.0%" in table.stdout and "+30.0%" in table.stdout and "sort error" in table.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "memplan", "plans", "list", "--sort", "colour"],
        env={**os.environ, "MEMPLAN_SERVER": url},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 1 and "sort" in bad.stderr


def _fields(r: httpx.Response) -> set[str]:
    return {d["field"] for d in r.json()["detail"]}


def test_hostile_sort_search_and_cursors_are_4xx_naming_the_parameter(served) -> None:  # type: ignore[no-untyped-def]
    url, made = served
    for params, field in (
        ({"sort": "colour"}, "query.sort"),
        ({"sort": "--error"}, "query.sort"),
        ({"sort": "error; DROP TABLE plan"}, "query.sort"),
        ({"search": "llama\x00"}, "query.search"),
        ({"search": "x" * 10_000}, "query.search"),
    ):
        r = httpx.get(f"{url}/v1/plans", params=params)
        assert r.status_code == 422 and field in _fields(r), (params, r.status_code, r.text)
    r = httpx.get(f"{url}/v1/plans", params={"search": " ".join("w" * 9)})
    assert r.status_code == 422 and r.json()["error"].startswith("search:"), r.text
    model_cursor = httpx.get(f"{url}/v1/plans", params={"sort": "model", "limit": 1}).json()["next_cursor"]
    assert model_cursor
    for sort in ("error", "created_at", "-model"):  # another sort's cursor (or direction is fine: same key)
        r = httpx.get(f"{url}/v1/plans", params={"sort": sort, "cursor": model_cursor})
        expected = 200 if sort == "-model" else 400
        assert r.status_code == expected, (sort, r.text)
        if expected == 400:
            assert r.json()["error"].startswith("cursor:")
    for page in ("/ui/plans?sort=colour", "/ui/plans?search=a%00b", f"/ui/plans?search={'w ' * 9}"):
        r = httpx.get(url + page)
        assert r.status_code == 400 and ("sort" in r.text or "search" in r.text), (page, r.status_code)
    assert len(httpx.get(f"{url}/v1/plans").json()["items"]) == len(made)


def test_the_clis_sort_keys_are_the_services() -> None:
    """`memplan plans list --sort` lists the keys in its help; the service checks them (one implementation)."""
    from client.cli.remote import PLAN_SORT_KEYS as CLI_KEYS
    from planner_service.db.repositories import PLAN_SORT_KEYS

    assert CLI_KEYS == PLAN_SORT_KEYS
