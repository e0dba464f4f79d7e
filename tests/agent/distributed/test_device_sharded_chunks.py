"""Device-sharded persistent chunks (issue 20, ZeRO-3 on the device) train as plain DistributedDataParallel does.

Every test spawns 2 or 4 ranks on CPU (gloo; the "device" is the CPU) training the same model with DDP and with
memplan under a plan whose PERSISTENT chunks are sharded (`Chunk.sharded`), on their own batches, and compares
losses, clipping norms, `.grad` and parameters within 1e-5 relative. Before this, `ChunkLayout.from_policy`
refused a persistent sharded chunk, so each of these failed at wrap. Marked `distributed`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from sharded_jobs import ShardCase, spawn

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

TOL = 1e-5


def rel(a: list[float], b: list[float]) -> float:
    return max((abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b, strict=True)), default=0.0)


def check(results: list[dict[str, Any]], world: int, *, tol: float = TOL) -> None:
    for r, res in enumerate(results):
        assert res["device_sharded_chunks"] > 0
        assert rel(res["losses"], res["ref_losses"]) <= tol, (r, res["losses"], res["ref_losses"])
        assert res["param_rel_diff"][0] <= tol, (r, res["param_rel_diff"])
        assert rel(res["norms"], res["ref_norms"]) <= tol, (r, res["norms"], res["ref_norms"])
        assert res["grad_rel_diff"]["synced"] <= tol and res["grad_rel_diff"]["local"] <= tol, res[
            "grad_rel_diff"
        ]
        assert res["device_shard_gathers"] > 0
        # per rank on the device: the compute shard and the master shard are 1/N of the chunk, the gradient area
        # whole (N*s), and no whole copy is held after the step (released)
        for total, own, master, grad in res["device_shard_buffers"]:
            assert total % world == 0 and own == master == total // world and grad == total
        assert res["device_report"]["gathered_parameters"] == 0  # after step(): every whole copy released
    # every rank holds the same whole model, and the ranks trained on different data (losses differ)
    assert len({round(res["checksum"], 6) for res in results}) == 1
    assert len({res["ref_losses"][0] for res in results}) == len(results)


def test_device_sharded_chunks_of_a_hugging_face_llama_train_as_ddp_with_clipping_on_two_ranks(
    tmp_path: Path,
) -> None:
    results = spawn(
        ShardCase(
            kind="hf-llama",
            offload="none",
            device_shard=True,
            steps=3,
            clip=0.05,
            save=str(tmp_path / "c.pt"),
        ),
        2,
        tmp_path,
    )
    check(results, 2)
    assert all(r["norms"] for r in results)  # clipping ran
    assert all(r["opt_state_rel_diff"] <= TOL for r in results)


def test_device_sharded_and_offloaded_sharded_chunks_accumulate_in_no_sync_as_ddp_on_four_ranks(
    tmp_path: Path,
) -> None:
    case = ShardCase(
        kind="mlp",
        offload="alternate",
        device_shard=True,
        steps=3,
        micro=2,
        batch=4,
        no_sync=True,
        unwrap=True,
    )
    results = spawn(case, 4, tmp_path)
    check(results, 4)
    assert all(r["sharded_chunks"] > 0 for r in results)
    assert all(r["unwrapped_rel_diff"][0] <= TOL and r["unwrapped_opt_rel_diff"] <= TOL for r in results)
