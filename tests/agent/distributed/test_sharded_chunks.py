"""Sharded offloaded chunks (issue 20) train as plain DistributedDataParallel does, holding 1/N of the host state.

Every test spawns 2 or 4 ranks on CPU (gloo) that train the same model with DDP and with memplan under a plan
whose offloaded chunks are sharded, on their own batches, and compares losses, clipping norms and parameters
within 1e-5 relative. Before issue 20's runtime change `ChunkLayout.from_policy` refused every sharded chunk,
so each of these failed at wrap. Marked `distributed`: `pytest -m distributed` runs only these.
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


def check(results: list[dict[str, Any]], *, clipped: bool = False) -> None:
    for r, res in enumerate(results):
        assert res["sharded_chunks"] > 0
        assert rel(res["losses"], res["ref_losses"]) <= TOL, (r, res["losses"], res["ref_losses"])
        assert res["param_rel_diff"][0] <= TOL, (r, res["param_rel_diff"])
        assert rel(res["norms"], res["ref_norms"]) <= TOL, (r, res["norms"], res["ref_norms"])
        if clipped:
            assert res["norms"], "clipping ran"
        assert res["grad_reductions"] > 0 and res["param_gathers"] > 0
        # every kind of collective is timed (reduce-scatter, the `.grad` all-gather, the compute-copy all-gather)
        assert all(t > 0 for t in res["collective_s"]), res["collective_s"]
    loss_diff = max(rel(res["losses"], res["ref_losses"]) for res in results)
    param_diff = max(res["param_rel_diff"][0] for res in results)
    print(
        f"sharded vs DDP over {len(results)} ranks: losses {loss_diff:.2e}, parameters {param_diff:.2e} relative"
    )
    # every rank holds the same whole model, and the ranks trained on different data (losses differ)
    assert len({round(res["checksum"], 6) for res in results}) == 1
    assert len({res["ref_losses"][0] for res in results}) == len(results)


def test_sharded_chunks_of_a_hugging_face_llama_train_as_ddp_on_two_ranks(tmp_path: Path) -> None:
    results = spawn(ShardCase(kind="hf-llama", offload="all", steps=4), 2, tmp_path)
    assert results[0]["persistent_chunks"] == 0
    check(results)


def test_persistent_and_sharded_chunks_train_as_ddp_on_four_ranks_holding_a_quarter_each(
    tmp_path: Path,
) -> None:
    world = 4
    results = spawn(ShardCase(kind="mlp", offload="alternate", steps=4), world, tmp_path)
    assert results[0]["persistent_chunks"] > 0
    check(results)
    # host memory of the sharded chunks per rank: master, host gradient, staging and optimizer state are
    # one shard (a quarter, padded to 4 elements); the compute copy and the exposed gradient stay whole
    chunk_numel = results[0]["chunk_numel"]
    for res in results:
        for n, s, (grad, stage, master, compute) in zip(
            chunk_numel, res["shard_numel"], res["shard_buffers"], strict=True
        ):
            per_rank = -(-n // world)  # ceil(n / world), then up to a multiple of 4 elements
            assert s == -(-per_rank // 4) * 4 and 0 <= world * s - n < 4 * world
            assert grad == stage == master == s and compute == world * s
        shards = sum(res["shard_numel"])
        assert res["host_report"]["gradients"] == res["host_report"]["gradient_staging"] == 4 * shards
        assert (
            res["host_report"]["parameters"] == res["host_report"]["gradient_exposed"] == 4 * world * shards
        )
        assert res["sharded_opt_state_bytes"] <= 2 * 4 * shards  # AdamW's two moments of the shard, fp32
    # together the ranks hold each moment once: the whole chunks' (alignment padding inside runs included)
    total_opt = sum(res["sharded_opt_state_bytes"] for res in results)
    assert 2 * 4 * sum(chunk_numel) * 0.9 <= total_opt <= 2 * 4 * sum(chunk_numel)


def test_clipping_every_step_sees_the_global_norm_as_ddp(tmp_path: Path) -> None:
    # a small max norm: torch's clip_grad_norm_ on the wrapped model's parameters scales every step (the
    # overlapped host steps of the shards are redone) and sees the whole averaged `.grad` on every rank;
    # unwrap then gives back DDP's model and optimizer state in plain PyTorch
    results = spawn(ShardCase(kind="llama", offload="all", steps=4, clip=0.05, unwrap=True), 2, tmp_path)
    check(results, clipped=True)
    for res in results:
        assert res["host_step_redos"] > 0
        assert res["unwrapped_rel_diff"][0] <= TOL and res["unwrapped_opt_rel_diff"] <= TOL


def test_bf16_compute_with_sharded_fp32_masters_trains_alike_on_every_rank(tmp_path: Path) -> None:
    """Smoke test of mixed precision: the fp32 master is a shard (its own tensor); ranks stay identical, losses
    stay near fp32 DDP's, and unwrap gathers every rank's fp32 master into the plain model."""
    results = spawn(ShardCase(kind="mlp", offload="alternate", steps=3, bf16=True, unwrap=True), 2, tmp_path)
    assert len({round(res["checksum"], 6) for res in results}) == 1
    for res in results:
        assert res["sharded_chunks"] > 0 and res["host_report"]["master"] > 0
        assert rel(res["losses"], res["ref_losses"]) <= 2e-2, (res["losses"], res["ref_losses"])
        assert res["unwrapped_dtype"] == "torch.float32" and res["unwrapped_rel_diff"][0] <= 2e-2


def test_gradient_accumulation_with_no_sync_trains_as_ddp(tmp_path: Path) -> None:
    results = spawn(ShardCase(kind="mlp", offload="all", steps=3, micro=2, no_sync=True), 2, tmp_path)
    check(results)


def test_full_checkpoint_saved_at_two_ranks_loads_in_plain_pytorch_and_at_four_ranks(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt.pt"
    (tmp_path / "save").mkdir()
    saved = spawn(ShardCase(kind="mlp", offload="alternate", steps=3, save=str(ckpt)), 2, tmp_path / "save")
    check(saved)
    for res in saved:  # the gathered optimizer state equals DDP's plain-PyTorch one, on every rank
        assert res["opt_state_rel_diff"] <= TOL, res["opt_state_rel_diff"]
    # both variants start from memplan's checkpoint: DDP via plain PyTorch's load_state_dict, memplan at 4 ranks
    (tmp_path / "load").mkdir()
    loaded = spawn(ShardCase(kind="mlp", offload="alternate", steps=3, load=str(ckpt)), 4, tmp_path / "load")
    check(loaded)
    for res in loaded:
        assert res["opt_state_rel_diff"] <= TOL, res["opt_state_rel_diff"]
