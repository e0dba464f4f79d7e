"""The wrapped optimizer behaves as the user's: hyper-parameters, groups, schedulers, state dicts, clipping."""

from __future__ import annotations

import copy
import io
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from runtime_helpers import (
    Trainer,
    alternate,
    batches,
    clone,
    max_rel_diff,
    param_rel_diff,
    plain_trainer,
    plan_for,
    tiny_model,
    train,
)

from agent.runtime import RuntimeOptions, manual_plan
from agent.wrapping import Wrapped, unwrap, wrap

TOL = 1e-5
MakeOpt = Callable[[torch.nn.Module], torch.optim.Optimizer]


def grouped_adamw(m: torch.nn.Module) -> torch.optim.Optimizer:
    """The usual LLM set-up: no weight decay on biases and norms (two groups interleaved in every chunk)."""
    decay = [p for n, p in m.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in m.named_parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=2e-3,
        betas=(0.8, 0.95),
        eps=1e-6,
        fused=True,
    )


OPTIMIZERS: dict[str, MakeOpt] = {
    "adamw-groups": grouped_adamw,
    "adam-l2-amsgrad": lambda m: torch.optim.Adam(
        m.parameters(), lr=1e-3, weight_decay=0.01, amsgrad=True, fused=True
    ),
    "sgd-nesterov": lambda m: torch.optim.SGD(
        m.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-4, fused=True
    ),
}


@dataclass
class Reference:
    """A tiny model, its batches and the plain-PyTorch run the wrapped one must reproduce: `base` is what a
    test wraps (cloned), `model` and `trainer` train it without memplan."""

    base: torch.nn.Module
    data: list[torch.Tensor]
    model: torch.nn.Module
    trainer: Trainer


def reference(kind: str, n_batches: int, make_opt: MakeOpt = grouped_adamw) -> Reference:
    base = tiny_model(kind)
    data = batches(n_batches)
    ref_model = clone(base)
    return Reference(base, data, ref_model, plain_trainer(ref_model, make_opt))


def assert_reproduces(got: list[float], ref: list[float], w: Wrapped, ref_model: torch.nn.Module) -> None:
    """The wrapped run's losses, and once its host steps are done its parameters, are plain PyTorch's."""
    assert max_rel_diff(got, ref) <= TOL
    w.synchronize()
    assert param_rel_diff(w.model, ref_model)[0] <= TOL


def wrapped_run(
    base: torch.nn.Module,
    make_opt: MakeOpt,
    data: list[torch.Tensor],
    *,
    offload: object = alternate,
    options: RuntimeOptions | None = None,
    **train_args: object,
) -> tuple[list[float], Wrapped]:
    model = clone(base)
    w = wrap(model, make_opt(model), plan=plan_for(model, offload), options=options)  # type: ignore[arg-type]
    losses = train(Trainer(w.model, w.optimizer, clip=w.clip_grad_norm_), data, **train_args)  # type: ignore[arg-type]
    return losses, w


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_optimizer_hyper_parameters_and_groups_are_reproduced(name: str) -> None:
    r = reference("llama", 8, OPTIMIZERS[name])
    ref = train(r.trainer, r.data)
    got, w = wrapped_run(r.base, OPTIMIZERS[name], r.data)
    assert_reproduces(got, ref, w, r.model)


def test_lr_scheduler_on_the_wrapped_optimizer_drives_device_and_host_steps() -> None:
    r = reference("gpt2", 10)

    def sched(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
        return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=5e-3, total_steps=len(r.data))

    r.trainer.scheduler = sched(r.trainer.optimizer)
    ref = train(r.trainer, r.data)

    model = clone(r.base)
    w = wrap(model, grouped_adamw(model), plan=plan_for(model, "all"))
    t = Trainer(w.model, w.optimizer, scheduler=sched(w.optimizer))
    got = train(t, r.data)
    assert w.optimizer.param_groups[0]["lr"] == r.trainer.optimizer.param_groups[0]["lr"]
    assert_reproduces(got, ref, w, r.model)


