"""The /v1 API on SQLite and PostgreSQL: idempotent uploads, clean rejections, plans, history, feedback."""

from __future__ import annotations

import gzip
import json
import time

import pytest

from client.contract import PlanRecord, Trace
from planner_service.db.models import HardwareRow, ModelRow, TraceRow
from planner_service.solver.testing.synthetic import synthetic_trace
from tests.planner_service.rows import count_rows

LIMITS = {"device_memory_bytes": 16 * 2**30}


@pytest.fixture
def api_no_worker(settings):  # type: ignore[no-untyped-def]
    """The app with no worker: plans stay queued."""
    from fastapi.testclient import TestClient

    from planner_service.app import create_app

    with TestClient(create_app(settings, workers=0)) as client:
        yield client


def _upload(api, trace: Trace) -> str:  # type: ignore[no-untyped-def]
    r = api.post("/v1/traces", content=trace.canonical_json(), headers={"content-type": "application/json"})
    assert r.status_code in (200, 201), r.text
    return str(r.json()["id"])


def test_upload_returns_201_then_200_with_the_same_id(api, trace) -> None:  # type: ignore[no-untyped-def]
    first = api.post("/v1/traces", content=trace.canonical_json())
    again = api.post(
        "/v1/traces", content=gzip.compress(trace.canonical_json()), headers={"content-encoding": "gzip"}
    )
    assert first.status_code == 201 and first.json()["created"] is True
    assert again.status_code == 200 and again.json()["created"] is False
    assert again.json()["id"] == first.json()["id"]
    timing = dict(part.strip().split(";dur=") for part in first.headers["server-timing"].split(","))
    assert set(timing) == {"read", "ingest", "validate", "validate-cpu", "store"}
    assert all(float(v) >= 0 for v in timing.values())


def test_fetched_trace_is_identical_to_the_upload(api, trace) -> None:  # type: ignore[no-untyped-def]
    trace_id = _upload(api, trace)
    got = api.get(f"/v1/traces/{trace_id}").json()
    assert Trace.model_validate(got["trace"]) == trace
    assert got["content_hash"] == trace.content_hash()


def test_bad_upload_names_the_field_and_stores_nothing(api, trace, db_url) -> None:  # type: ignore[no-untyped-def]
    raw = json.loads(trace.canonical_json())
    raw["measurements"]["blocks"][2]["backward_s"] = -1.0
    r = api.post("/v1/traces", json=raw)
    assert r.status_code == 422
    assert r.json()["detail"][0]["field"] == "body.measurements.blocks[2].backward_s"
    for table in (TraceRow, ModelRow, HardwareRow):
        assert count_rows(db_url, table) == 0


def test_malformed_bodies_get_4xx(api) -> None:  # type: ignore[no-untyped-def]
    assert api.post("/v1/traces", content=b"{not json").status_code == 400
    assert api.post("/v1/traces", content=b"garbage", headers={"content-encoding": "gzip"}).status_code == 400
    assert api.post("/v1/traces", content=b"{}", headers={"content-encoding": "br"}).status_code == 415
    assert api.post("/v1/traces", json=[1, 2]).status_code == 422


def test_gzip_bomb_is_refused_with_413(api) -> None:  # type: ignore[no-untyped-def]
    bomb = gzip.compress(b" " * (300 * 2**20))  # ~300 KiB on the wire, 300 MiB inflated
    r = api.post("/v1/traces", content=bomb, headers={"content-encoding": "gzip"})
    assert r.status_code == 413
    assert "decompressed" in r.json()["error"]


def test_plan_is_solved_by_a_worker_and_long_poll_returns_it(api, trace) -> None:  # type: ignore[no-untyped-def]
    trace_id = _upload(api, trace)
    r = api.post("/v1/plans", json={"trace_id": trace_id, "constraints": LIMITS})
    assert r.status_code == 202 and r.json()["status"] == "queued"
    done = api.get(f"/v1/plans/{r.json()['id']}", params={"wait": 30}).json()
    assert done["status"] in ("done", "infeasible"), done
    plan = done["plan"]
    assert plan["trace_hash"] == trace.content_hash()
    assert plan["constraints"]["device_memory_bytes"] == LIMITS["device_memory_bytes"]
    assert done["attempts"] == 1 and done["finished_at"] is not None


