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
from ddp_jobs import rel
from sharded_jobs import ShardCase, spawn

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

TOL = 1e-5


def check(results: list[dict[str, Any]], *, clipped: bool = False) -> None:
    for r, res in enumerate(results):
        assert res["sharded_chunks"] > 0
        assert rel(res["losses"], res["ref_losses"]) <= TOL, (r, res["losses"], res["ref_losses"])
        assert res["param_rel_diff"][0] <= TOL, (r, res["param_rel_diff"])
        assert rel(res["norms"], res["ref_norms"]) <= TOL, (r, res["norms"], res["ref_norms"])
        if clipped:
            assert res["norms"], "clipping ran"
        assert res["grad_reductions"] > 0
        if res["shared"]:  # node-shared compute copies (one machine, the default): barriers, no all-gathers
            assert res["param_gathers"] == 0 and res["compute_barriers"] > 0
        else:
            assert res["param_gathers"] > 0 and res["compute_barriers"] == 0
        # every kind of collective is timed (reduce-scatter, the `.grad` all-gather; private copies: the
        # compute-copy all-gather; node-shared ones: the barrier at step())
        reduction_s, fill_s, gather_s, barrier_s = res["collective_s"]
        assert reduction_s > 0 and fill_s > 0, res["collective_s"]
        assert (gather_s > 0) == (not res["shared"]) and (barrier_s > 0) == res["shared"], res["collective_s"]
    loss_diff = max(rel(res["losses"], res["ref_losses"]) for res in results)
    param_diff = max(res["param_rel_diff"][0] for res in results)
    print(
        f"sharded vs DDP over {len(results)} ranks: losses {loss_diff:.2e}, parameters {param_diff:.2e} relative"
    )
    # every rank holds the same whole model, and the ranks trained on different data (losses differ)
    assert len({round(res["checksum"], 6) for res in results}) == 1
    assert len({res["ref_losses"][0] for res in results}) == len(results)


def check_no_sync(results: list[dict[str, Any]], *, tol: float = TOL, partial_flushes: bool = False) -> None:
    """Accumulation inside no_sync(): no collective of a sharded chunk (nor any gradient reduction) in a no_sync
    backward, one reduce-scatter and one `.grad` all-gather per sharded chunk in the synchronising one (a chunk
    flushed in parts, `partial_flushes`, too: since session 26 its parts before its turn stay on the rank and
    its turn reduce-scatters them once; before, each part was a reduce-scatter), and `.grad` after every backward
    is DDP's: the local accumulated gradient after a no_sync one, the average after the others."""
    for res in results:
        sharded = res["sharded_chunks"]
        backwards = res["backwards"]
        assert any(not b["synced"] for b in backwards) and backwards[-1]["synced"]
        for b in backwards:
            if not b["synced"]:
                assert b["reduce_scatters"] == b["grad_gathers"] == b["grad_reductions"] == 0, b
                assert b["grad_flushes"] >= sharded, b  # the local gradients went to the host
            else:
                assert b["reduce_scatters"] == b["grad_gathers"] == sharded, b
                assert b["grad_flushes"] > sharded if partial_flushes else b["grad_flushes"] >= sharded, b
        assert res["grad_rel_diff"]["local"] <= tol and res["grad_rel_diff"]["synced"] <= tol, res[
            "grad_rel_diff"
        ]


def test_sharded_chunks_of_a_hugging_face_llama_train_as_ddp_on_two_ranks(tmp_path: Path) -> None:
    results = spawn(ShardCase(kind="hf-llama", offload="all", steps=4), 2, tmp_path)
    assert results[0]["persistent_chunks"] == 0
    check(results)


def test_persistent_and_sharded_chunks_accumulate_in_no_sync_as_ddp_on_four_ranks_holding_a_quarter_each(
    tmp_path: Path,
) -> None:
    world = 4
    case = ShardCase(kind="mlp", offload="alternate", steps=4, micro=3, batch=6, no_sync=True)
    results = spawn(case, world, tmp_path)
    assert results[0]["persistent_chunks"] > 0
    check(results)
    assert all(res["shared"] for res in results)  # one machine: the node-shared compute copy (the default)
    check_no_sync(results)
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
        assert res["host_report"]["gradient_exposed"] == 4 * world * shards
        # the compute copy: whole per rank, or node-shared (one machine, the default): a rank's share is a shard
        assert res["host_report"]["parameters"] == 4 * (shards if res["shared"] else world * shards)
        assert res["sharded_opt_state_bytes"] <= 2 * 4 * shards  # AdamW's two moments of the shard, fp32
    # together the ranks hold each moment once: the whole chunks' (alignment padding inside runs included)
    total_opt = sum(res["sharded_opt_state_bytes"] for res in results)
    assert 2 * 4 * sum(chunk_numel) * 0.9 <= total_opt <= 2 * 4 * sum(chunk_numel)