def test_optimizer_state_dict_has_the_plain_pytorch_format_and_values() -> None:
    r = reference("llama", 3)
    train(r.trainer, r.data)
    _, w = wrapped_run(r.base, grouped_adamw, r.data)
    ours, theirs = w.optimizer.state_dict(), r.trainer.optimizer.state_dict()
    assert ours["param_groups"] == theirs["param_groups"]
    assert ours["state"].keys() == theirs["state"].keys()
    for k, st in theirs["state"].items():
        assert ours["state"][k].keys() == st.keys()
        for key, v in st.items():
            torch.testing.assert_close(ours["state"][k][key], v, rtol=TOL, atol=1e-7)


def test_optimizer_state_is_readable_per_parameter_as_in_plain_pytorch() -> None:
    r = reference("gpt2", 3)
    train(r.trainer, r.data)
    _, w = wrapped_run(r.base, grouped_adamw, r.data)
    ref_params = dict(r.model.named_parameters())
    assert len(w.optimizer.state) == len(r.trainer.optimizer.state)
    for name, p in w.model.named_parameters():
        ours, theirs = w.optimizer.state[p], r.trainer.optimizer.state[ref_params[name]]
        assert ours.keys() == theirs.keys()
        torch.testing.assert_close(ours["exp_avg_sq"], theirs["exp_avg_sq"], rtol=TOL, atol=1e-12)


def test_checkpoint_and_resume_mid_run_gives_the_same_trajectory() -> None:
    r = reference("gpt2", 20)
    ref = train(r.trainer, r.data)

    # first half, then save model and optimizer exactly as one would with plain PyTorch
    first, w = wrapped_run(r.base, grouped_adamw, r.data[:10], offload="all")
    buf = io.BytesIO()
    torch.save({"model": w.model.state_dict(), "optimizer": w.optimizer.state_dict()}, buf)

    # a fresh process would build a differently initialised model and wrap it with the same plan
    fresh = tiny_model("gpt2")
    with torch.no_grad():
        for p in fresh.parameters():
            p.mul_(0.5)
    w2 = wrap(fresh, grouped_adamw(fresh), plan=plan_for(fresh, "all"))
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    w2.model.load_state_dict(ckpt["model"])
    w2.optimizer.load_state_dict(ckpt["optimizer"])
    second = train(Trainer(w2.model, w2.optimizer), r.data[10:], seed=4321)

    # the reference continues from its own step 10 with the same dropout seed
    ref_resumed_model = clone(r.base)
    ref_t = plain_trainer(ref_resumed_model, grouped_adamw)
    train(ref_t, r.data[:10])
    ref_second = train(ref_t, r.data[10:], seed=4321)
    assert max_rel_diff(first, ref[:10]) <= TOL
    assert_reproduces(second, ref_second, w2, ref_resumed_model)


def test_plain_pytorch_checkpoint_loads_into_the_wrapped_optimizer() -> None:
    r = reference("llama", 8)
    train(r.trainer, r.data[:4])
    model = clone(r.base)
    model.load_state_dict(r.model.state_dict())
    w = wrap(model, grouped_adamw(model), plan=plan_for(model, alternate))
    # a copy, as a checkpoint file would give (a live state dict shares tensors, as in plain PyTorch)
    w.optimizer.load_state_dict(copy.deepcopy(r.trainer.optimizer.state_dict()))
    got = train(Trainer(w.model, w.optimizer), r.data[4:], seed=7)
    ref = train(r.trainer, r.data[4:], seed=7)
    assert max_rel_diff(got, ref) <= TOL


@pytest.mark.parametrize("offload", ["none", "all", "alternate"])
def test_clip_grad_norm_spans_persistent_and_offloaded_chunks(offload: str) -> None:
    r = reference("llama", 10)
    ref = train(r.trainer, r.data, clip=0.05)  # small: clipping is active every step
    deferred = RuntimeOptions(overlap_host_step=False)
    got, w = wrapped_run(
        r.base,
        grouped_adamw,
        r.data,
        offload=alternate if offload == "alternate" else offload,
        options=deferred,
        clip=0.05,
    )
    assert_reproduces(got, ref, w, r.model)