def test_identical_request_reuses_the_stored_plan(api, trace) -> None:  # type: ignore[no-untyped-def]
    trace_id = _upload(api, trace)
    first = api.post("/v1/plans", json={"trace_id": trace_id, "constraints": LIMITS}).json()
    api.get(f"/v1/plans/{first['id']}", params={"wait": 30})
    again = api.post("/v1/plans", json={"trace_id": trace_id, "constraints": LIMITS})
    assert again.status_code == 200 and again.json()["reused"] is True and again.json()["id"] == first["id"]
    other = api.post("/v1/plans", json={"trace_id": trace_id, "constraints": {"device_memory_bytes": 2**33}})
    assert other.status_code == 202 and other.json()["id"] != first["id"]


def test_plan_request_errors_name_the_problem(api, trace) -> None:  # type: ignore[no-untyped-def]
    r = api.post("/v1/plans", json={"trace_id": "nope", "constraints": LIMITS})
    assert r.status_code == 404 and "trace_id" in r.json()["error"]
    trace_id = _upload(api, trace)
    r = api.post("/v1/plans", json={"trace_id": trace_id, "constraints": {"device_memory_bytes": -5}})
    assert r.status_code == 422 and r.json()["detail"][0]["field"] == "body.constraints.device_memory_bytes"
    r = api.post("/v1/plans", json={"trace_id": trace_id, "constraints": LIMITS, "solver": "magic"})
    assert r.status_code == 422 and r.json()["detail"][0]["field"] == "body.solver"
    assert api.get("/v1/plans/does-not-exist").status_code == 404


def test_plans_are_browsable_by_model_and_hardware_with_stable_cursors(api) -> None:  # type: ignore[no-untyped-def]
    ids_by_model: dict[str, set[str]] = {"small": set(), "wide": set()}
    for i in range(7):
        kind = "small" if i % 2 else "wide"
        t = synthetic_trace(
            n_blocks=2 + i, hidden=64 if kind == "small" else 128, vocab=100, name=f"model-{kind}"
        )
        tid = _upload(api, t)
        ids_by_model[kind].add(
            api.post("/v1/plans", json={"trace_id": tid, "constraints": LIMITS}).json()["id"]
        )
    seen: list[str] = []
    cursor = None
    while True:
        params = {"limit": 2, "model": "model-wide"} | ({"cursor": cursor} if cursor else {})
        page = api.get("/v1/plans", params=params).json()
        seen += [p["id"] for p in page["items"]]
        assert all(p["model_name"] == "model-wide" for p in page["items"])
        cursor = page["next_cursor"]
        if not cursor:
            break
    assert len(seen) == len(set(seen)) and set(seen) == ids_by_model["wide"]
    newest_first = api.get("/v1/plans", params={"limit": 100}).json()["items"]
    stamps = [(p["created_at"], p["id"]) for p in newest_first]
    assert stamps == sorted(stamps, reverse=True)
    oldest_first = api.get("/v1/plans", params={"limit": 100, "sort": "created_at"}).json()["items"]
    assert [p["id"] for p in oldest_first] == [p["id"] for p in reversed(newest_first)]
    hw = api.get("/v1/hardware").json()
    assert len(hw) == 1 and hw[0]["plans"] == 7
    by_hw = api.get("/v1/plans", params={"hardware": hw[0]["key"], "limit": 100}).json()["items"]
    assert len(by_hw) == 7
    plans_by_name: dict[str, int] = {}
    for m in api.get("/v1/models").json():  # each depth is its own architecture fingerprint
        plans_by_name[m["name"]] = plans_by_name.get(m["name"], 0) + m["plans"]
    assert plans_by_name == {"model-wide": 4, "model-small": 3}
    assert api.get("/v1/plans", params={"cursor": "!!bad"}).status_code == 400
    traces = api.get("/v1/traces", params={"model": "model-small", "limit": 100}).json()["items"]
    assert len(traces) == 3


