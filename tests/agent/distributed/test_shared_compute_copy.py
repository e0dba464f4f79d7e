"""The node-shared compute copy of sharded chunks (issue 20, `agent/runtime/node_shared.py`).

Forked gloo ranks on CPU (one machine: sharing is the default) train with DDP and with memplan, as
`test_sharded_chunks.py` does, once with the node-shared compute copy and once with private copies per rank
(`RuntimeOptions(share_compute_copy=False)`). Both match DDP and each other to the bit; the shared one moves no
compute copy between the ranks (barriers, no all-gathers), the ranks map one deleted /dev/shm file (the same
inode), hold a shard of it each, and leave nothing in the directory, also when a rank is killed. A rank that
cannot create or open the segment makes every rank fall back, with one warning each. Before the change the
ranks had no shared copy: `shared`, `compute_barriers` and `node_shared_host_bytes` did not exist.
"""

from __future__ import annotations

import json
import os
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from ddp_jobs import rel
from sharded_jobs import ShardCase, TokenMLP, run_then_kill, sharded_plan, spawn

from agent.runtime import ChunkLayout
from agent.runtime.host_arena import chunk_region_bytes, planned_chunk_bytes
from agent.runtime.node_shared import SegmentLayout
from agent.runtime.process_group import UnevenNodesError, busiest_host_ranks
from client.contract import PARAMETER_ALIGN_BYTES, compute_copy_shared, sharded_chunk_pinned_bytes

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

TOL = 1e-5
WORLD = 2


@pytest.fixture
def shm() -> Iterator[Path]:
    """A directory of its own on /dev/shm (a tmpfs every rank sees), so other jobs' files cannot interfere."""
    with tempfile.TemporaryDirectory(dir="/dev/shm", prefix="memplan-test-") as d:
        yield Path(d)


def as_ddp(results: list[dict[str, Any]], tol: float = TOL) -> None:
    for res in results:
        assert rel(res["losses"], res["ref_losses"]) <= tol, (res["losses"], res["ref_losses"])
        assert rel(res["norms"], res["ref_norms"]) <= tol, (res["norms"], res["ref_norms"])
        assert res["param_rel_diff"][0] <= tol, res["param_rel_diff"]
    assert len({res["digest"] for res in results}) == 1  # every rank holds the same model


def out(tmp_path: Path, name: str) -> Path:
    (tmp_path / name).mkdir()
    return tmp_path / name


def compute_copy_bytes(res: dict[str, Any]) -> int:
    return sum(WORLD * s * 4 for s in res["shard_numel"])  # fp32, N shards per chunk


def test_shared_and_private_compute_copies_train_as_ddp_and_alike_and_the_ranks_share_one_copy(
    shm: Path, tmp_path: Path
) -> None:
    steps = 3
    case = ShardCase(kind="llama", offload="all", steps=steps, clip=0.05, shm_dirs=[str(shm)] * WORLD)
    shared = spawn(case, WORLD, out(tmp_path, "shared"))
    private = spawn(ShardCase(**{**case.__dict__, "share": False}), WORLD, out(tmp_path, "private"))
    for results in (shared, private):
        as_ddp(results)
        assert all(res["norms"] and res["host_step_redos"] > 0 for res in results)  # clipping redid the steps
    # the same arithmetic: equal to the bit, losses and parameters
    assert [r["losses"] for r in shared] == [r["losses"] for r in private]
    assert {r["digest"] for r in shared} == {r["digest"] for r in private}
    n_sharded = shared[0]["sharded_chunks"]
    for s, p in zip(shared, private, strict=True):
        assert s["shared"] and not p["shared"]
        # collectives: no compute-copy all-gather when shared; a barrier at wrap and one per step instead
        assert s["param_gathers"] == 0 and s["compute_barriers"] == 1 + steps
        assert p["param_gathers"] == steps * n_sharded and p["compute_barriers"] == 0
        # each rank holds its share of the compute copies: host bytes drop by (N-1)/N of them
        whole = compute_copy_bytes(s)
        assert sum(p["host_report"].values()) - sum(s["host_report"].values()) == whole - whole // WORLD
        assert s["node_shared_bytes"] >= whole and p["node_shared_bytes"] == 0
        # pinned bytes as the planner counts them (the contract's function), per rank
        for res, shares in ((s, True), (p, False)):
            counted = sum(
                sharded_chunk_pinned_bytes(n, WORLD, 4, separate_master=False, shared_compute=shares)
                for n in res["chunk_numel"]
            )
            assert res["pinned_host_bytes"] == counted, (shares, res["pinned_host_bytes"], counted)
        # the segment: every chunk's copy inside the range CUDA would register, one mapping of it
        assert s["chunks_inside"] and s["registration"] == [s["node_shared_bytes"]] * 2
        lo, hi, inode, path = s["maps"]
        assert lo <= 0 and hi >= s["node_shared_bytes"] and path.endswith("(deleted)"), s["maps"]
        assert path.startswith(f"{shm}/memplan-"), path
        assert s["shm_left"] == [] and s["warnings"] == [] == p["warnings"]  # unlinked during wrap
    # the ranks map the same file (same inode), deleted from the directory once every rank mapped it
    assert len({s["maps"][2] for s in shared}) == 1
    assert os.listdir(shm) == []


