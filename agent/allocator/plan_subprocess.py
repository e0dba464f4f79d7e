"""Get a plan for `wrap(..., allocation="planned")` in a child process, so this process never touches CUDA first.

PyTorch can swap its CUDA allocator only before CUDA is initialised. Getting a plan initialises it: the
hardware probe and the profiled iteration run on the GPU. So when `wrap` must both plan and install the
planned allocator, the planning runs in a fresh interpreter: the job (model, optimizer, batch, loss
function, blocks) is saved with `torch.save` (one pickle, so shared tensors and the blocks stay the
model's), the child runs `agent.planning.obtain_plan` (history, service or in-process solve, exactly as
`wrap` would) and records the managed iteration on the CPU (`agent.allocator.managed`), and writes the
plan back as JSON. The child's CUDA context dies with it; this process then installs the allocator.

What cannot cross: a loss function or a model class that pickle cannot name (a lambda, a class defined in
the script run as `__main__`). Then the error says so and names the way out: save a plan once
(`agent.plan_with_allocation`) and start the training script with `agent.install_allocator(plan_file)`,
or pass `plan=` to `wrap`.

Runs on CPU in the tests (the child plans for the CPU); on a GPU the child profiles on it. Not run on a
GPU where this was written.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from agent.allocator.managed import has_managed_allocation, record_managed_trace
from agent.allocator.publish import place_and_publish
from agent.planning import PlanSource, obtain_plan
from client.contract import Plan

if TYPE_CHECKING:
    from torch import nn

    from agent.runtime.options import RuntimeOptions

CHILD_TIMEOUT_S = 3600.0


class PlanSubprocessError(RuntimeError):
    """The child process could not produce a plan (its error is in the message)."""


def obtain_plan_in_subprocess(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    sample_batch: Any,
    *,
    loss_fn: Any = None,
    blocks: Any = None,
    options: RuntimeOptions | None = None,
    timeout_s: float = CHILD_TIMEOUT_S,
    **obtain_kwargs: Any,
) -> PlanSource:
    """`obtain_plan(...)` plus the managed allocation, run in a fresh interpreter (see the module doc)."""

    with tempfile.TemporaryDirectory(prefix="memplan-plan-") as tmp:
        job, out = Path(tmp) / "job.pt", Path(tmp) / "plan.json"
        payload = {
            "model": model,
            "optimizer": optimizer,
            "batch": sample_batch,
            "loss_fn": loss_fn,
            "blocks": list(blocks) if blocks is not None else None,
            "options": options,
            "kwargs": obtain_kwargs,
        }
        try:
            torch.save(payload, job)
        except Exception as exc:  # pickle's errors differ by object: name the argument that cannot cross
            what = _unpicklable(payload)
            raise ValueError(
                f"{what}: cannot be sent to the planning subprocess ({type(exc).__name__}: {exc}). "
                "allocation='planned' on CUDA must plan before CUDA is initialised, in a child process; "
                "use a module-level function or class, or save a plan once with "
                "agent.plan_with_allocation(...) and pass plan= to wrap (or call "
                "agent.install_allocator(plan_file) first thing in the script)"
            ) from exc
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)  # the child imports what we import
        proc = subprocess.run(
            [sys.executable, "-m", "agent.allocator.plan_subprocess", str(job), str(out)],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
        if proc.returncode != 0 or not out.exists():
            raise PlanSubprocessError(
                f"memplan: planning in a child process (allocation='planned' on CUDA) failed with exit code "
                f"{proc.returncode}:\n{proc.stderr[-4000:]}"
            )
        result = json.loads(out.read_text())
    return PlanSource(
        Plan.model_validate(result["plan"]),
        result["origin"],
        plan_id=result["plan_id"],
        server=result["server"],
        message=result["message"] + " (planned in a child process, before CUDA was initialised here)",
    )


def _unpicklable(payload: dict[str, Any]) -> str:
    """The argument of `wrap` that pickle refuses (the first one)."""

    names = {"batch": "sample_batch", "kwargs": "wrap's arguments"}
    for key, value in payload.items():
        try:
            pickle.dumps(value)
        except Exception:  # noqa: BLE001 - any failure means this is the one
            return names.get(key, key)
    return "the job"


def _child(job: Path, out: Path) -> None:
    """The child's side: plan the job as `wrap` would, record the managed iteration, write the plan."""

    payload = torch.load(job, weights_only=False)
    model, optimizer, batch = payload["model"], payload["optimizer"], payload["batch"]
    source = obtain_plan(
        model,
        optimizer,
        batch,
        loss_fn=payload["loss_fn"],
        blocks=payload["blocks"],
        options=payload["options"],
        **payload["kwargs"],
    )
    if not has_managed_allocation(source.plan):
        events = record_managed_trace(
            model, optimizer, source.plan, batch, loss_fn=payload["loss_fn"], options=payload["options"]
        )
        source = place_and_publish(source, events)
    plan = source.plan
    out.write_text(
        json.dumps(
            {
                "plan": plan.model_dump(mode="json"),
                "origin": source.origin,
                "plan_id": source.plan_id,
                "server": source.server,
                "message": source.message,
            }
        )
    )


if __name__ == "__main__":
    _child(Path(sys.argv[1]), Path(sys.argv[2]))