def test_feedback_records_prediction_errors(api, trace) -> None:  # type: ignore[no-untyped-def]
    trace_id = _upload(api, trace)
    plan = api.post("/v1/plans", json={"trace_id": trace_id, "constraints": LIMITS}).json()
    done = api.get(f"/v1/plans/{plan['id']}", params={"wait": 30}).json()
    predicted = done["plan"]["predictions"]["iteration_s"]
    fb = {
        "iteration_s": predicted * 1.1,
        "peak_device_bytes": 1000,
        "peak_host_bytes": 0,
        "steps_measured": 20,
    }
    r = api.post(f"/v1/plans/{plan['id']}/feedback", json=fb)
    assert r.status_code == 201
    assert abs(r.json()["iteration_error"] - 0.1) < 1e-9
    assert api.get(f"/v1/plans/{plan['id']}").json()["feedback"][0]["feedback"]["steps_measured"] == 20
    bad = api.post(f"/v1/plans/{plan['id']}/feedback", json=fb | {"steps_measured": 0})
    assert bad.status_code == 422 and bad.json()["detail"][0]["field"] == "body.steps_measured"


def test_feedback_phases_are_checked_against_the_predicted_phases(api, trace) -> None:  # type: ignore[no-untyped-def]
    """An agent's measured phases (forward, the rest, optimizer.step(), uploads) are stored with each one's error
    against `Predictions.phases` of the plan; feedback without phases (an older agent) still posts, errors None."""
    from client.contract import Predictions

    trace_id = _upload(api, trace)
    plan = api.post("/v1/plans", json={"trace_id": trace_id, "constraints": LIMITS}).json()
    done = api.get(f"/v1/plans/{plan['id']}", params={"wait": 30}).json()
    predicted = Predictions.model_validate(done["plan"]["predictions"])
    want = predicted.phases()
    assert sum(want.values()) == pytest.approx(predicted.iteration_s)
    fb = {
        "iteration_s": predicted.iteration_s,
        "peak_device_bytes": 1000,
        "peak_host_bytes": 0,
        "steps_measured": 5,
    }
    phases = {
        "forward_s": want["forward_s"] * 1.25,
        "backward_s": want["backward_s"] * 0.5,
        "step_s": want["step_s"] + 0.001,
        "uploads_per_iteration": (predicted.uploads_per_iteration or 0.0) + 1.0,
    }
    r = api.post(f"/v1/plans/{plan['id']}/feedback", json=fb | {"phases": phases})
    assert r.status_code == 201, r.text
    errors = r.json()["phase_errors"]
    assert errors["forward_s"] == pytest.approx(0.25) and errors["backward_s"] == pytest.approx(-0.5)
    if want["step_s"] > 0:
        assert errors["step_s"] == pytest.approx(0.001 / want["step_s"])
    else:
        assert "step_s" not in errors  # nothing predicted: no relative error
    if predicted.uploads_per_iteration:
        assert errors["uploads_per_iteration"] == pytest.approx(1.0 / predicted.uploads_per_iteration)
    stored = api.get(f"/v1/plans/{plan['id']}").json()["feedback"][0]
    assert stored["feedback"]["phases"] == phases and stored["phase_errors"] == errors
    old = api.post(f"/v1/plans/{plan['id']}/feedback", json=fb)
    assert (
        old.status_code == 201
        and old.json()["phase_errors"] is None
        and old.json()["feedback"]["phases"] is None
    )
    for field, value in (("forward_s", -1.0), ("step_s", "fast"), ("uploads_per_iteration", float("1e12"))):
        bad = api.post(f"/v1/plans/{plan['id']}/feedback", json=fb | {"phases": phases | {field: value}})
        assert bad.status_code == 422 and bad.json()["detail"][0]["field"] == f"body.phases.{field}", bad.text
    extra = api.post(f"/v1/plans/{plan['id']}/feedback", json=fb | {"phases": phases | {"surprise": 1}})
    assert extra.status_code == 422
    assert len(api.get(f"/v1/plans/{plan['id']}").json()["feedback"]) == 2  # the rejected ones left nothing


def test_health_and_readiness(api) -> None:  # type: ignore[no-untyped-def]
    assert api.get("/healthz").json() == {"status": "ok"}
    assert api.get("/readyz").json()["status"] == "ready"


