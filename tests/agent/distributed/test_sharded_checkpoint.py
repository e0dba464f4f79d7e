"""Sharded checkpoints (issue 20): saved per rank at 2 ranks, loaded by plain PyTorch, at 4 ranks and at 1 process.

A tiny Hugging Face llama (library defaults) trains 2 steps under plain DDP and under memplan with every
offloaded chunk sharded over 2 ranks (gloo, CPU); memplan saves with `agent.checkpoint.save_sharded`. The
continuations (plain PyTorch via `load_full`, memplan at 4 ranks and in one process via `load_sharded`) train 2
more steps on the same data and must reproduce the uninterrupted DDP run's losses within 1e-5 relative. Before
`agent.checkpoint` existed each of these failed at import. Marked `distributed`: `pytest -m distributed`.
"""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from checkpoint_jobs import AFTER, SAVE_WORLD, CkptCase, continuation, make_model, spawn
from ddp_jobs import adamw
from sharded_jobs import state_rel_diff

import agent
from agent.checkpoint import CheckpointError, load_full, load_sharded, rank_file
from agent.runtime import manual_plan

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

TOL = 1e-5


def rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b, strict=True))


def mean_over_ranks(results: list[dict[str, Any]], key: str) -> list[float]:
    return [sum(r[key][s] for r in results) / len(results) for s in range(AFTER)]


def train_after(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[float]:
    """The continuation in one process: both saving ranks' batches at once (the mean of their losses)."""
    losses = []
    for s in range(AFTER):
        x = continuation(s, 0, 1)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    root = tmp_path_factory.mktemp("ckpt")
    (root / "out").mkdir()
    case = CkptCase(directory=str(root / "ckpt"), offload="alternate")  # sharded and replicated chunks
    results = spawn("save", case, SAVE_WORLD, root / "out")
    return root / "ckpt", results


def test_save_writes_one_file_per_rank_and_matches_the_gathered_full_state(
    saved: tuple[Path, list[dict[str, Any]]],
) -> None:
    directory, results = saved
    for res in results:
        assert rel(res["losses"], res["ref_before"]) <= TOL  # memplan trained as DDP up to the checkpoint
        assert res["written"] == ["meta.pt", "rank0.pt", "rank1.pt"]  # no temporary file left, none missing
    assert (
        results[0]["replicated_pieces"] > 0
    )  # the persistent chunks' parameters, whole, in rank 0's meta.pt
    # the per-rank files assemble exactly the optimizer state `optimizer.state_dict()` all-gathers
    assert results[0]["full_vs_gathered_optimizer"] == 0.0


def test_load_full_continues_in_plain_pytorch_as_uninterrupted_ddp(
    saved: tuple[Path, list[dict[str, Any]]],
) -> None:
    directory, results = saved
    model_sd, optim_sd = load_full(directory)
    ref = torch.load(directory.parent / "ddp_at_save.pt", weights_only=True)
    assert model_sd.keys() == ref["model"].keys()
    assert max(float((model_sd[k] - v).abs().max()) for k, v in ref["model"].items()) <= 1e-5
    assert state_rel_diff(optim_sd, ref["optimizer"]) <= TOL
    model = make_model("hf-llama")
    opt = adamw(model)
    model.load_state_dict(model_sd)
    opt.load_state_dict(optim_sd)
    losses = train_after(model, opt)
    print(
        f"load_full -> plain PyTorch vs DDP: losses {rel(losses, mean_over_ranks(results, 'ref_after')):.2e} relative"
    )
    assert rel(losses, mean_over_ranks(results, "ref_after")) <= TOL, (losses, results)


def test_load_sharded_at_four_ranks_continues_as_uninterrupted_ddp(
    saved: tuple[Path, list[dict[str, Any]]], tmp_path: Path
) -> None:
    directory, results = saved
    loaded = spawn("load", CkptCase(directory=str(directory)), 4, tmp_path)
    assert all(r["sharded_chunks"] > 0 for r in loaded)
    losses = mean_over_ranks(loaded, "losses")
    print(
        f"load_sharded at 4 ranks vs DDP: losses {rel(losses, mean_over_ranks(results, 'ref_after')):.2e} relative"
    )
    assert rel(losses, mean_over_ranks(results, "ref_after")) <= TOL, (losses, results)


def test_load_sharded_in_one_process_refuses_a_bad_file_untouched_then_continues(
    saved: tuple[Path, list[dict[str, Any]]], tmp_path: Path
) -> None:
    directory, results = saved
    model = make_model("hf-llama")
    plan = manual_plan(model, chunk_size_bytes=1 << 16, offload="all", n_buffers=2)
    wrapped = agent.wrap(model, adamw(model), plan=plan, feedback_steps=None)
    before = {k: v.clone() for k, v in wrapped.model.state_dict().items()}
    # a missing rank file and a corrupted one: an error naming the file, and the model is as it was
    broken = tmp_path / "broken"
    shutil.copytree(directory, broken)
    (broken / rank_file(1)).unlink()
    with pytest.raises(CheckpointError, match=rf"{broken / rank_file(1)}: missing"):
        load_sharded(wrapped, broken)
    shutil.copy(directory / rank_file(1), broken / rank_file(1))
    data = (directory / rank_file(0)).read_bytes()
    (broken / rank_file(0)).write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=rf"{broken / rank_file(0)}: unreadable"):
        load_sharded(wrapped, broken)
    after = wrapped.model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())
    assert wrapped.optimizer.state_dict()["state"] == {}
    with contextlib.suppress(FileNotFoundError):
        (broken / rank_file(0)).unlink()
    # the good checkpoint loads (an unsharded plan, no process group) and training continues as DDP's
    load_sharded(wrapped, directory)
    losses = train_after(wrapped.model, wrapped.optimizer)
    print(
        f"load_sharded in 1 process vs DDP: losses {rel(losses, mean_over_ranks(results, 'ref_after')):.2e} relative"
    )
    assert rel(losses, mean_over_ranks(results, "ref_after")) <= TOL, (losses, results)


