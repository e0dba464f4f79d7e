"""Operations: Prometheus metrics, JSON logs carrying request ids, readiness."""

from __future__ import annotations

import json
import logging

from planner_service.observability import JsonFormatter, request_id_var


def test_metrics_expose_latency_queue_depth_solves_and_outcomes(api, trace) -> None:  # type: ignore[no-untyped-def]
    tid = api.post("/v1/traces", content=trace.canonical_json()).json()["id"]
    pid = api.post("/v1/plans", json={"trace_id": tid, "constraints": {"device_memory_bytes": 2**34}}).json()[
        "id"
    ]
    api.get(f"/v1/plans/{pid}", params={"wait": 30})
    text = api.get("/metrics").text
    assert (
        'memplan_http_request_seconds_bucket{le="0.001",method="POST",route="/v1/traces",status="201"}'
        in text
    )
    assert "memplan_plan_queue_depth 0.0" in text
    assert 'memplan_solve_seconds_count{solver="cpsat"}' in text
    assert "memplan_plan_outcomes_total{" in text


def test_responses_carry_the_request_id(api) -> None:  # type: ignore[no-untyped-def]
    assert api.get("/healthz", headers={"x-request-id": "abc123"}).headers["x-request-id"] == "abc123"
    assert len(api.get("/healthz").headers["x-request-id"]) == 32


def test_json_log_lines_carry_request_id_and_extra_fields() -> None:
    token = request_id_var.set("rid-1")
    try:
        record = logging.LogRecord("memplan.x", logging.INFO, __file__, 1, "solved %s", ("p1",), None)
        record.plan_id = "p1"
        line = json.loads(JsonFormatter().format(record))
    finally:
        request_id_var.reset(token)
    assert line["message"] == "solved p1" and line["request_id"] == "rid-1" and line["plan_id"] == "p1"


def test_readyz_reports_an_unreachable_database(settings) -> None:  # type: ignore[no-untyped-def]
    from fastapi.testclient import TestClient

    from planner_service.app import create_app

    with TestClient(create_app(settings)) as api:
        from planner_service.db.session import Database

        api.app.state.db.dispose()
        api.app.state.db = Database(
            "postgresql+psycopg://nobody@127.0.0.1:1/none"
        )  # nothing listens on port 1
        r = api.get("/readyz")
        assert r.status_code == 503 and r.json()["status"] == "unavailable"
        assert api.get("/healthz").status_code == 200