def test_openapi_document_describes_the_trace_body(api) -> None:  # type: ignore[no-untyped-def]
    doc = api.get("/openapi.json").json()
    body = doc["paths"]["/v1/traces"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/Trace"}
    assert "Hardware" in doc["components"]["schemas"]


def test_plan_polling_revalidates_with_the_entity_tag(api, trace) -> None:  # type: ignore[no-untyped-def]
    """An unchanged plan answers If-None-Match with 304 and no body; any change (feedback) gets a new tag."""
    trace_id = _upload(api, trace)
    plan_id = api.post("/v1/plans", json={"trace_id": trace_id, "constraints": LIMITS}).json()["id"]
    done = api.get(f"/v1/plans/{plan_id}", params={"wait": 30})
    tag = done.headers["etag"]
    record = PlanRecord.model_validate(done.json())  # the spliced body is a valid record, its plan intact
    assert record.plan is not None and record.plan.trace_hash == trace.content_hash()
    assert (
        api.get(f"/v1/plans/{plan_id}").headers["etag"] == tag
        and api.get(f"/v1/plans/{plan_id}").json() == done.json()
    )
    same = api.get(f"/v1/plans/{plan_id}", headers={"if-none-match": tag})
    assert same.status_code == 304 and same.content == b"" and same.headers["etag"] == tag
    assert api.get(f"/v1/plans/{plan_id}", headers={"if-none-match": f'"other", W/{tag}'}).status_code == 304
    fb = {"iteration_s": 1.0, "peak_device_bytes": 1000, "peak_host_bytes": 0, "steps_measured": 20}
    assert api.post(f"/v1/plans/{plan_id}/feedback", json=fb).status_code == 201
    changed = api.get(f"/v1/plans/{plan_id}", headers={"if-none-match": tag})
    assert changed.status_code == 200 and changed.headers["etag"] != tag
    assert len(changed.json()["feedback"]) == 1
    other = api.get("/v1/plans/nope", headers={"if-none-match": tag})
    assert other.status_code == 404


def test_long_poll_with_a_current_tag_waits_then_answers_304(api_no_worker, trace) -> None:  # type: ignore[no-untyped-def]
    trace_id = _upload(api_no_worker, trace)
    queued = api_no_worker.post("/v1/plans", json={"trace_id": trace_id, "constraints": LIMITS})
    tag = api_no_worker.get(f"/v1/plans/{queued.json()['id']}").headers["etag"]
    t0 = time.monotonic()
    r = api_no_worker.get(
        f"/v1/plans/{queued.json()['id']}", params={"wait": 0.5}, headers={"if-none-match": tag}
    )
    assert r.status_code == 304 and time.monotonic() - t0 >= 0.45
    plain = api_no_worker.get(f"/v1/plans/{queued.json()['id']}", params={"wait": 0.3})
    assert plain.status_code == 200 and plain.json()["status"] == "queued" and plain.headers["etag"] == tag


def test_lists_carry_headlines_and_whole_plans_only_when_asked(api, trace, db_url) -> None:  # type: ignore[no-untyped-def]
    """A page of plans with allocations would be megabytes each: lists carry the predictions and the solver
    report (headline); `with_plan=true` adds the whole plans. The headline survives a migration round trip
    (migration 0004 fills it from the stored plan, as `finish` writes it)."""
    from planner_service.db.migrate import downgrade, upgrade

    plan_id = api.post("/v1/plans", json={"trace_id": _upload(api, trace), "constraints": LIMITS}).json()[
        "id"
    ]
    done = api.get(f"/v1/plans/{plan_id}", params={"wait": 30}).json()
    assert done["status"] == "done" and done["plan"] is not None
    (item,) = api.get("/v1/plans").json()["items"]
    assert item["plan"] is None
    head = item["headline"]
    assert head["solver"] == done["plan"]["solver"]
    assert head["predictions"]["iteration_s"] == done["plan"]["predictions"]["iteration_s"]
    assert (
        "device_memory_timeline" not in head["predictions"]
        or not head["predictions"]["device_memory_timeline"]
    )
    (full,) = api.get("/v1/plans", params={"with_plan": "true"}).json()["items"]
    assert full["plan"] == done["plan"] and full["headline"] == head
    assert done["headline"] == head  # the single GET carries it too
    downgrade(db_url, "0003")
    upgrade(db_url)
    (again,) = api.get("/v1/plans").json()["items"]
    assert again["headline"] == head


def test_lists_filter_by_id_prefix_and_refuse_anything_but_hex(api, trace) -> None:  # type: ignore[no-untyped-def]
    trace_id = _upload(api, trace)
    plan_id = api.post("/v1/plans", json={"trace_id": trace_id, "constraints": LIMITS}).json()["id"]
    assert [t["id"] for t in api.get("/v1/traces", params={"id_prefix": trace_id[:5]}).json()["items"]] == [
        trace_id
    ]
    assert [p["id"] for p in api.get("/v1/plans", params={"id_prefix": plan_id[:12]}).json()["items"]] == [
        plan_id
    ]
    other = "0" if plan_id[0] != "0" else "1"
    assert api.get("/v1/plans", params={"id_prefix": other + plan_id[1:]}).json()["items"] == []
    for bad in ("%", "_", "ABC", "x" * 3, "0" * 33):  # LIKE wildcards never reach the query
        r = api.get("/v1/plans", params={"id_prefix": bad})
        assert r.status_code == 422 and "id_prefix" in r.text, (bad, r.text)


def test_lists_filter_by_status_and_refuse_a_status_that_is_not_one(api_no_worker, trace) -> None:  # type: ignore[no-untyped-def]
    """The status filter is the contract's `PlanStatus`: a queued plan is found under queued, not under done;
    an unknown status is a 422 naming the parameter."""
    api = api_no_worker
    trace_id = _upload(api, trace)
    plan_id = api.post("/v1/plans", json={"trace_id": trace_id, "constraints": LIMITS}).json()["id"]
    assert [p["id"] for p in api.get("/v1/plans", params={"status": "queued"}).json()["items"]] == [plan_id]
    assert api.get("/v1/plans", params={"status": "done"}).json()["items"] == []
    r = api.get("/v1/plans", params={"status": "paused"})
    assert r.status_code == 422 and "status" in r.text, r.text


def test_a_cpu_machine_is_listed_with_its_ram_not_the_limit_a_job_set(api, trace) -> None:  # type: ignore[no-untyped-def]
    from client.contract import DeviceType

    hw = trace.hardware.model_copy(
        update={
            "device_type": DeviceType.cpu,
            "device_name": "AMD EPYC",
            "device_memory_bytes": 200 * 2**20,
            "host_memory_bytes": 64 * 2**30,
        }
    )
    _upload(api, trace.model_copy(update={"hardware": hw}))
    [row] = [h for h in api.get("/v1/hardware").json() if h["device_type"] == "cpu"]
    assert row["key"] == "cpu:AMD EPYC:64GiB:x1" and row["device_memory_bytes"] == 64 * 2**30


def test_a_managed_allocation_of_no_iteration_is_refused_and_the_plan_keeps_its_own(api, trace) -> None:  # type: ignore[no-untyped-def]
    """Managed events with no buffer, or allocated in a block the plan does not have, are 422 naming the field;
    the plan's stored allocation and entity tag do not change."""
    trace_id = _upload(api, trace)
    pid = api.post("/v1/plans", json={"trace_id": trace_id, "constraints": LIMITS}).json()["id"]
    before = api.get(f"/v1/plans/{pid}", params={"wait": 30})
    assert before.json()["status"] == "done"
    n_blocks = len(before.json()["plan"]["policy"]["blocks"])
    event = {
        "id": 0,
        "size_bytes": 512,
        "alloc_index": 0,
        "free_index": 1,
        "category": "temp",
        "phase": "forward",
    }
    empty = api.put(
        f"/v1/plans/{pid}/allocation", json={"source": "dispatch_tracker", "horizon": 1, "events": []}
    )
    assert empty.status_code == 422 and "allocation_trace: has no events" in empty.text
    beyond = api.put(
        f"/v1/plans/{pid}/allocation",
        json={
            "source": "dispatch_tracker",
            "horizon": 2,
            "events": [event, {**event, "id": 1, "block": n_blocks}],
        },
    )
    assert beyond.status_code == 422 and f"events[1].block: {n_blocks} names no block" in beyond.text
    after = api.get(f"/v1/plans/{pid}")
    assert after.headers["etag"] == before.headers["etag"]
    assert after.json()["plan"]["allocation"] == before.json()["plan"]["allocation"]
    fine = api.put(
        f"/v1/plans/{pid}/allocation",
        json={
            "source": "dispatch_tracker",
            "horizon": 2,
            "events": [event, {**event, "id": 1, "block": n_blocks - 1}],
        },
    )
    assert fine.status_code == 200, fine.text
