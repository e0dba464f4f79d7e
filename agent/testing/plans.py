"""Plans the tests set by hand from a solved one: its chunks and blocks, with every chunk offloaded and the
repeated blocks' activation modes spelled out, so a test meets offloading, checkpointing and swapping whatever
the solver would choose at the test's sizes."""

from __future__ import annotations

import copy
from itertools import cycle, islice
from typing import Any

from torch import nn

from agent.planning import solve_embedded
from agent.profiler import profile
from client.contract import Constraints, Placement, Plan
from client.contract.plan import ActivationMode

MODE_LETTERS = {"K": ActivationMode.keep, "C": ActivationMode.checkpoint, "S": ActivationMode.swap}


def offloaded_with_modes(plan: Plan, modes: str, *, n_buffers: int = 2) -> Plan:
    """`plan` with every chunk offloaded into `n_buffers` device buffers and the repeated blocks (the policy's
    blocks but the prologue and the epilogue) in `modes`, one letter each (K keep, C checkpoint, S swap); no
    predictions and no allocation (nothing was solved for this policy)."""
    if plan.policy is None:
        raise ValueError("plan.policy: the plan has none to change")
    policy = plan.policy.model_copy(deep=True)
    repeated = policy.blocks[1:-1]
    if len(modes) != len(repeated):
        raise ValueError(f"modes: {len(modes)} letters for {len(repeated)} repeated blocks")
    for c in policy.chunks:
        c.placement = Placement.offloaded
    policy.n_buffers = n_buffers
    for b, letter in zip(repeated, modes, strict=True):
        b.mode = MODE_LETTERS[letter]
    return plan.model_copy(update={"policy": policy, "predictions": None, "allocation": None})


def offloaded_plan(
    model: nn.Module, batch: Any, modes: str | None = None, *, n_buffers: int = 2, loss_fn: Any = None
) -> Plan:
    """`offloaded_with_modes` of the plan solved in-process for `model` on `batch` (profiled on a copy, without a
    device limit; `loss_fn` as `agent.profile` takes it, for a model without `.loss`); `modes` None: keep,
    checkpoint and swap in turn over the repeated blocks."""
    solved = solve_embedded(
        profile(copy.deepcopy(model), batch, loss_fn=loss_fn, repeats=1),
        Constraints(device_memory_bytes=2**34),
    )
    if modes is None:
        assert solved.policy is not None
        modes = "".join(islice(cycle("KCS"), len(solved.policy.blocks) - 2))
    return offloaded_with_modes(solved, modes, n_buffers=n_buffers)
