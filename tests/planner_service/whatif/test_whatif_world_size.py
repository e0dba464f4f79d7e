"""What-if for a sharded job on one node (issue 20): collectives from the catalogue's peer link by the ring
rule, the node's host RAM, and `memplan whatif --world-size N`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from planner_service.solver.testing.synthetic import synthetic_trace
from planner_service.whatif.catalog import COPY_LATENCY_S, entry, load_catalog
from planner_service.whatif.interconnect import GroupNotModelled, in_group, modelled_group, ring_seconds
from tests.planner_service.whatif.test_whatif import _memplan, llama_7b  # noqa: F401  (fixture)

MiB, GiB = 2**20, 2**30


@pytest.fixture(scope="module")
def catalog() -> dict:  # type: ignore[type-arg]
    return load_catalog(use_env=False)


def test_nvlink_entries_give_ring_collectives_at_the_sustained_rate_and_full_overlap(catalog) -> None:  # type: ignore[no-untyped-def]
    h100 = entry(catalog, "h100-sxm")
    assert h100.peer_link is not None and h100.peer_link.sustained_bytes_per_s == 360e9  # 0.8 x 450 GB/s
    g = modelled_group(h100, 8)
    assert (g.world_size, g.ranks_per_node) == (8, 8)
    assert g.collectives is not None and g.interconnect is not None
    big = g.collectives.all_gather[-1]
    # 256 MiB gathered by 8 ranks: 7 steps of 10 us, and 7/8 of the tensor over 360 GB/s
    want_s = 7 * COPY_LATENCY_S + 7 / 8 * big.size_bytes / 360e9
    assert big.size_bytes / big.bytes_per_s == pytest.approx(want_s, rel=1e-12)
    assert ring_seconds(big.size_bytes, 8, 360e9) == pytest.approx(want_s, rel=1e-12)
    assert g.collectives.overlap_factor("all_gather", "h2d") == 1.0
    assert "nvlink 4" in g.interconnect.intra_node


def test_pcie_entries_reach_their_peers_through_the_host_and_share_its_link(catalog) -> None:  # type: ignore[no-untyped-def]
    l4 = entry(catalog, "l4")
    assert l4.peer_link is None
    g = modelled_group(l4, 2)
    assert g.collectives is not None
    s = g.collectives.reduce_scatter[-1]
    assert s.size_bytes / s.bytes_per_s == pytest.approx(
        COPY_LATENCY_S + s.size_bytes / 2 / 25.2e9, rel=1e-12
    )
    assert g.collectives.overlap_factor("reduce_scatter", "d2h") == 0.0
    with pytest.raises(GroupNotModelled, match="ranks_per_node: 2 ranks per node of 4 means several nodes"):
        modelled_group(l4, 4, 2)


def test_a_group_trace_holds_the_nodes_host_and_keys_by_it(catalog) -> None:  # type: ignore[no-untyped-def]
    a100 = entry(catalog, "a100-80gb-sxm")
    base = synthetic_trace(n_blocks=3, hidden=64, vocab=100)
    assert in_group(base, a100, 1) is base
    t = in_group(base, a100, 4)
    assert t.hardware.world_size == 4 and t.hardware.device_count == 4
    assert t.hardware.host_memory_bytes == 4 * a100.host_memory_bytes
    assert t.hardware.key.endswith(":x4:w4r4")
    assert in_group(base, a100, 4, node_host_memory_bytes=GiB).hardware.host_memory_bytes == GiB


def test_whatif_world_size_shards_a_7b_that_one_a100_40gb_cannot_hold(llama_7b: Path) -> None:  # noqa: F811
    args = [
        "whatif",
        "--config",
        str(llama_7b),
        "--hardware",
        "a100-40gb-sxm",
        "--batch",
        "1",
        "--seq",
        "1024",
    ]
    one = _memplan(*args, "--json")
    eight = _memplan(*args, "--world-size", "8", "--json")
    assert one.returncode == 0 and eight.returncode == 0, one.stderr + eight.stderr
    a1, a8 = json.loads(one.stdout), json.loads(eight.stdout)
    assert a1["fits"] and a8["fits"]
    print(json.dumps({"world_size_1": a1, "world_size_8": a8}))  # the figures, for docs/BENCHMARKS.md
    # one rank must offload much of 7B's ~50 GiB of states; eight ranks can shard persistent chunks on the
    # device (ZeRO-3 for parameters, fp32 master and optimizer state; the gradient stays whole), and shard an
    # offloaded chunk's host state beyond its compute copy and .grad: fewer chunks offloaded, less host memory
    # per rank, and the job's throughput scales with its ranks (communication is not free, so not exactly 8x)
    assert a1["plan_summary"]["offloaded_chunks"] > 0
    assert a8["plan_summary"]["offloaded_chunks"] < a1["plan_summary"]["offloaded_chunks"]
    assert a8["peak_host_bytes"] < a1["peak_host_bytes"]
    assert a8["tokens_per_s"] > 4 * a1["tokens_per_s"]
    assert a8["tokens_per_s"] == pytest.approx(8 * 1024 / a8["iteration_s"], rel=1e-9)
    bad = _memplan(*args, "--world-size", "4", "--ranks-per-node", "2")
    assert bad.returncode == 2 and "--ranks-per-node: 2 ranks per node of 4" in bad.stderr
