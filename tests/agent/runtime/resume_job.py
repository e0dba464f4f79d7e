"""A wrapped training job that saves at step k or resumes from that save (`python resume_job.py JSON`).

The checkpoint is what a user writes with plain PyTorch: the wrapped model's and optimizer's state_dict and
the scheduler's, in one `torch.save`. Default runtime options (overlapped, speculative host steps), clipping
active every step.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
from runtime_helpers import alternate, batches, plan_for, tiny_model

from agent.wrapping import wrap


def run(spec: dict[str, Any]) -> list[float]:
    model = tiny_model("llama")
    opt: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.1, fused=True)
    ckpt = Path(spec["checkpoint"])
    plan = plan_for(model, alternate)
    resume = spec.get("resume", False)
    if resume and spec.get("load_before_wrap"):
        state = torch.load(ckpt, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
    w = wrap(model, opt, plan=plan, feedback_steps=None)
    # a scheduler is built on the optimizer it drives, before that optimizer's state is loaded (its first step
    # sets the learning rate): so only when the state is loaded into the wrapped optimizer
    sched = (
        None
        if spec.get("load_before_wrap")
        else torch.optim.lr_scheduler.LambdaLR(w.optimizer, lambda s: 1.0 / (1 + s))
    )
    start = 0
    if resume:
        state = torch.load(ckpt, weights_only=True)
        if not spec.get("load_before_wrap"):
            w.model.load_state_dict(state["model"])
            w.optimizer.load_state_dict(state["optimizer"])
        if sched is not None:
            sched.load_state_dict(state["scheduler"])
        start = state["step"]
    losses = []
    data = batches(spec["steps"])
    for step in range(start, spec["steps"]):
        x = data[step]
        loss = w.model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(w.model.parameters(), 0.05)
        w.optimizer.step()
        if sched is not None:
            sched.step()
        w.optimizer.zero_grad()
        losses.append(loss.item())
        if not resume and step + 1 == spec["save_at"]:
            torch.save(
                {
                    "model": w.model.state_dict(),
                    "optimizer": w.optimizer.state_dict(),
                    "scheduler": sched.state_dict() if sched is not None else None,
                    "step": step + 1,
                },
                ckpt,
            )
    return losses


if __name__ == "__main__":
    sys.stdout.write("\nRESULT " + json.dumps(run(json.loads(sys.argv[1]))) + "\n")
