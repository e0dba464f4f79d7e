"""`agent.integrations.lightning.MemplanCallback` with the real `lightning.pytorch.Trainer`, CPU.

A LightningModule around a tiny Hugging Face llama built from config with the library's defaults; the
Trainer's own clipping (`gradient_clip_val=0.5`, active every step), an AdamW with a LambdaLR schedule from
`configure_optimizers`, a validation loader (Lightning's sanity check runs the wrapped model in eval mode
first), and a device limit that makes the planner offload.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import hf_jobs
import lightning.pytorch as pl
import pytest
import torch
from lightning_jobs import CLIP, CausalLM, fit, loaders

import agent
from agent.integrations.lightning import MemplanCallback

pytestmark = pytest.mark.slow
TOL = 1e-5


@pytest.fixture(scope="module")
def limit() -> int:
    """A device limit at 70% of the plain job's measured peak (the planner must offload)."""
    model = hf_jobs.build_model("llama")
    ids = torch.stack([d["input_ids"] for d in hf_jobs.dataset()[:4]])
    trace = agent.profile(
        model,
        {"input_ids": ids, "labels": ids},
        optimizer=torch.optim.AdamW(model.parameters()),
        repeats=1,
        allocation_trace=False,
    )
    return int(trace.measurements.peak_device_bytes * 0.7)


def assert_same(got: list[dict[str, float]], ref: list[dict[str, float]], *, exact: bool = False) -> None:
    assert len(got) == len(ref)
    for i, (g, r) in enumerate(zip(got, ref, strict=True)):
        for key in r:
            if exact:
                assert g[key] == r[key], f"step {i}: {key} {g[key]} vs {r[key]}"
            else:
                assert abs(g[key] - r[key]) <= TOL * abs(r[key]), f"step {i}: {key} {g[key]} vs {r[key]}"


@pytest.mark.parametrize("accumulation", [1, 2])
def test_the_callback_trains_like_plain_lightning_with_clipping_and_a_schedule(
    accumulation: int, limit: int, tmp_path: Path
) -> None:
    base = hf_jobs.build_model("llama")
    plain, _ = fit(copy.deepcopy(base), tmp_path / "plain", steps=5, accumulation=accumulation)
    cb = MemplanCallback(device_memory=limit, feedback_steps=None)
    got, trainer = fit(
        copy.deepcopy(base), tmp_path / "wrapped", steps=5, callback=cb, accumulation=accumulation
    )

    assert cb.wrapped is not None and cb.wrapped.plan.policy is not None
    assert any(c.placement.value == "offloaded" for c in cb.wrapped.plan.policy.chunks), "nothing offloaded"
    assert cb.wrapped.unwrapped and cb.report is not None  # unwrapped at the end of training
    assert not getattr(got, "_memplan_wrapped", False)
    assert trainer.strategy.optimizers[0] is cb.wrapped.original_optimizer
    steps = [h for h in plain.history if "grad_norm" in h]
    assert all(h["grad_norm"] > CLIP for h in steps), "clipping is not active"
    assert len({h["lr"] for h in plain.history}) > 1, "the schedule did not move the learning rate"
    assert_same(got.history, plain.history)
    # parameters: Adam's step is about lr * sign(grad) where a gradient is tiny, so last-bit differences of the
    # gradients (the host's reduction order) show as ~1e-7 absolute; 1e-6 is 1e-4 of what 5 steps moved them
    for (name, p), q in zip(plain.named_parameters(), got.parameters(), strict=True):
        assert torch.allclose(p, q, rtol=TOL, atol=1e-6), (name, (p - q).abs().max().item())
    # the original optimizer holds the trained state after unwrap, as plain Lightning's optimizer does
    ref_opt = _state(plain.trainer.strategy.optimizers[0])
    got_opt = _state(trainer.strategy.optimizers[0])
    for k in ref_opt:
        assert torch.allclose(got_opt[k], ref_opt[k], rtol=1e-4, atol=1e-8), k


