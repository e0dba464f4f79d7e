"""`agent.integrations.lightning.MemplanCallback` with the real `lightning.pytorch.Trainer`, CPU.

A LightningModule around a tiny Hugging Face llama built from config with the library's defaults; the
Trainer's own clipping (`gradient_clip_val=0.5`, active every step), an AdamW with a LambdaLR schedule from
`configure_optimizers`, a validation loader (Lightning's sanity check runs the wrapped model in eval mode
first), and a device limit that makes the planner offload.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import hf_jobs
import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

import agent
from agent.integrations.lightning import MemplanCallback

pytestmark = pytest.mark.slow
TOL = 1e-5
CLIP = 0.5


class CausalLM(pl.LightningModule):
    """What a Lightning user writes around a Hugging Face model: forward takes the batch, the step logs."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model
        self.history: list[dict[str, float]] = []

    def forward(self, **batch: Any) -> Any:
        return self.model(**batch)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self(**batch).loss
        self.log("train_loss", loss)
        self.history.append({"loss": loss.item(), "lr": self.optimizers().param_groups[0]["lr"]})
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self(**batch).loss)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        # the gradients Lightning is about to clip: every one must be there (offloaded ones on the host)
        grads = [p.grad for g in optimizer.param_groups for p in g["params"]]
        assert all(g is not None for g in grads), "a parameter has no gradient before clipping"
        norm = torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(g) for g in grads if g is not None])
        )
        self.history[-1]["grad_norm"] = norm.item()

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=2e-3)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def loaders() -> tuple[torch.utils.data.DataLoader, torch.utils.data.DataLoader]:
    data = hf_jobs.dataset()
    train = torch.utils.data.DataLoader(data[:48], batch_size=4, shuffle=True)
    val = torch.utils.data.DataLoader(data[48:56], batch_size=4)
    return train, val


def fit(
    model: torch.nn.Module,
    tmp: Path,
    *,
    steps: int,
    callback: MemplanCallback | None = None,
    accumulation: int = 1,
    ckpt_path: str | None = None,
    save_every: int | None = None,
) -> tuple[CausalLM, pl.Trainer]:
    module = CausalLM(model)
    callbacks: list[Any] = [callback] if callback is not None else []
    if save_every:
        callbacks.append(ModelCheckpoint(dirpath=tmp, every_n_train_steps=save_every, save_top_k=-1))
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=steps,
        gradient_clip_val=CLIP,
        accumulate_grad_batches=accumulation,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=bool(save_every),
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp,
        limit_val_batches=2,
        val_check_interval=2,
    )
    pl.seed_everything(7, verbose=False)
    train, val = loaders()
    trainer.fit(module, train, val, ckpt_path=ckpt_path)
    return module, trainer


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


def test_the_callback_refuses_mixed_precision_and_leaves_the_module_alone(tmp_path: Path) -> None:
    module = CausalLM(hf_jobs.build_model("llama"))
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=1,
        precision="bf16-mixed",
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
