"""`agent.wrap` under a process group plans for the group (issue 20): every rank measures the group's
collectives, every rank profiles and the job's trace (the slowest rank's) carries them (world size 2, measured all-gather and reduce-scatter),
the planner (in-process or the service) solves a 2-rank plan, and every rank receives the same plan.

Before this, rank 0 profiled a single-rank trace: the plan said world size 1 (no sharding, no collective in its
prediction) and the service's history keyed a multi-rank job's plan as a single-process one. Gloo on CPU, two
forked ranks (`ddp_jobs.spawn`); each rank also trains with DDP and with memplan and the two must agree.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from ddp_jobs import Case, free_port, spawn
from test_ddp_equivalence import check

from agent.profiler.collectives import SMALLEST_SIZE, ProbeSettings
from client.contract import CollectiveBackend, Hardware, Plan
from client.sdk import Client
from planner_service.embedded import EmbeddedServer

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from planner_service.settings import (
        Settings,
    )  # local import: the service's settings, as test_service_path

    db = tmp_path_factory.mktemp("svc") / "memplan.db"
    with EmbeddedServer(Settings(database_url=f"sqlite:///{db}", workers=1)) as url:
        yield url


def planned_for_two_ranks(results: list[dict[str, Any]]) -> Plan:
    """(a) the job's trace says world size 2 with measured collectives, (b) every rank holds the
    same plan, (c) the plan is a 2-rank plan; returns the plan."""
    hw = Hardware.model_validate_json(results[0]["trace_hardware"])
    d = hw.distributed
    assert d is not None and (d.world_size, d.ranks_per_node) == (2, 2)
    assert hw.key.endswith(":x2:w2r2")
    assert d.interconnect is not None and d.interconnect.backend == CollectiveBackend.gloo
    c = d.collectives
    assert c is not None and c.all_gather and c.reduce_scatter
    assert all(0 < s.bytes_per_s for s in c.all_gather + c.reduce_scatter)
    assert {(o.collective, o.direction) for o in c.copy_overlap} == {
        ("all_gather", "h2d"),
        ("reduce_scatter", "d2h"),
    }
    # sized to the model: the small models here never measure the 128 MiB default
    assert max(s.size_bytes for s in c.all_gather) <= 16 * 2**20
    assert results[0]["plan"] == results[1]["plan"]
    plan = Plan.model_validate_json(results[0]["plan"])
    assert plan.policy is not None and plan.policy.world_size == 2
    assert {res["plan_origin"] for res in results} == {results[0]["plan_origin"]}
    return plan


def test_rank_zero_solves_in_process_a_plan_for_both_ranks(tmp_path: Path) -> None:
    results = spawn(Case(kind="gpt2", steps=2, solve=True), 2, tmp_path)
    planned_for_two_ranks(results)
    assert results[0]["plan_origin"] == "embedded"
    check(results)


def test_the_service_gets_the_two_rank_trace_and_history_keeps_it_apart(service: str, tmp_path: Path) -> None:
    (tmp_path / "first").mkdir()
    results = spawn(Case(kind="gpt2", steps=2, solve=True, server=service), 2, tmp_path / "first")
    plan = planned_for_two_ranks(results)
    assert results[0]["plan_origin"] == "service"
    assert all(res["forwards_in_wrap"] > 0 for res in results)  # every rank profiled
    check(results)
    # the trace the service stored is the job's: world size 2, with the collectives
    with Client(service) as client:
        summaries = list(client.list_traces(world_size=2))
        assert len(summaries) == 1 and summaries[0].hardware_key.endswith(":w2r2")
        stored = client.get_trace(summaries[0].id).trace
        assert stored.hardware.distributed is not None and stored.hardware.distributed.collectives is not None
        assert summaries[0].content_hash == plan.trace_hash
        assert list(client.list_traces(world_size=1)) == []
    # the same job again: found in the history under the 2-rank hardware key, the same plan on both ranks
    (tmp_path / "again").mkdir()
    again = spawn(Case(kind="gpt2", steps=2, solve=True, server=service), 2, tmp_path / "again")
    assert [res["plan_origin"] for res in again] == ["history", "history"]
    assert [res["forwards_in_wrap"] for res in again] == [0, 0]  # a history hit: no rank profiles
    assert again[0]["plan"] == again[1]["plan"]
    assert Plan.model_validate_json(again[0]["plan"]).policy == plan.policy  # the allocation is the job's own


@pytest.mark.parametrize("fault", ["down", "silent"])
def test_a_service_that_is_down_or_never_answers_leaves_rank_0_to_plan_for_both_ranks(
    fault: str, tmp_path: Path
) -> None:
    # the service fails rank 0 alone (the other ranks wait for its plan in a broadcast): refused connections,
    # or a server that accepts them and never answers (only the service budget ends its wait); the job trains
    # with rank 0's in-process plan on every rank, as with no server at all
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)  # connections complete in the kernel's backlog; nothing ever reads or answers them
        port = silent.getsockname()[1] if fault == "silent" else free_port()
        case = Case(kind="gpt2", steps=2, solve=True, server=f"http://127.0.0.1:{port}", service_budget_s=4.0)
        results = spawn(case, 2, tmp_path)
    planned_for_two_ranks(results)
    assert [res["plan_origin"] for res in results] == ["fallback", "fallback"]
    check(results)


def test_ranks_whose_sample_batches_differ_get_a_plan_for_the_longest_and_guard_against_it(
    tmp_path: Path,
) -> None:
    # a padding collator: rank 0's first batch (its sample) has 12 tokens a row, rank 1's 16, then they swap.
    # The job's trace is the longer batch's whatever rank profiled slower (its activations are what every rank
    # must budget), and every rank's guard compares against it: no warning when rank 0 gets 16 tokens later
    results = spawn(Case(kind="gpt2", steps=2, solve=True, ragged=True), 2, tmp_path)
    planned_for_two_ranks(results)
    assert [res["trace_batch"] for res in results] == [[4, 16], [4, 16]]
    assert [res["guard"] for res in results] == [[[4, 16], False], [[4, 16], False]]
    check(results)


def test_tight_device_and_host_memory_shard_an_offloaded_chunk_that_trains_as_ddp(tmp_path: Path) -> None:
    # hidden 128: the parameters (1.7 MB) outweigh the activations; 5 MB of device memory makes the solver
    # offload every chunk. On a CPU a replicated offloaded chunk is the faster one (a sharded chunk adds the
    # all-gather of its `.grad` and of its compute copy, and saves only half of a cheap host step), so a node
    # host limit makes it shard: replicated, the 2 chunks take 30.0 MB of the node's host memory, one sharded
    # 23.9 MB (measured on this trace), so 26 MB fits only with a sharded chunk
    case = Case(kind="gpt2", hidden=128, steps=2, solve=True, device_memory=5_000_000, host_memory=26_000_000)
    results = spawn(case, 2, tmp_path)
    plan = planned_for_two_ranks(results)
    assert plan.policy is not None and any(c.sharded for c in plan.policy.chunks)
    check(results)


def test_small_models_probe_small_tensors() -> None:
    # every default size up to the model's parameter bytes, then that size; the overlap at the largest
    assert ProbeSettings.for_model(3_255_296) == ProbeSettings(
        sizes=(256 * 2**10, 3_255_296), overlap_size=3_255_296, repeats=3
    )
    assert ProbeSettings.for_model(1000).sizes == (SMALLEST_SIZE,)
    big = ProbeSettings.for_model(10 * 2**30)
    assert big.sizes == ProbeSettings().sizes and big.overlap_size == ProbeSettings().overlap_size