def _state(opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    sd = opt.state_dict()["state"]
    return {f"{i}.{n}": v for i, s in sd.items() for n, v in s.items() if torch.is_tensor(v) and v.dim() > 0}


def test_resume_from_a_lightning_checkpoint_continues_as_plain_lightning_does(
    limit: int, tmp_path: Path
) -> None:
    """Save at step 3, resume a new Trainer and module (from other weights) with `ckpt_path`: the wrapped job
    continues as plain Lightning's own resume does. (Lightning restarts a mid-epoch dataloader on resume, so a
    plain resumed run is itself not the uninterrupted one; memplan must match the plain resumed run.)"""
    base = hf_jobs.build_model("llama")

    def run(wrap: bool, tag: str) -> tuple[list[dict[str, float]], list[dict[str, float]]]:
        cb = MemplanCallback(device_memory=limit, feedback_steps=None) if wrap else None
        full, _ = fit(copy.deepcopy(base), tmp_path / tag, steps=6, callback=cb, save_every=3)
        ckpt = sorted((tmp_path / tag).glob("*step=3*.ckpt"))
        assert ckpt, list((tmp_path / tag).iterdir())
        other = copy.deepcopy(base)  # other weights: the checkpoint must bring them back
        with torch.no_grad():
            for p in other.parameters():
                p.add_(1.0)
        again = None
        if cb is not None:
            assert cb.wrapped is not None
            again = MemplanCallback(plan=cb.wrapped.plan, feedback_steps=None)
        resumed, _ = fit(other, tmp_path / f"{tag}-resumed", steps=6, callback=again, ckpt_path=str(ckpt[0]))
        if again is not None:
            assert again.wrapped is not None and again.wrapped.plan == cb.wrapped.plan  # type: ignore[union-attr]
            assert any(c.placement.value == "offloaded" for c in again.wrapped.plan.policy.chunks)  # type: ignore[union-attr]
        return full.history, resumed.history

    plain_full, plain_resumed = run(False, "plain")
    got_full, got_resumed = run(True, "wrapped")
    assert len(plain_resumed) == 3
    assert_same(got_full, plain_full)
    assert_same(got_resumed, plain_resumed)


def test_the_callback_trains_like_plain_lightning_in_bf16_mixed_precision(limit: int, tmp_path: Path) -> None:
    """`precision="bf16-mixed"` (Lightning's autocast around each step; refused before session 22): the callback
    profiles under the same autocast (the plan's activations are the bf16 ones) and trains as plain Lightning.
    A fused AdamW on both sides: with the default (foreach) one the fp32 masters differ from the host steps' in
    the last bit, which bf16 casts of the weights turn into ~1e-5 relative differences of the loss by step 3
    (the fp32 runs differ there by ~1e-7). Lightning refuses to clip with a fused optimizer under mixed
    precision, so this runs without clipping (clipping under autocast: `tests/agent/wrap/test_autocast.py`)."""
    base = hf_jobs.build_model("llama")
    job = {"steps": 5, "precision": "bf16-mixed", "fused": True, "clip": 0.0}
    plain, _ = fit(copy.deepcopy(base), tmp_path / "plain", **job)  # type: ignore[arg-type]
    cb = MemplanCallback(device_memory=limit, feedback_steps=None)
    got, _ = fit(copy.deepcopy(base), tmp_path / "wrapped", callback=cb, **job)  # type: ignore[arg-type]
    assert cb.wrapped is not None and cb.wrapped.plan.policy is not None
    assert any(c.placement.value == "offloaded" for c in cb.wrapped.plan.policy.chunks), "nothing offloaded"
    assert [h["loss"] for h in got.history] == [h["loss"] for h in plain.history]
    assert_same(got.history, plain.history)

    assert cb.wrapped.source is not None and cb.wrapped.source.trace is not None
    ids = torch.stack([d["input_ids"] for d in hf_jobs.dataset()[:4]])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under = agent.profile(base, {"input_ids": ids, "labels": ids}, repeats=1, allocation_trace=False)
    profiled = cb.wrapped.source.trace.measurements.blocks[1].activation_bytes
    assert profiled == under.measurements.blocks[1].activation_bytes


def test_the_callback_refuses_an_unsupported_precision_and_leaves_the_module_alone(tmp_path: Path) -> None:
    module = CausalLM(hf_jobs.build_model("llama"))
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=1,
        precision="16-true",
        callbacks=[MemplanCallback(device_memory=1 << 30, feedback_steps=None)],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        default_root_dir=tmp_path,
    )
    train, _ = loaders()
    with pytest.raises(ValueError, match="trainer.precision"):
        trainer.fit(module, train)
    assert not getattr(module, "_memplan_wrapped", False)