def test_clip_grad_norm_returns_the_plain_pytorch_total_norm() -> None:
    base = tiny_model("gpt2")
    x = batches(1)[0]
    ref_model = clone(base)
    torch.manual_seed(0)  # same dropout masks
    ref_model(input_ids=x, labels=x).loss.backward()
    expected = torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 1e9)
    model = clone(base)
    w = wrap(
        model,
        grouped_adamw(model),
        plan=plan_for(model, alternate),
        options=RuntimeOptions(overlap_host_step=False),
    )
    torch.manual_seed(0)
    w.model(input_ids=x, labels=x).loss.backward()
    torch.testing.assert_close(w.clip_grad_norm_(1e9), expected, rtol=1e-6, atol=0.0)


def test_gradient_accumulation_with_deferred_host_steps_matches_plain_pytorch() -> None:
    r = reference("llama", 6)
    ref = train(r.trainer, r.data, micro=2)
    got, w = wrapped_run(
        r.base, grouped_adamw, r.data, offload="all", options=RuntimeOptions(overlap_host_step=False), micro=2
    )
    assert_reproduces(got, ref, w, r.model)


def test_model_zero_grad_resets_offloaded_gradients_like_optimizer_zero_grad() -> None:
    r = reference("gpt2", 4)
    ref = train(r.trainer, r.data)
    model = clone(r.base)
    w = wrap(
        model,
        grouped_adamw(model),
        plan=plan_for(model, "all"),
        options=RuntimeOptions(overlap_host_step=False),
    )
    torch.manual_seed(1234)
    got = []
    for x in r.data:
        loss = w.model(input_ids=x, labels=x).loss
        loss.backward()
        w.optimizer.step()
        w.model.zero_grad()  # as the Hugging Face Trainer does
        got.append(loss.item())
    assert max_rel_diff(got, ref) <= TOL
    unwrap(w)
    assert "zero_grad" not in vars(model)


def test_loaded_state_of_parameters_with_alignment_padding_between_them_keeps_each_at_its_offset() -> None:
    """bf16 compute: a 37-element bias takes 80 bytes of its chunk (16-byte slots), so a run of parameters
    stepped as one flat tensor has padding inside. Before the fix `load_state_dict` concatenated the loaded
    states back to back: a run's moments came out shorter than its master (shifted values, and the fused
    kernel wrote past their end: heap corruption at 4 ranks in the sharded-checkpoint tests)."""
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(20, 37), torch.nn.Linear(37, 5))
    plain = copy.deepcopy(base)
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    for p in plain.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    saved = copy.deepcopy(opt.state_dict())
    model = copy.deepcopy(base)
    plan = manual_plan(
        model, chunk_size_bytes=1 << 14, offload="all", n_buffers=1, compute_dtype=torch.bfloat16
    )
    w = wrap(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        plan=plan,
        options=RuntimeOptions(compute_dtype=torch.bfloat16),
        feedback_steps=None,
    )
    w.optimizer.load_state_dict(copy.deepcopy(saved))
    got = w.optimizer.state_dict()["state"]
    for i, st in saved["state"].items():
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(got[i][k], st[k]), (i, k)
    stepper = w.runtime.steppers[0]
    assert stepper.inner is not None
    for r in stepper.runs:
        assert all(v.numel() == r.tensor.numel() for v in stepper.inner.state[r.tensor].values() if v.dim())


@pytest.mark.parametrize("timeout", [0.0, -1.0])
def test_rank_arrival_timeout_must_be_positive(timeout: float) -> None:
    with pytest.raises(ValueError, match="rank_arrival_timeout_s: must be a positive"):
        RuntimeOptions(rank_arrival_timeout_s=timeout)
