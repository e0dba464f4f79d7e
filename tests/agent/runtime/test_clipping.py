"""Clipping with the default options (overlapped, speculative host steps): torch's result through every route.

After backward every offloaded parameter exposes `.grad` (a host tensor), so `torch.nn.utils.clip_grad_norm_`,
Accelerate's `clip_grad_norm_` and `wrapped.clip_grad_norm_` see every gradient; host steps run during backward
on the unclipped gradient and `optimizer.step()` redoes the chunks whose gradient was changed.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from runtime_helpers import (
    Trainer,
    alternate,
    batches,
    clone,
    max_rel_diff,
    param_rel_diff,
    plan_for,
    tiny_model,
    train,
)

from agent.runtime import RuntimeOptions
from agent.wrapping import Wrapped, wrap

TOL = 1e-5


def adamw(m: torch.nn.Module) -> torch.optim.Optimizer:
    decay = [p for p in m.parameters() if p.dim() >= 2]
    no_decay = [p for p in m.parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=2e-3,
        fused=True,
    )


def accelerate_clip(model: torch.nn.Module) -> Callable[[float], torch.Tensor]:
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    return lambda m: acc.clip_grad_norm_(model.parameters(), m)  # type: ignore[no-any-return]


ROUTES: dict[str, Callable[[Wrapped], Callable[[float], torch.Tensor]]] = {
    "wrapped": lambda w: w.clip_grad_norm_,
    "torch": lambda w: lambda m: torch.nn.utils.clip_grad_norm_(w.model.parameters(), m),
    "accelerate": lambda w: accelerate_clip(w.model),
}


def run_pair(
    clip: float | None,
    *,
    route: str = "torch",
    offload: object = "all",
    kind: str = "llama",
    steps: int = 6,
    micro: int = 1,
    options: RuntimeOptions | None = None,
) -> tuple[list[float], list[float], torch.nn.Module, Wrapped, list[torch.Tensor], list[torch.Tensor]]:
    """Plain PyTorch and the wrapped model (default options unless given) trained alike; norms recorded."""
    base = tiny_model(kind)
    data = batches(steps)
    ref_model = clone(base)
    ref_norms: list[torch.Tensor] = []

    def ref_clip(m: float) -> torch.Tensor:
        ref_norms.append(torch.nn.utils.clip_grad_norm_(ref_model.parameters(), m))
        return ref_norms[-1]

    ref = train(Trainer(ref_model, adamw(ref_model), clip=ref_clip), data, clip=clip, micro=micro)
    model = clone(base)
    w = wrap(model, adamw(model), plan=plan_for(model, offload), options=options)
    norms: list[torch.Tensor] = []
    route_clip = ROUTES[route](w)
    got_clip = lambda m: norms.append(route_clip(m)) or norms[-1]  # noqa: E731
    got = train(Trainer(w.model, w.optimizer, clip=got_clip), data, clip=clip, micro=micro)
    w.synchronize()
    return got, ref, ref_model, w, norms, ref_norms


@pytest.mark.parametrize("route", list(ROUTES))
def test_clipping_with_default_options_matches_plain_pytorch_through_every_route(route: str) -> None:
    got, ref, ref_model, w, norms, ref_norms = run_pair(0.05, route=route)  # 0.05: clipping scales every step
    assert max_rel_diff(got, ref) <= TOL
    assert param_rel_diff(w.model, ref_model)[0] <= TOL
    for n, r in zip(norms, ref_norms, strict=True):
        assert math.isclose(float(n), float(r), rel_tol=1e-5)
    c = w.runtime.counters
    assert c.speculative_steps > 0 and c.host_step_redos == c.speculative_steps  # every chunk was clipped


@pytest.mark.parametrize("offload", ["all", "alternate"])
def test_clipping_that_does_not_scale_keeps_every_overlapped_host_step(offload: str) -> None:
    """torch multiplies by the clamped coefficient 1.0 (values unchanged): nothing is redone."""
    got, ref, ref_model, w, norms, ref_norms = run_pair(
        1e9, offload=alternate if offload == "alternate" else "all"
    )
    assert max_rel_diff(got, ref) <= TOL
    assert param_rel_diff(w.model, ref_model)[0] <= TOL
    c = w.runtime.counters
    assert c.speculative_steps == c.host_steps > 0
    assert c.host_step_redos == 0 and c.host_step_undos == 0


def test_offloaded_parameters_expose_their_gradients_after_backward() -> None:
    base = tiny_model("gpt2")
    x = batches(1)[0]
    ref_model = clone(base)
    torch.manual_seed(0)
    ref_model(input_ids=x, labels=x).loss.backward()
    model = clone(base)
    w = wrap(model, adamw(model), plan=plan_for(model, "all"))
    torch.manual_seed(0)
    w.model(input_ids=x, labels=x).loss.backward()
    ref_grads = dict(ref_model.named_parameters())
    for name, p in w.model.named_parameters():
        assert p.grad is not None, name
        assert p.grad.device == p.device and p.grad.dtype == p.dtype
        torch.testing.assert_close(p.grad, ref_grads[name].grad, rtol=1e-5, atol=1e-7)


def test_gradient_accumulation_with_clipping_and_default_options_matches_plain_pytorch() -> None:
    got, ref, ref_model, w, norms, ref_norms = run_pair(0.05, micro=2, steps=5)
    assert max_rel_diff(got, ref) <= TOL
    assert param_rel_diff(w.model, ref_model)[0] <= TOL
    for n, r in zip(norms, ref_norms, strict=True):
        assert math.isclose(float(n), float(r), rel_tol=1e-5)
    # after the first step the runtime knows 2 backward passes make a step: it speculates only in the second
    c = w.runtime.counters
    n_chunks = sum(st.offloaded for st in w.runtime.states)
    assert c.host_step_undos == n_chunks  # only the first step's first micro-batch speculated in vain


def test_infinity_norm_clipping_matches_plain_pytorch() -> None:
    base = tiny_model("llama")
    data = batches(4)
    ref_model = clone(base)
    ref = train(
        Trainer(
            ref_model,
            adamw(ref_model),
            clip=lambda m: torch.nn.utils.clip_grad_norm_(ref_model.parameters(), m, norm_type=math.inf),
        ),
        data,
        clip=0.01,
    )
    model = clone(base)
    w = wrap(model, adamw(model), plan=plan_for(model, alternate))
    got = train(
        Trainer(w.model, w.optimizer, clip=lambda m: w.clip_grad_norm_(m, norm_type=math.inf)),
        data,
        clip=0.01,
    )
    assert max_rel_diff(got, ref) <= TOL
    w.synchronize()
    assert param_rel_diff(w.model, ref_model)[0] <= TOL


def test_error_if_nonfinite_raises_as_torch_does_and_skipping_the_step_undoes_the_host_steps() -> None:
    base = tiny_model("gpt2")
    x = batches(1)[0]
    model = clone(base)
    w = wrap(model, adamw(model), plan=plan_for(model, "all"))
    before = {n: p.detach().clone() for n, p in w.model.named_parameters()}
    w.model(input_ids=x, labels=x).loss.backward()
    assert w.runtime.counters.speculative_steps > 0
    name, p = next(iter(w.model.named_parameters()))
    assert p.grad is not None
    p.grad.view(-1)[0] = float("inf")
    with pytest.raises(RuntimeError, match="non-finite"):
        w.clip_grad_norm_(1.0, error_if_nonfinite=True)
    with pytest.raises(RuntimeError, match="non-finite"):
        torch.nn.utils.clip_grad_norm_(w.model.parameters(), 1.0, error_if_nonfinite=True)
    w.optimizer.zero_grad()  # the step is skipped: the speculative host steps are undone
    w.synchronize()
    for n, q in w.model.named_parameters():
        assert torch.equal(q.detach(), before[n]), n
    assert w.runtime.counters.host_step_undos == sum(st.offloaded for st in w.runtime.states)


@pytest.mark.parametrize("offload", ["all", "alternate"])
def test_a_replaced_gradient_is_the_one_stepped(offload: str) -> None:
    base = tiny_model("gpt2")
    x = batches(1)[0]
    ref_model = clone(base)
    ref_opt = adamw(ref_model)
    torch.manual_seed(0)
    ref_model(input_ids=x, labels=x).loss.backward()
    model = clone(base)
    w = wrap(model, adamw(model), plan=plan_for(model, alternate if offload == "alternate" else "all"))
    torch.manual_seed(0)
    w.model(input_ids=x, labels=x).loss.backward()
    for m in (ref_model, w.model):
        for i, p in enumerate(
            m.parameters()
        ):  # alternate: parameters of persistent and offloaded chunks alike
            if i % 3 == 0:
                p.grad = p.grad * 3.0  # type: ignore[operator]  # a new tensor, not an in-place edit
            elif i % 3 == 1:
                p.grad = None  # dropped: not stepped, as torch skips it
    ref_opt.step()
    w.optimizer.step()
    assert param_rel_diff(w.model, ref_model)[0] <= TOL


def test_without_undo_backups_a_gradient_changed_after_an_overlapped_step_is_refused() -> None:
    base = tiny_model("gpt2")
    x = batches(1)[0]
    model = clone(base)
    w = wrap(model, adamw(model), plan=plan_for(model, "all"), options=RuntimeOptions(undo_host_steps=False))
    w.model(input_ids=x, labels=x).loss.backward()
    w.clip_grad_norm_(1e9)  # does not scale: fine
    w.optimizer.step()
    w.optimizer.zero_grad()
    w.model(input_ids=x, labels=x).loss.backward()
    w.clip_grad_norm_(1e-3)
    with pytest.raises(RuntimeError, match="undo_host_steps=False"):
        w.optimizer.step()
    assert "undo_backup" not in w.runtime.memory_report().host


def test_undo_backups_are_reported_as_host_memory() -> None:
    model = tiny_model("gpt2")
    w = wrap(model, adamw(model), plan=plan_for(model, "all"))
    x = batches(1)[0]
    for _ in range(2):  # the second step's backup holds optimizer state (the first had none yet)
        w.model(input_ids=x, labels=x).loss.backward()
        w.optimizer.step()
        w.optimizer.zero_grad()
    host = w.runtime.memory_report().host
    n = sum(st.numel for st in w.runtime.states)
    # master copy (4 bytes) + Adam's two moments (8 bytes) per element, plus the per-run step counters
    assert 12 * n <= host["undo_backup"] <= 12 * n + 4 * 64
    assert host["gradient_exposed"] == 4 * n


def test_clipping_with_asynchronous_host_steps_matches_plain_pytorch() -> None:
    """async_step: redone host steps run after step() returns; the next upload (or state access) waits."""
    got, ref, ref_model, w, norms, ref_norms = run_pair(0.05, options=RuntimeOptions(async_step=True))
    assert max_rel_diff(got, ref) <= TOL
    assert param_rel_diff(w.model, ref_model)[0] <= TOL
    assert w.runtime.counters.host_step_redos > 0
