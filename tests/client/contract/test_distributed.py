"""Multi-rank jobs in the contract (issue 20): the process group's fields are optional, validated with the
field named, and leave single-process traces, keys and plans exactly as they were."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from client.contract import Chunk, CollectiveCopyOverlap, Placement, Policy, Trace
from planner_service.solver.testing.synthetic import synthetic_distributed, synthetic_trace, with_distributed


def _raw(world_size: int = 2, ranks_per_node: int = 2) -> dict:
    t = with_distributed(
        synthetic_trace(n_blocks=3, hidden=64, vocab=100, batch=1, seq=16),
        synthetic_distributed(world_size, ranks_per_node),
    )
    return json.loads(t.canonical_json())


def _errors(raw: dict) -> list[str]:
    with pytest.raises(ValidationError) as info:
        Trace.model_validate(raw)
    return [".".join(str(p) for p in e["loc"]) + " :: " + e["msg"] for e in info.value.errors()]


def test_a_single_process_trace_is_unchanged_by_the_new_fields() -> None:
    t = synthetic_trace(n_blocks=3, hidden=64, vocab=100)
    assert "distributed" not in json.loads(t.canonical_json())["hardware"]
    assert t.hardware.world_size == 1 and t.hardware.ranks_per_node == 1
    assert t.hardware.key == "cuda:Synthetic GPU (modelled):80GiB:x1"
    # an explicit single-rank group is a different trace (it says so), but the same hardware key
    one = with_distributed(t, synthetic_distributed(1))
    assert one.hardware.key == t.hardware.key


def test_a_multi_rank_trace_round_trips_and_keys_by_world_size_and_ranks_per_node() -> None:
    raw = _raw(4, 2)
    t = Trace.model_validate(raw)
    assert Trace.model_validate_json(t.model_dump_json()) == t
    assert t.hardware.world_size == 4 and t.hardware.ranks_per_node == 2
    assert t.hardware.distributed is not None and t.hardware.distributed.nodes == 2
    assert t.hardware.key.endswith(":x1:w4r2")
    assert Trace.model_validate(_raw(4, 4)).hardware.key.endswith(":w4r4")


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda d: d.update(world_size=0), "hardware.distributed.world_size"),
        (lambda d: d.update(world_size=True), "hardware.distributed.world_size"),
        (lambda d: d.update(ranks_per_node=3), "ranks_per_node: 3 is more than world_size 2"),
        (
            lambda d: d.update(world_size=6, ranks_per_node=4),
            "ranks_per_node: 4 does not divide world_size 6",
        ),
        (lambda d: d.pop("collectives"), "collectives: required when world_size > 1"),
        (lambda d: d.pop("interconnect"), "interconnect: required when world_size > 1"),
        (
            lambda d: d["interconnect"].update(backend="carrier-pigeon"),
            "hardware.distributed.interconnect.backend",
        ),
        (lambda d: d["collectives"]["all_gather"].clear(), "hardware.distributed.collectives.all_gather"),
        (
            lambda d: d["collectives"]["reduce_scatter"].reverse(),
            "reduce_scatter: samples must be sorted by size_bytes",
        ),
        (
            lambda d: d["collectives"]["all_gather"][0].update(bytes_per_s=-1.0),
            "hardware.distributed.collectives.all_gather.0.bytes_per_s",
        ),
        (
            lambda d: d["collectives"]["copy_overlap"].append(dict(d["collectives"]["copy_overlap"][0])),
            "copy_overlap[2]: (all_gather, h2d) appears twice",
        ),
        (
            lambda d: d["collectives"]["copy_overlap"][0].update(concurrent_s=0.0),
            "hardware.distributed.collectives.copy_overlap.0.concurrent_s",
        ),
        (lambda d: d.update(nodes=2), "hardware.distributed.nodes"),
    ],
)
def test_bad_process_group_fields_are_rejected_naming_the_field(change, field: str) -> None:  # type: ignore[no-untyped-def]
    raw = _raw()
    change(raw["hardware"]["distributed"])
    errors = _errors(raw)
    assert any(field in e for e in errors), errors


def test_overlap_factor_reads_alone_and_together_times() -> None:
    def overlap(concurrent_s: float) -> float:
        return CollectiveCopyOverlap(
            collective="all_gather",
            direction="h2d",
            collective_bytes=1,
            copy_bytes=1,
            collective_s=2.0,
            copy_s=1.0,
            concurrent_s=concurrent_s,
        ).factor

    assert overlap(2.0) == 1.0  # the copy hides entirely behind the collective
    assert overlap(3.0) == 0.0  # serialised
    assert overlap(2.5) == 0.5
    assert overlap(3.4) == 0.0 and overlap(1.5) == 1.0  # noise is clamped
    curves = synthetic_distributed(2, overlap_factor=0.25).collectives
    assert curves is not None
    assert curves.overlap_factor("all_gather", "h2d") == pytest.approx(0.25)
    assert curves.overlap_factor("all_gather", "d2h") == 0.0  # not measured: serialised


def _chunk(i: int, placement: Placement, sharded: bool) -> Chunk:
    return Chunk(
        index=i, placement=placement, parameters=[f"p{i}"], blocks=[i], used_bytes=1, sharded=sharded
    )


def test_policy_sharding_is_checked_against_its_world_size() -> None:
    blocks: list = []
    ok = Policy(
        chunk_size_bytes=4,
        chunks=[_chunk(0, Placement.persistent, False), _chunk(1, Placement.offloaded, True)],
        n_buffers=1,
        blocks=blocks,
        world_size=2,
    )
    assert ok.sharded_chunks == [1]
    dumped = json.loads(ok.model_dump_json())
    assert dumped["world_size"] == 2 and "sharded" not in dumped["chunks"][0]
    replicated = Policy(  # an offloaded chunk may be replicated too (every rank holds it whole)
        chunk_size_bytes=4,
        chunks=[_chunk(0, Placement.persistent, False), _chunk(1, Placement.offloaded, False)],
        n_buffers=1,
        blocks=blocks,
        world_size=2,
    )
    assert replicated.sharded_chunks == []
    with pytest.raises(ValidationError, match=r"chunks\[0\].sharded: a single-rank policy"):
        Policy(chunk_size_bytes=4, chunks=[_chunk(0, Placement.persistent, True)], n_buffers=0, blocks=blocks)
    single = Policy(
        chunk_size_bytes=4, chunks=[_chunk(0, Placement.persistent, False)], n_buffers=0, blocks=blocks
    )
    assert "world_size" not in json.loads(single.model_dump_json())
