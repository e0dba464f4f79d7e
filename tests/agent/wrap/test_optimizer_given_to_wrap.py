"""The optimizer object given to `agent.wrap`, used after it (session 23 probe).

Users keep the optimizer they built: a learning-rate scheduler made before `wrap` (the usual order in scripts:
optimizer, scheduler, then the model's setup), a loop that goes on calling `optimizer.step()` by its old name.
Before this session the scheduler drove nothing (the wrapped optimizer copied the parameter groups: the learning
rate stayed at its first value and torch warned that the scheduler stepped first), and the original's `step()`
stepped the parameters with a second, plain optimizer state, right only by accident of the undo of unconfirmed
host steps. Now the wrapped optimizer shares the original's `param_groups`, and the original is an alias of the
wrapped one until `unwrap` (`agent/runtime/optimizer_alias.py`), after which it is a plain optimizer again holding
the trained state.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable

import pytest
import torch
import transformers
from torch import nn

import agent
from agent.testing.loops import train_with_clipping
from agent.testing.model_zoo import build_with_library_defaults, sample_batch
from agent.testing.plans import offloaded_plan

pytestmark = pytest.mark.slow

Batch = dict[str, torch.Tensor]
Schedule = Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler]


def linear(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return transformers.get_linear_schedule_with_warmup(opt, 1, 6)


def loop(
    m: nn.Module,
    opt: torch.optim.Optimizer,
    sched: torch.optim.lr_scheduler.LRScheduler | None,
    batch: Batch,
    steps: int,
) -> list[float]:
    return train_with_clipping(m, opt, batch, steps=steps, scheduler=sched)


def setup() -> tuple[nn.Module, Batch]:
    model, cfg = build_with_library_defaults("llama", 4, 128, vocab=1000, seq=64)
    return model, sample_batch(cfg, 2, 32)


@pytest.mark.parametrize("planned", ["offloaded", "default"])
@pytest.mark.parametrize("stepped", ["wrapped", "original"])
@pytest.mark.parametrize("scheduled", ["before-wrap", "after-wrap-on-the-original"])
def test_a_scheduler_on_the_optimizer_given_to_wrap_drives_the_training(
    planned: str, stepped: str, scheduled: str
) -> None:
    model, batch = setup()
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, fused=True)
    expected = loop(reference, ref_opt, linear(ref_opt), batch, 4)

    m = copy.deepcopy(model)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True)
    sched = linear(opt) if scheduled == "before-wrap" else None
    how = {"plan": offloaded_plan(model, batch)} if planned == "offloaded" else {"sample_batch": batch}
    run = agent.wrap(m, opt, feedback_steps=None, **how)
    if sched is None:
        sched = linear(opt)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # torch's "lr_scheduler.step() before optimizer.step()"
        got = loop(run.model, run.optimizer if stepped == "wrapped" else opt, sched, batch, 4)
    assert got == expected
    assert run.optimizer.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"] < 1e-2
    final = dict(run.model.named_parameters())
    for name, p in reference.named_parameters():
        assert torch.equal(final[name], p), name
    state = opt.state_dict()  # the original's state_dict is the wrapped one's (the plain-PyTorch format)
    ref_state = ref_opt.state_dict()
    assert state["state"].keys() == ref_state["state"].keys()
    for k, s in ref_state["state"].items():
        for n, v in s.items():
            assert torch.equal(state["state"][k][n], v), (k, n)
    agent.unwrap(run)


def test_after_unwrap_the_original_optimizer_is_plain_again_and_continues_exactly() -> None:
    model, batch = setup()
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, fused=True)
    ref_sched = linear(ref_opt)
    expected = loop(reference, ref_opt, ref_sched, batch, 5)

    m = copy.deepcopy(model)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True)
    sched = linear(opt)
    run = agent.wrap(m, opt, plan=offloaded_plan(model, batch), feedback_steps=None)
    got = loop(run.model, opt, sched, batch, 3)
    plain = agent.unwrap(run)
    assert {"zero_grad", "state_dict", "load_state_dict", "add_param_group"}.isdisjoint(vars(opt))
    assert opt.step.__wrapped__ is type(opt).step  # the scheduler's own step wrapper again
    assert isinstance(opt.state, dict)  # torch's own state again, holding the trained moments
    got += loop(plain, opt, sched, batch, 2)
    assert got == expected
    for (name, p), q in zip(reference.named_parameters(), plain.parameters(), strict=True):
        assert torch.equal(q, p), name


def test_step_hooks_on_the_optimizer_given_to_wrap_run_and_it_cannot_be_copied_while_wrapped() -> None:
    """Session 23 review: a `register_step_post_hook` on the original optimizer ran 0 of 3 times through the alias
    (plain PyTorch: 3 of 3); `copy.deepcopy`/`pickle` of it failed with an AttributeError from deep inside torch
    (or made a file that failed to load). Now its hooks run around the wrapped step, and copying it while wrapped
    is a clear error naming `state_dict()`; after unwrap it copies as any optimizer."""
    import pickle

    from agent.runtime.optimizer_alias import AliasedOptimizerCopyError

    model, batch = setup()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    calls: list[str] = []
    opt.register_step_pre_hook(lambda o, args, kwargs: calls.append("pre"))
    run = agent.wrap(model, opt, plan=offloaded_plan(model, batch), feedback_steps=None)
    opt.register_step_post_hook(lambda o, args, kwargs: calls.append("post"))  # registered after wrap
    loop(run.model, opt, None, batch, 2)
    assert calls == ["pre", "post"] * 2
    for copy_it in (copy.deepcopy, pickle.dumps):
        with pytest.raises(AliasedOptimizerCopyError, match=r"save optimizer.state_dict\(\)"):
            copy_it(opt)
    agent.unwrap(run)
    assert isinstance(copy.deepcopy(opt), torch.optim.AdamW)