def test_clipping_every_step_after_no_sync_accumulation_sees_the_global_norm_as_ddp(tmp_path: Path) -> None:
    # a small max norm: torch's clip_grad_norm_ on the wrapped model's parameters after the synchronising
    # backward scales every step (the overlapped host steps of the shards are redone) and sees the whole averaged
    # `.grad` on every rank; every second offloaded chunk is replicated (its own no_sync path, unchanged); unwrap
    # then gives back DDP's model and optimizer state in plain PyTorch
    case = ShardCase(
        kind="llama",
        offload="all",
        steps=4,
        clip=0.05,
        unwrap=True,
        micro=3,
        batch=6,
        no_sync=True,
        replicated=True,
    )
    results = spawn(case, 2, tmp_path)
    assert results[0]["replicated_offloaded_chunks"] > 0
    check(results, clipped=True)
    check_no_sync(results, partial_flushes=True)  # llama's layers register parameters out of execution order
    for res in results:
        assert res["host_step_redos"] > 0
        assert res["unwrapped_rel_diff"][0] <= TOL and res["unwrapped_opt_rel_diff"] <= TOL


def test_bf16_compute_with_sharded_fp32_masters_trains_alike_on_every_rank(tmp_path: Path) -> None:
    """Smoke test of mixed precision: the fp32 master is a shard (its own tensor); ranks stay identical, losses
    stay near fp32 DDP's, and unwrap gathers every rank's fp32 master into the plain model."""
    case = ShardCase(kind="mlp", offload="alternate", steps=3, bf16=True, unwrap=True, micro=2, no_sync=True)
    results = spawn(case, 2, tmp_path)
    assert len({round(res["checksum"], 6) for res in results}) == 1
    check_no_sync(results, tol=2e-2)  # the local sum is in bf16, as DDP's of a bf16 model
    for res in results:
        assert res["sharded_chunks"] > 0 and res["host_report"]["master"] > 0
        assert rel(res["losses"], res["ref_losses"]) <= 2e-2, (res["losses"], res["ref_losses"])
        assert res["unwrapped_dtype"] == "torch.float32" and res["unwrapped_rel_diff"][0] <= 2e-2


def test_no_sync_accumulation_with_chunks_flushed_in_parts_trains_as_ddp(tmp_path: Path) -> None:
    # chunks of modules far apart in backward, two buffers: a chunk is evicted with gradients pending and flushed
    # again later in the same backward. Since session 26 its parts stay on the rank (added to the no_sync
    # backwards' local sum on the host) and its turn in the issue order reduce-scatters them once; before, the
    # local sum went into the first part's reduce-scatter and every part was one
    results = spawn(
        ShardCase(kind="mlp", offload="all", steps=3, micro=2, no_sync=True, tight=True), 2, tmp_path
    )
    check(results)
    check_no_sync(results, partial_flushes=True)


def test_no_sync_edge_cases_average_as_ddp_would(tmp_path: Path) -> None:
    """zero_grad after a no_sync backward, a chunk used only in the no_sync micro-step (reduce-scattered from its
    local sum at the end of the synchronising backward), no_sync after a synchronising backward without
    zero_grad, zero_grad(set_to_none=False) then accumulation and clipping: `.grad` after every backward and the
    parameters equal plain PyTorch averaging `.grad` as DDP does; optimizer.step() right after a no_sync backward
    is refused with an error that says why."""
    results = spawn(ShardCase(job="edges"), 2, tmp_path)
    assert results[0]["checksum"] == results[1]["checksum"]
    for res in results:
        assert res["grad_rel_diff"]["local"] <= TOL and res["grad_rel_diff"]["synced"] <= TOL, res
        assert res["param_rel_diff"][0] <= TOL, res["param_rel_diff"]
        assert res["no_sync_collectives"] == 0
        # `first`'s chunk got no gradient in the synchronising backward: one reduce-scatter more than flushes
        straggler = res["straggler_backward"]
        assert straggler["reduce_scatters"] == res["sharded_chunks"] == straggler["grad_flushes"] + 1
        assert "no_sync()" in res["refused"] and "synchronising backward" in res["refused"]


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


@pytest.mark.cuda_semantics
def test_the_cuda_paths_of_no_sync_accumulation_are_stream_ordered_and_compute_as_the_cpu_path(
    tmp_path: Path,
) -> None:
    """The CUDA code (never run on a GPU) under the stream-ordering checker, 2 ranks, fp32 and bf16 with fp32
    masters: no_sync's whole-area copies to `user_grad` and the add before the reduce-scatter, piecewise through
    the pinned stage on the host worker, with chunks flushed in parts. The checker found the missing host waits
    when they were taken out."""
    case = ShardCase(kind="mlp", offload="all", steps=3, micro=2, no_sync=True, tight=True, job="streams")
    for by_dtype in spawn(case, 2, tmp_path):
        assert sorted(by_dtype) == ["torch.bfloat16", "torch.float32"]
        for res in by_dtype.values():
            assert res["violations"] == ""
            assert res["offload_kernels"] > 0
            assert res["simulated"] == res["cpu"]
