"""Multi-rank jobs in the service (issue 20), on SQLite and PostgreSQL: the process group is part of the
hardware key and of the plan cache key, history filters by it, and a bad group field is a 422 naming it."""

from __future__ import annotations

import json

from client.contract import Trace
from planner_service.solver.testing.synthetic import synthetic_distributed, synthetic_trace, with_distributed

LIMITS = {"device_memory_bytes": 8 * 2**30}


def _traces() -> dict[tuple[int, int], Trace]:
    base = synthetic_trace(n_blocks=3, hidden=64, vocab=100, batch=1, seq=16)
    return {
        (1, 1): base,
        (2, 2): with_distributed(base, synthetic_distributed(2, 2)),
        (4, 2): with_distributed(base, synthetic_distributed(4, 2)),
    }


def _upload(api, trace: Trace) -> str:  # type: ignore[no-untyped-def]
    r = api.post("/v1/traces", content=trace.canonical_json(), headers={"content-type": "application/json"})
    assert r.status_code in (200, 201), r.text
    return str(r.json()["id"])


def _plan(api, trace_id: str) -> dict:  # type: ignore[no-untyped-def]
    r = api.post("/v1/plans", json={"trace_id": trace_id, "constraints": LIMITS})
    assert r.status_code in (200, 202), r.text
    return dict(r.json())


def test_group_is_in_the_hardware_key_and_history_filters_by_it(api) -> None:  # type: ignore[no-untyped-def]
    ids = {group: _upload(api, t) for group, t in _traces().items()}
    plans = {group: _plan(api, i)["id"] for group, i in ids.items()}
    hardware = {h["key"]: h for h in api.get("/v1/hardware").json()}
    assert len(hardware) == 3
    by_group = {(h["world_size"], h["ranks_per_node"]): k for k, h in hardware.items()}
    assert by_group[(1, 1)] == "cuda:Synthetic GPU (modelled):80GiB:x1"
    assert by_group[(2, 2)].endswith(":x1:w2r2") and by_group[(4, 2)].endswith(":x1:w4r2")

    def listed(path: str, **params: int) -> set[str]:
        r = api.get(path, params=params)
        assert r.status_code == 200, r.text
        return {item["id"] for item in r.json()["items"]}

    assert listed("/v1/traces", world_size=2) == {ids[(2, 2)]}
    assert listed("/v1/traces", ranks_per_node=2) == {ids[(2, 2)], ids[(4, 2)]}
    assert listed("/v1/traces", world_size=1) == {ids[(1, 1)]}
    assert listed("/v1/traces") == set(ids.values())
    assert listed("/v1/plans", world_size=4) == {plans[(4, 2)]}
    assert listed("/v1/plans", world_size=4, ranks_per_node=4) == set()
    assert listed("/v1/plans", world_size=1) == {plans[(1, 1)]}
    # with the hardware filter too (the join does not duplicate or drop rows)
    assert listed("/v1/plans", world_size=2, hardware=by_group[(2, 2)]) == {plans[(2, 2)]}
    for bad in ({"world_size": 0}, {"ranks_per_node": -1}, {"world_size": "two"}):
        r = api.get("/v1/plans", params=bad)
        assert r.status_code == 422 and next(iter(bad)) in r.text, r.text


def test_plan_cache_key_separates_world_sizes_and_reuses_within_one(api) -> None:  # type: ignore[no-untyped-def]
    traces = _traces()
    one, two = _upload(api, traces[(1, 1)]), _upload(api, traces[(2, 2)])
    first_one, first_two = _plan(api, one), _plan(api, two)
    assert first_one["id"] != first_two["id"] and not first_two["reused"]
    again = _plan(api, two)
    assert again["reused"] and again["id"] == first_two["id"]
    done = api.get(f"/v1/plans/{first_two['id']}", params={"wait": 60}).json()
    assert done["status"] == "done", done
    policy = done["plan"]["policy"]
    assert policy["world_size"] == 2
    assert done["plan"]["predictions"]["breakdown"]["world_size"] == 2.0


def test_single_process_request_keys_are_unchanged() -> None:
    from client.contract import Constraints, Objective
    from planner_service.db.repositories import request_key

    cons = Constraints(device_memory_bytes=2**30)
    # the key every stored single-process plan was cached under (before process groups existed)
    import hashlib

    blob = json.dumps(["h", cons.model_dump(mode="json"), "min_iteration_time", "cpsat", "v"], sort_keys=True)
    assert (
        request_key("h", cons, Objective.min_iteration_time, "cpsat", "v")
        == hashlib.sha256(blob.encode()).hexdigest()
    )
    assert request_key("h", cons, Objective.min_iteration_time, "cpsat", "v", (2, 2)) != request_key(
        "h", cons, Objective.min_iteration_time, "cpsat", "v", (2, 1)
    )


def test_a_bad_process_group_upload_is_a_422_naming_the_field(api) -> None:  # type: ignore[no-untyped-def]
    raw = json.loads(_traces()[(2, 2)].canonical_json())
    raw["hardware"]["distributed"]["ranks_per_node"] = 3
    r = api.post("/v1/traces", json=raw)
    assert r.status_code == 422, r.text
    assert r.json()["detail"][0]["field"] == "body.hardware.distributed"
    assert "ranks_per_node: 3 is more than world_size 2" in r.json()["detail"][0]["message"]
    raw = json.loads(_traces()[(2, 2)].canonical_json())
    raw["hardware"]["distributed"]["collectives"]["all_gather"][0]["bytes_per_s"] = 0
    r = api.post("/v1/traces", json=raw)
    assert r.status_code == 422
    assert r.json()["detail"][0]["field"] == "body.hardware.distributed.collectives.all_gather[0].bytes_per_s"
    assert api.get("/v1/traces").json()["items"] == []


def test_a_multi_rank_plan_says_which_chunks_are_sharded_when_shown() -> None:
    from rich.console import Console

    from client.cli.render import plan_table
    from client.contract import Constraints
    from planner_service.solver import solve

    trace = _traces()[(2, 2)]
    plan = solve(trace, Constraints(device_memory_bytes=64 * 2**20))
    assert plan.policy is not None and plan.policy.world_size == 2
    console = Console(width=200, record=True)
    console.print(plan_table(plan))
    text = console.export_text()
    n = len(plan.policy.sharded_chunks)
    assert f"planned for 2 ranks: {n} of {len(plan.policy.chunks)} chunks sharded" in text
    single = solve(_traces()[(1, 1)], Constraints(device_memory_bytes=64 * 2**20))
    console = Console(width=200, record=True)
    console.print(plan_table(single))
    assert "planned for" not in console.export_text()
