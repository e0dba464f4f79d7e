"""The Lightning jobs the integration tests run, in the test's process or on every rank under the real launcher
(`torchrun --standalone --nproc-per-node 2 lightning_jobs.py JSON`: Lightning sees torchrun's environment, sets up
the process group itself, gloo on the CPU, and wraps the module in DistributedDataParallel with `strategy="ddp"`).
JSON: a list of job specs run one after the other.

A LightningModule around a tiny Hugging Face llama built from config with the library's defaults; the Trainer's
own clipping, an AdamW with a LambdaLR schedule from `configure_optimizers`, a validation loader.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import hf_jobs
import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from agent.integrations.lightning import MemplanCallback

CLIP = 0.5


class CausalLM(pl.LightningModule):
    """What a Lightning user writes around a Hugging Face model: forward takes the batch, the step logs."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model
        self.history: list[dict[str, float]] = []
        self.val_losses: list[float] = []  # every validation batch's loss (the sanity check's included)
        self.fail_at: tuple[int, int] | None = None  # (rank, batch): training_step raises there
        self.fused = False  # a fused AdamW (the kernel memplan's host steps run: bitwise the same steps)

    def forward(self, **batch: Any) -> Any:
        return self.model(**batch)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        if (self.global_rank, batch_idx) == self.fail_at:
            raise RuntimeError(f"the user's own error on rank {self.global_rank} at batch {batch_idx}")
        loss = self(**batch).loss
        self.log("train_loss", loss)
        self.history.append({"loss": loss.item(), "lr": self.optimizers().param_groups[0]["lr"]})
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        loss = self(**batch).loss
        self.val_losses.append(loss.item())
        self.log("val_loss", loss)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        # the gradients Lightning is about to clip: every one must be there (offloaded ones on the host)
        grads = [p.grad for g in optimizer.param_groups for p in g["params"]]
        assert all(g is not None for g in grads), "a parameter has no gradient before clipping"
        norm = torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(g) for g in grads if g is not None])
        )
        self.history[-1]["grad_norm"] = norm.item()

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=2e-3, fused=self.fused or None)
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
    clip: float = CLIP,
    devices: int = 1,
    fail_at: tuple[int, int] | None = None,
    precision: str = "32-true",
    fused: bool = False,
) -> tuple[CausalLM, pl.Trainer]:
    module = CausalLM(model)
    module.fail_at = fail_at
    module.fused = fused
    callbacks: list[Any] = [callback] if callback is not None else []
    if save_every:
        callbacks.append(ModelCheckpoint(dirpath=tmp, every_n_train_steps=save_every, save_top_k=-1))
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=steps,
        gradient_clip_val=clip,
        devices=devices,
        strategy="ddp" if devices > 1 else "auto",
        accumulate_grad_batches=accumulation,
        precision=precision,  # type: ignore[arg-type]
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


def run(spec: dict[str, Any]) -> dict[str, Any]:
    """One rank's fit as `spec` says (plain, or with the callback given a device limit or a plan file): the
    module's history and, wrapped, what the runtime did."""
    callback = MemplanCallback(**hf_jobs.wrap_kwargs(spec)) if spec.get("wrap") else None
    module, trainer = fit(
        hf_jobs.build_model("llama"),
        Path(spec["out"]),
        steps=spec["steps"],
        callback=callback,
        accumulation=spec.get("accumulation", 1),
        ckpt_path=spec.get("resume"),
        save_every=spec.get("save_every"),
        clip=spec.get("clip", CLIP),
        devices=2,
        fail_at=tuple(spec["fail_at"]) if spec.get("fail_at") else None,
    )
    out: dict[str, Any] = {
        "history": module.history,
        "val_losses": module.val_losses,
        "world_size": trainer.world_size,
    }
    if spec.get("final") and trainer.global_rank == 0:  # the module is plain again (unwrapped at the end)
        torch.save({k: v.detach().clone() for k, v in module.state_dict().items()}, spec["final"])
    if callback is not None:
        w = callback.wrapped
        assert w is not None and w.plan.policy is not None
        chunks = w.plan.policy.chunks
        c = w.runtime.counters
        out |= {
            "plan": w.plan.model_dump_json(),
            "offloaded": sum(ch.placement.value == "offloaded" for ch in chunks),
            "sharded": sum(ch.sharded for ch in chunks),
            "device_sharded": sum(ch.sharded and ch.placement.value == "persistent" for ch in chunks),
            "unwrapped": w.unwrapped,
            "strategy_model_is_the_module": trainer.strategy.model is module,
            "block_backward_sync_restored": "block_backward_sync" not in vars(trainer.strategy),
            "counters": {"reductions": c.grad_reductions, "backwards": c.iterations},
            # the report taken just before the callback unwrapped (which removes the monitor)
            "feedback_to": callback.report.feedback_to if callback.report is not None else None,
        }
    return out


def refused(spec: dict[str, Any]) -> dict[str, Any]:
    """The callback under a multi-process strategy it does not take (`spec["strategy"]`): the message."""
    from lightning.pytorch.strategies import DDPStrategy
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    module = CausalLM(hf_jobs.build_model("llama"))
    strategy: Any = spec["strategy"]
    if strategy == "ddp-comm-hook":
        strategy = DDPStrategy(ddp_comm_hook=default_hooks.allreduce_hook)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=1,
        callbacks=[MemplanCallback(device_memory=1 << 30, feedback_steps=None)],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=spec["out"],
    )
    train, _ = loaders()
    try:
        trainer.fit(module, train)
    except ValueError as exc:
        return {"refused": str(exc), "wrapped": getattr(module, "_memplan_wrapped", False)}
    return {"refused": None}


if __name__ == "__main__":
    specs = json.loads(sys.argv[1])
    hf_jobs.report([refused(s) if "strategy" in s else run(s) for s in specs])
