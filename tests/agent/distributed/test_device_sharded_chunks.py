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
import torch
from checkpoint_jobs import AFTER, SAVE_WORLD, CkptCase, continuation, make_model
from checkpoint_jobs import spawn as spawn_ckpt
from ddp_jobs import adamw, rel
from sharded_jobs import ShardCase, spawn

from agent.checkpoint import load_full

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

TOL = 1e-5


def check(results: list[dict[str, Any]], world: int, *, tol: float = TOL) -> None:
    for r, res in enumerate(results):
        assert res["device_sharded_chunks"] > 0
        # outside forward/backward: NaN placeholders (a misuse is loud), writes refused
        assert res["released_reads_nan"] and res["released_write_fails"]
        assert rel(res["losses"], res["ref_losses"]) <= tol, (r, res["losses"], res["ref_losses"])
        assert res["param_rel_diff"][0] <= tol, (r, res["param_rel_diff"])
        assert rel(res["norms"], res["ref_norms"]) <= tol, (r, res["norms"], res["ref_norms"])
        assert res["grad_rel_diff"]["synced"] <= tol and res["grad_rel_diff"]["local"] <= tol, res[
            "grad_rel_diff"
        ]
        assert res["device_shard_gathers"] > 0 and res["device_shard_prefetches"] > 0
        # per rank on the device: the compute shard and the master shard are 1/N of the chunk, the gradient area
        # whole (N*s), and no whole copy is held after the step (released)
        for total, own, master, grad in res["device_shard_buffers"]:
            # (no gradient area: every parameter of the chunk frozen)
            assert total % world == 0 and own == master == total // world and grad in (total, 0)
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
    for r in results:  # gathered before use and released after: never every whole copy at once in training
        assert 0 < r["max_gathered_bytes"] < r["whole_bytes"] / 2, (r["max_gathered_bytes"], r["whole_bytes"])
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
        # `head.weight` frozen: its device-sharded chunk has no gradient area and stays gathered to the end of
        # backward; `up.bias` frozen in an offloaded chunk
        frozen=True,
    )
    results = spawn(case, 4, tmp_path)
    check(results, 4)
    assert all(r["sharded_chunks"] > 0 for r in results)
    assert all(r["unwrapped_rel_diff"][0] <= TOL and r["unwrapped_opt_rel_diff"] <= TOL for r in results)


def test_a_checkpoint_of_device_sharded_chunks_continues_in_plain_pytorch_and_at_four_ranks_as_ddp(
    tmp_path: Path,
) -> None:
    # save_sharded at 2 ranks (persistent chunks sharded on the device, offloaded ones on the host), then
    # load_full in one plain-PyTorch process and load_sharded at 4 ranks: both continue as uninterrupted DDP
    for d in ("out", "load"):
        (tmp_path / d).mkdir()
    case = CkptCase(directory=str(tmp_path / "ckpt"), offload="alternate", device_shard=True)
    saved = spawn_ckpt("save", case, SAVE_WORLD, tmp_path / "out")
    for res in saved:
        assert rel(res["losses"], res["ref_before"]) <= TOL
        assert res["written"] == ["meta.pt", "rank0.pt", "rank1.pt"]
    assert saved[0]["replicated_pieces"] == 0  # every chunk sharded: no whole parameter in meta.pt
    assert saved[0]["full_vs_gathered_optimizer"] == 0.0
    ref_after = [sum(r["ref_after"][s] for r in saved) / len(saved) for s in range(AFTER)]
    model_sd, optim_sd = load_full(tmp_path / "ckpt")
    ref = torch.load(tmp_path / "ddp_at_save.pt", weights_only=True)
    assert max(float((model_sd[k] - v).abs().max()) for k, v in ref["model"].items()) <= 1e-5
    plain = make_model("hf-llama")
    opt = adamw(plain)
    plain.load_state_dict(model_sd)
    opt.load_state_dict(optim_sd)
    losses = []
    for s in range(AFTER):
        x = continuation(s, 0, 1)
        loss = plain(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert rel(losses, ref_after) <= TOL, (losses, ref_after)
    loaded = spawn_ckpt("load", case, 4, tmp_path / "load")
    assert all(r["sharded_chunks"] > 0 for r in loaded)
    assert rel([sum(r["losses"][s] for r in loaded) / 4 for s in range(AFTER)], ref_after) <= TOL


def test_bf16_device_sharded_tied_weights_save_their_fp32_masters_and_load_at_four_ranks(
    tmp_path: Path,
) -> None:
    # every chunk persistent and sharded on the device, the head tied to the embedding (one parameter, two names)
    for d in ("out", "load"):
        (tmp_path / d).mkdir()
    case = CkptCase(
        directory=str(tmp_path / "ckpt"), kind="mlp", bf16=True, offload="none", tied=True, device_shard=True
    )
    res = spawn_ckpt("save", case, SAVE_WORLD, tmp_path / "out")[0]
    assert res["model_dtypes"] == ["torch.float32"]
    assert res["model_vs_masters"] and max(res["model_vs_masters"]) == 0.0 and res["model_off_bf16"] > 0
    assert res["full_vs_gathered_optimizer"] == 0.0
    model_sd, _ = load_full(tmp_path / "ckpt")
    assert torch.equal(model_sd["head.weight"], model_sd["embed.weight"])
    loaded = spawn_ckpt("load", case, 4, tmp_path / "load")
    for r in loaded:
        assert r["sharded_chunks"] > 0 and r["masters_vs_saved"] and max(r["masters_vs_saved"]) == 0.0


def test_the_cuda_paths_of_device_sharded_chunks_keep_stream_order_under_the_checker(tmp_path: Path) -> None:
    """On CUDA the all-gathers of device-sharded chunks go through the host worker (the one issuer of collectives
    with offloaded chunks) and the compute stream waits for them: run on CPU under the stream-ordering checker (a
    test double; NO GPU has run this), beside sharded offloaded chunks in no_sync accumulation, fp32 and bf16:
    no violation, and the parameters equal the CPU path's to the bit."""
    case = ShardCase(
        kind="mlp", offload="alternate", device_shard=True, steps=2, micro=2, no_sync=True, job="streams"
    )
    for by_dtype in spawn(case, 2, tmp_path):
        assert sorted(by_dtype) == ["torch.bfloat16", "torch.float32"]
        for res in by_dtype.values():
            assert res["violations"] == ""
            assert res["simulated"] == res["cpu"]
