"""Large uploads are validated in the ingest process pool with the same answers as inline validation."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys

from fastapi.testclient import TestClient

from client.contract import Trace
from planner_service.app import create_app
from planner_service.ingest import Ingestor, InvalidTrace, TraceFacts, inspect
from planner_service.settings import Settings
from tests.client.contract.forms import schema_1, trace_with_events


def test_pool_path_stores_validates_and_rejects_like_the_inline_path(
    settings: Settings, trace: Trace
) -> None:
    pooled = settings.model_copy(update={"ingest_processes": 1, "ingest_inline_max_bytes": 0})
    with TestClient(create_app(pooled)) as api:
        r = api.post(
            "/v1/traces", content=gzip.compress(trace.canonical_json()), headers={"content-encoding": "gzip"}
        )
        assert r.status_code == 201 and r.json()["content_hash"] == trace.content_hash()
        assert Trace.model_validate(api.get(f"/v1/traces/{r.json()['id']}").json()["trace"]) == trace
        bad = json.loads(trace.canonical_json())
        bad["workload"]["batch_size"] = 0
        r = api.post("/v1/traces", json=bad)
        assert r.status_code == 422 and r.json()["detail"][0]["field"] == "body.workload.batch_size"
        assert api.post("/v1/traces", content=b"{oops").status_code == 400


def test_an_ingest_process_that_died_is_replaced_and_the_upload_stored(
    settings: Settings, trace: Trace
) -> None:
    """Defect: a pool process killed (the OOM killer, an operator) left the pool broken for good: every later
    large upload was a 500 ("A child process terminated abruptly") until the service restarted."""
    pooled = settings.model_copy(update={"ingest_processes": 1, "ingest_inline_max_bytes": 0})
    with TestClient(create_app(pooled)) as api:
        ingestor: Ingestor = api.app.state.ingestor  # type: ignore[attr-defined]
        assert ingestor._executor().submit(os.getpid).result(timeout=60)  # the pool is up
        (dead,) = ingestor._executor()._processes.values()
        dead.kill()
        dead.join(30)
        r = api.post("/v1/traces", content=trace.canonical_json())
        assert r.status_code == 201, r.text
        assert r.json()["content_hash"] == trace.content_hash()
        (fresh,) = ingestor._executor()._processes.values()
        assert fresh.pid != dead.pid and fresh.is_alive()


def test_a_schema_1_upload_is_stored_in_the_current_form_under_the_same_hash(settings: Settings) -> None:
    current = trace_with_events()
    with TestClient(create_app(settings)) as api:
        body = gzip.compress(json.dumps(schema_1(current)).encode())
        r = api.post("/v1/traces", content=body, headers={"content-encoding": "gzip"})
        assert r.status_code == 201 and r.json()["content_hash"] == current.content_hash()
        stored = api.get(f"/v1/traces/{r.json()['id']}").json()["trace"]
        assert stored["schema_version"] == 2 and "event_arrays" in stored["allocation_trace"]
        assert Trace.model_validate(stored) == current
        again = api.post(
            "/v1/traces",
            content=gzip.compress(current.canonical_json()),
            headers={"content-encoding": "gzip"},
        )
        assert again.json()["id"] == r.json()["id"]  # the same trace in either form is stored once
    facts = inspect(json.dumps(schema_1(current)).encode(), False, 2**30)
    assert gzip.decompress(facts.payload_gzip) == current.canonical_json()


def test_facts_hash_is_the_trace_content_hash(trace: Trace) -> None:
    facts = inspect(trace.canonical_json(), False, 2**30)
    assert facts == TraceFacts.of(trace)
    assert (
        facts.content_hash == trace.content_hash()
        and gzip.decompress(facts.payload_gzip) == trace.canonical_json()
    )
    raw = json.loads(trace.canonical_json())
    raw["model"]["blocks"][0]["index"] = True
    try:
        inspect(json.dumps(raw).encode(), False, 2**30)
    except InvalidTrace as exc:
        assert exc.errors[0]["loc"][:3] == ["model", "blocks", 0]
    else:
        raise AssertionError("a boolean index must be rejected")


def test_ingest_processes_run_below_request_handling_and_exit_with_the_ingestor() -> None:
    ingestor = Ingestor(processes=1, inline_max_bytes=0, niceness=7)
    pool = ingestor._executor()
    assert pool.submit(os.nice, 0).result(timeout=60) == min(19, os.nice(0) + 7)
    children = list(pool._processes.values())
    ingestor.close()
    assert children and all(not p.is_alive() for p in children)  # none outlives the API process


def test_ingest_processes_import_only_the_contract() -> None:
    """An ingest process imports `planner_service.ingest` at start; the web framework, the ORM and the solver
    stay out (importing FastAPI there once cost the first upload per process ~0.8 s)."""
    code = (
        "import sys, planner_service.ingest; "
        "bad=[m for m in ('fastapi','starlette','sqlalchemy','ortools','torch') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