def test_bf16_compute_saves_the_fp32_master_shards_and_tied_weights_under_both_names(tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    case = CkptCase(directory=str(tmp_path / "ckpt"), kind="mlp", bf16=True, offload="alternate", tied=True)
    res = spawn("save", case, SAVE_WORLD, tmp_path / "out")[0]
    assert res["model_dtypes"] == ["torch.float32"] and res["replicated_pieces"] > 0
    # the saved values are exactly the gathered fp32 masters, not the rounded bf16 compute copy
    assert res["model_vs_masters"] and max(res["model_vs_masters"]) == 0.0 and res["model_off_bf16"] > 0
    assert res["full_vs_gathered_optimizer"] == 0.0
    model_sd, optim_sd = load_full(tmp_path / "ckpt")
    assert torch.equal(model_sd["head.weight"], model_sd["embed.weight"])
    plain = make_model("mlp", tied=True)
    opt = adamw(plain)
    plain.load_state_dict(model_sd)
    opt.load_state_dict(optim_sd)
    assert plain.head.weight is plain.embed.weight and torch.equal(
        plain.head.weight, model_sd["embed.weight"]
    )
    # memplan in bf16 at 4 ranks: its fp32 master shards are the saved fp32 values, not the bf16 compute copy's
    (tmp_path / "load").mkdir()
    loaded = spawn("load", case, 4, tmp_path / "load")
    for r in loaded:
        assert r["sharded_chunks"] > 0 and r["masters_vs_saved"] and max(r["masters_vs_saved"]) == 0.0


def test_one_process_saves_after_the_step_only_and_loads_back(tmp_path: Path) -> None:
    model = make_model("mlp")
    plan = manual_plan(model, chunk_size_bytes=1 << 14, offload="all", n_buffers=2)
    wrapped = agent.wrap(model, adamw(model), plan=plan, feedback_steps=None)
    x = continuation(0, 0, 1)
    wrapped.model(input_ids=x, labels=x).loss.backward()
    # the host optimizer has stepped speculatively during backward: not a state to save
    with pytest.raises(CheckpointError, match="between backward and optimizer.step"):
        agent.checkpoint.save_sharded(wrapped, tmp_path / "ckpt")
    wrapped.optimizer.step()
    wrapped.optimizer.zero_grad()
    agent.checkpoint.save_sharded(wrapped, tmp_path / "ckpt")
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["meta.pt", "rank0.pt"]
    model_sd, optim_sd = load_full(tmp_path / "ckpt")
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in model_sd.items())
    assert state_rel_diff(optim_sd, wrapped.optimizer.state_dict()) == 0.0
