"""`memplan plans list --world-size N` / `traces list --ranks-per-node R` against the real `memplan serve`
(issue 20): the history of multi-rank jobs, filtered by their process group."""

from __future__ import annotations

import json

from client.contract import Constraints
from client.sdk import Client
from planner_service.solver.testing.synthetic import synthetic_distributed, synthetic_trace, with_distributed
from tests.memplan.e2e.test_cli_e2e import _memplan, served  # noqa: F401  (`served` is the server fixture)


def test_plans_and_traces_list_filter_by_world_size_and_ranks_per_node(served: dict[str, str]) -> None:  # noqa: F811
    base = synthetic_trace(n_blocks=2, hidden=64, vocab=100, name="ranks-model")
    ids = {}
    with Client(served["MEMPLAN_SERVER"]) as c:
        for world in (1, 2):
            trace = base if world == 1 else with_distributed(base, synthetic_distributed(2, 2))
            tid = c.upload_trace(trace).id
            ids[world] = (tid, c.request_plan(tid, Constraints(device_memory_bytes=8 * 2**30)).id)
    listed = json.loads(_memplan("plans", "list", "--world-size", "2", "--json", env=served).stdout)
    assert [p["id"] for p in listed] == [ids[2][1]]
    assert listed[0]["hardware_key"].endswith(":w2r2")
    single = json.loads(_memplan("plans", "list", "--world-size", "1", "--json", env=served).stdout)
    assert [p["id"] for p in single] == [ids[1][1]]
    table = _memplan("traces", "list", "--ranks-per-node", "2", env=served).stdout
    assert ids[2][0][:12] in table and ids[1][0][:12] not in table and "ranks per node 2" in table
    bad = _memplan("plans", "list", "--world-size", "0", env=served, check=False)
    assert bad.returncode != 0 and "world-size" in bad.stderr
    hardware = json.loads(_memplan("hardware", "--json", env=served).stdout)
    assert sorted((h["world_size"], h["ranks_per_node"]) for h in hardware) == [(1, 1), (2, 2)]