def test_four_ranks_with_persistent_chunks_share_one_copy_and_train_as_with_private_copies(
    tmp_path: Path,
) -> None:
    world = 4
    case = ShardCase(kind="mlp", offload="alternate", steps=3)
    shared = spawn(case, world, out(tmp_path, "shared"))
    private = spawn(ShardCase(**{**case.__dict__, "share": False}), world, out(tmp_path, "private"))
    for results in (shared, private):
        as_ddp(results)
    assert all(r["shared"] for r in shared) and not any(r["shared"] for r in private)
    assert len({r["digest"] for r in shared + private}) == 1
    for s, p in zip(shared, private, strict=True):
        whole = sum(world * n * 4 for n in s["shard_numel"])
        assert p["host_report"]["parameters"] - s["host_report"]["parameters"] == whole - whole // world
        assert s["param_gathers"] == 0 and p["param_gathers"] > 0


def test_bf16_with_fp32_master_shards_trains_alike_shared_or_not(shm: Path, tmp_path: Path) -> None:
    """Mixed precision smoke: the fp32 master is a shard of its own; each rank casts it into its shard of the
    node-shared copy. Shared and private give the same model to the bit, near fp32 DDP's, also after unwrap."""
    case = ShardCase(
        kind="mlp", offload="alternate", steps=3, bf16=True, unwrap=True, shm_dirs=[str(shm)] * WORLD
    )
    shared = spawn(case, WORLD, out(tmp_path, "shared"))
    private = spawn(ShardCase(**{**case.__dict__, "share": False}), WORLD, out(tmp_path, "private"))
    assert all(r["shared"] for r in shared) and not any(r["shared"] for r in private)
    assert [r["losses"] for r in shared] == [r["losses"] for r in private]
    assert len({r["digest"] for r in shared + private}) == 1
    for s, p in zip(shared, private, strict=True):
        assert rel(s["losses"], s["ref_losses"]) <= 2e-2
        assert s["unwrapped_dtype"] == "torch.float32" and s["unwrapped_rel_diff"][0] <= 2e-2
        whole = sum(WORLD * n * 2 for n in s["shard_numel"])  # bf16 compute copies
        assert p["host_report"]["parameters"] - s["host_report"]["parameters"] == whole - whole // WORLD


@pytest.mark.parametrize("failure", ["open", "reserve"])
def test_a_rank_that_cannot_share_makes_every_rank_fall_back_to_private_copies_with_one_warning(
    shm: Path, tmp_path: Path, failure: str
) -> None:
    """Real failures: rank 1's directory does not exist, so it cannot open the file rank 0 created ("open");
    or rank 0 wraps under an RLIMIT_FSIZE smaller than the segment, so the kernel refuses `posix_fallocate`
    ("reserve", EFBIG; a full /dev/shm is ENOSPC on the same call). Every rank trains exactly as DDP with
    private copies and all-gathers, and warns once; nothing is left in the directory."""
    dirs = [str(shm), str(shm / "missing")] if failure == "open" else [str(shm)] * WORLD
    case = ShardCase(
        kind="mlp", offload="all", steps=2, shm_dirs=dirs, fsize_limit=4096 if failure == "reserve" else None
    )
    results = spawn(case, WORLD, tmp_path)
    as_ddp(results)
    expected = "could not open" if failure == "open" else "could not create"
    for res in results:
        assert not res["shared"] and res["param_gathers"] > 0 and res["compute_barriers"] == 0
        assert len(res["warnings"]) == 1, res["warnings"]
        warning = res["warnings"][0]
        assert expected in warning and "host bytes on the node" in warning, warning
    assert os.listdir(shm) == []


def test_nothing_is_left_in_the_directory_when_the_creating_rank_is_killed(shm: Path, tmp_path: Path) -> None:
    exitcodes = run_then_kill(0, WORLD, str(shm), tmp_path)  # rank 0 created the segment
    assert exitcodes == [-signal.SIGKILL, 0]
    after = json.loads((tmp_path / "after_kill.json").read_text())
    # the survivor still reads its parameters from the node's copy; the directory was empty all along
    assert after == {"victim_gone": True, "shared": True, "left": [], "params_finite": True}
    assert os.listdir(shm) == []


def test_segment_layout_and_arena_accounting_follow_the_contract() -> None:
    """No ranks: each sharded chunk's N*s elements at a 16-byte-aligned offset; the arena's chunk region leaves
    out exactly the rank's shares of the node-shared copies, which with them make the planner's count."""
    model = TokenMLP()
    world = 3
    layout = ChunkLayout.from_policy(sharded_plan(model, world, "all").policy, model, torch.float32)  # type: ignore[arg-type]
    seg = SegmentLayout.of(layout)
    assert list(seg.offsets) == [c.index for c in layout.chunks if c.sharded] and seg.offsets
    for c in layout.sharded:
        assert (
            seg.offsets[c.index] % PARAMETER_ALIGN_BYTES == 0
            and seg.sizes[c.index] == c.shard_numel * world * 4
        )
    assert seg.total == sum(-(-n // 16) * 16 for n in seg.sizes.values())
    shares = sum(-(-c.shard_numel * 4 // 16) * 16 for c in layout.sharded)
    for master in (False, True):
        planned = planned_chunk_bytes(layout, separate_master=master, shared_compute=True)
        assert chunk_region_bytes(layout, separate_master=master, shared_compute=True) == planned - shares
        assert chunk_region_bytes(layout, separate_master=master) == planned_chunk_bytes(
            layout, separate_master=master
        )


def test_ranks_share_a_copy_only_when_all_are_on_one_host() -> None:
    """The decision `open_node_shared` takes from the ranks' host names (several nodes: private copies)."""
    assert busiest_host_ranks(["a", "a"]) == 2 and compute_copy_shared(2, busiest_host_ranks(["a", "a"]))
    two_nodes = busiest_host_ranks(["a", "a", "b", "b"])
    assert two_nodes == 2 and not compute_copy_shared(4, two_nodes)
    with pytest.raises(UnevenNodesError, match="uneven"):
        busiest_host_ranks(["a", "a", "b"])