@pytest.fixture(scope="module")
def two_rank_plans(limit: int, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The callback's plan under the device limit (one process; it offloads), made for 2 ranks two ways whatever
    the planner would choose on the shared CPU: "host" shards every offloaded chunk across the ranks (each holds
    half in host memory); "device" also makes every other chunk persistent and sharded on the device (ZeRO-3:
    `state_dict()` is a collective)."""
    from client.contract import Placement

    root = tmp_path_factory.mktemp("lightning_plans")
    cb = MemplanCallback(device_memory=limit, feedback_steps=None)
    fit(hf_jobs.build_model("llama"), root / "one", steps=1, callback=cb)
    assert cb.wrapped is not None and cb.wrapped.plan.policy is not None
    paths = {"host": root / "host.json", "device": root / "device.json"}
    hf_jobs.plan_for_two_ranks(cb.wrapped.plan, paths["host"])
    device = hf_jobs.plan_for_two_ranks(cb.wrapped.plan, paths["device"], persistent_parity=1)
    assert any(c.placement == Placement.offloaded for c in device.policy.chunks), (
        "the device plan offloads nothing"
    )
    return paths


LIGHTNING_JOBS = Path(__file__).parent / "lightning_jobs.py"
TWO_RANKS: dict[str, Any] = {"steps": 4, "accumulation": 2, "save_every": 2}


@pytest.fixture(scope="module")
def two_ranks(
    limit: int, two_rank_plans: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, list[Any]]:
    """Two launches of `lightning_jobs.py` under torchrun (2 ranks, `strategy="ddp"`, gloo). The first: plain
    DDP; the callback with the device limit (every rank profiles, rank 0 plans and broadcasts); the callback
    with the host-sharded and the device-sharded plans; every one saving a checkpoint at step 2 of 4; an FSDP
    DDP communication hook (refused). The second: every run resumed from its step-2 checkpoint."""
    root = tmp_path_factory.mktemp("lightning_two_ranks")
    runs = {
        "plain": {},
        # the user's path: the device limit only (every rank profiles, rank 0 plans), feedback after 4 steps
        "limit": {"wrap": True, "device_memory": limit, "feedback": str(root / "feedback.jsonl")},
        "host": {"wrap": True, "plan": str(two_rank_plans["host"])},
        "device": {"wrap": True, "plan": str(two_rank_plans["device"])},
    }
    first = [
        {**TWO_RANKS, **spec, "out": str(root / name), "final": str(root / f"{name}.pt")}
        for name, spec in runs.items()
    ]
    # (Lightning builds its FSDP strategy on a GPU only: the check for other strategies runs there)
    refusals = [{"strategy": "ddp-comm-hook", "out": str(root / "hook")}]
    full = hf_jobs.torchrun(first + refusals, LIGHTNING_JOBS)
    resumed = []
    for name, spec in runs.items():
        ckpt = sorted((root / name).glob("*step=2*.ckpt"))
        assert len(ckpt) == 1, list((root / name).iterdir())
        resumed.append({**TWO_RANKS, **spec, "out": str(root / f"{name}-resumed"), "resume": str(ckpt[0])})
    again = hf_jobs.torchrun(resumed, LIGHTNING_JOBS)
    return root, [a + b for a, b in zip(full, again, strict=True)]


@pytest.mark.distributed
def test_the_callback_under_lightnings_ddp_trains_like_plain_ddp(two_ranks: tuple[Path, list[Any]]) -> None:
    """torchrun, 2 ranks, `strategy="ddp"`, clipping, a schedule, 2 accumulation micro-steps: with the device
    limit (the plan rank 0 made), with offloaded chunks sharded in host memory and with chunks sharded on the
    device, the callback takes the module out of Lightning's DistributedDataParallel and logs plain DDP's losses,
    clipped norms and learning rates on every rank, ending with its parameters, within 1e-5 relative; each
    optimizer step averages every chunk's gradient once (Lightning's no_sync on the first micro-step is the
    runtime's)."""
    root, results = two_ranks
    # the monitor's metered step ran inside Lightning's loop on every rank (the slowest rank's time, the largest
    # rank's peaks), rank 0 recorded it, and training stayed DDP's
    assert results[0][1]["feedback_to"].startswith("recorded"), results[0][1]["feedback_to"]
    assert results[1][1]["feedback_to"] == "not sent by rank 1 (rank 0 sends the job's feedback)"
    records = [json.loads(line) for line in (root / "feedback.jsonl").read_text().splitlines()]
    assert len(records) == 1, records  # from rank 0 only (its resume ran 2 steps: none)
    for plain, limit, host, device, *_ in results:
        steps = [h for h in plain["history"] if "grad_norm" in h]
        assert len(steps) == TWO_RANKS["steps"] and all(h["grad_norm"] > CLIP for h in steps)
        assert len({h["lr"] for h in plain["history"]}) > 1
        assert limit["offloaded"] > 0 and host["sharded"] > 0 and device["device_sharded"] > 0
        for got in (limit, host, device):
            assert got["world_size"] == 2 and got["unwrapped"] and got["block_backward_sync_restored"]
            assert got["strategy_model_is_the_module"]  # no DistributedDataParallel left around it
            assert_same(got["history"], plain["history"])
            # validation (the sanity check, then every 2 steps) on every rank: device-sharded forwards gather
            assert len(plain["val_losses"]) >= 4
            assert [round(v, 4) for v in got["val_losses"]] == [round(v, 4) for v in plain["val_losses"]]
            assert all(
                abs(g - r) <= TOL * abs(r)
                for g, r in zip(got["val_losses"], plain["val_losses"], strict=True)
            )
            chunks = len(json.loads(got["plan"])["policy"]["chunks"])
            c = got["counters"]
            assert c["backwards"] == TWO_RANKS["steps"] * TWO_RANKS["accumulation"]
            assert c["reductions"] == chunks * TWO_RANKS["steps"], (c, chunks)
    ref = torch.load(root / "plain.pt", weights_only=True)
    for name in ("limit", "host", "device"):
        got = torch.load(root / f"{name}.pt", weights_only=True)
        assert got.keys() == ref.keys()
        for k in ref:
            assert torch.allclose(got[k], ref[k], rtol=TOL, atol=1e-6), (name, k)


@pytest.mark.distributed
def test_a_checkpoint_of_the_callback_under_lightnings_ddp_resumes_as_plain_ddp_does(
    two_ranks: tuple[Path, list[Any]],
) -> None:
    """Lightning calls `state_dict()` on every rank (a collective with device-sharded chunks) and writes rank
    0's full, plain-PyTorch checkpoint; each wrapped run resumed from its own step-2 checkpoint continues as
    plain DDP resumed from its own does."""
    _, results = two_ranks
    for rank in results:
        plain_resumed = rank[5]
        for got in rank[6:9]:
            assert got["sharded"] or got["offloaded"]
            assert_same(got["history"], plain_resumed["history"])


@pytest.mark.distributed
def test_the_callback_refuses_a_ddp_communication_hook_naming_it(two_ranks: tuple[Path, list[Any]]) -> None:
    """A hook would compress or reshape the gradients' averaging, which memplan does itself: every rank
    refuses before any collective (nothing hangs), the module is left unwrapped."""
    _, results = two_ranks
    for rank in results:
        hook = rank[4]
        assert hook["refused"] is not None and hook["refused"].startswith("DDPStrategy(ddp_comm_hook=...)")
        assert "allreduce_hook" in hook["refused"] and not hook["wrapped"]


@pytest.mark.distributed
def test_a_rank_raising_alone_under_lightnings_ddp_stops_the_job_with_its_own_error(
    two_rank_plans: dict[str, Path], tmp_path: Path
) -> None:
    """Rank 1's `training_step` raises at its third batch while rank 0 trains on (device- and host-sharded
    chunks). The callback's `on_exception` on rank 1 undoes its own guards only: a full `unwrap` there is a
    collective, which waited for rank 0 (itself waiting in the step's collectives) until gloo's 30-minute
    timeout. Now rank 1 exits with the user's error and the launcher stops rank 0."""
    spec = {
        **TWO_RANKS,
        "wrap": True,
        "plan": str(two_rank_plans["device"]),
        "out": str(tmp_path),
        "fail_at": [1, 2],
    }
    proc = hf_jobs.launch([spec], LIGHTNING_JOBS, timeout_s=240)
    assert proc.returncode != 0
    assert "the user's own error on rank 1 at batch 2" in proc.stderr, proc.stderr[-3000:]
    assert "RankArrivalError" not in proc.stderr
