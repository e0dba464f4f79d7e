"""The profiler leaves nothing behind: no hooks, modes or saved-tensor hooks; weights and optimizer restored."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from agent.profiler import profile
from agent.testing.model_zoo import build, sample_batch
from client.contract import Hardware


def _hook_counts(model: nn.Module) -> int:
    total = 0
    for m in model.modules():
        for attr in (
            "_forward_hooks",
            "_forward_pre_hooks",
            "_backward_hooks",
            "_backward_pre_hooks",
            "_forward_hooks_with_kwargs",
            "_forward_pre_hooks_with_kwargs",
            "_state_dict_hooks",
            "_load_state_dict_pre_hooks",
        ):
            total += len(getattr(m, attr, {}))
    return total


def _assert_nothing_left(model: nn.Module, hooks_before: int) -> None:
    assert _hook_counts(model) == hooks_before
    assert torch._C._len_torch_dispatch_stack() == 0
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    # a plain iteration afterwards runs without any profiler code
    batch_out = model(torch.randint(0, 64, (1, 4)), labels=torch.randint(0, 64, (1, 4)))
    batch_out.loss.backward()


def test_no_hooks_modes_or_saved_tensor_hooks_remain_after_return(cpu_hardware: Hardware) -> None:
    model, config = build("gpt2", layers=2, hidden=32, vocab=64, seq=16)
    before = _hook_counts(model)
    profile(model, sample_batch(config, 2, 16), hardware=cpu_hardware, repeats=1)
    _assert_nothing_left(model, before)


def test_no_hooks_remain_after_a_forward_error_which_keeps_its_type_and_gains_context(
    cpu_hardware: Hardware,
) -> None:
    model, config = build("llama", layers=2, hidden=32, vocab=64, seq=16)
    before = _hook_counts(model)
    bad = {
        "input_ids": torch.full((2, 8), 10_000),
        "labels": torch.zeros(2, 8, dtype=torch.long),
    }  # ids >= vocab
    with pytest.raises(IndexError) as info:
        profile(model, bad, hardware=cpu_hardware)
    assert any("memplan profiler" in note for note in getattr(info.value, "__notes__", []))
    _assert_nothing_left(model, before)


def test_no_hooks_remain_when_the_loss_function_fails(cpu_hardware: Hardware) -> None:
    model, config = build("gpt2", layers=2, hidden=32, vocab=64, seq=16)
    before = _hook_counts(model)

    def broken(output: object, batch: object) -> torch.Tensor:
        raise RuntimeError("loss exploded")

    with pytest.raises(RuntimeError, match="loss exploded"):
        profile(model, sample_batch(config, 2, 16), loss_fn=broken, hardware=cpu_hardware)
    _assert_nothing_left(model, before)


def test_weights_optimizer_state_and_gradients_are_restored(cpu_hardware: Hardware) -> None:
    model, config = build("llama", layers=2, hidden=32, vocab=64, seq=16)
    batch = sample_batch(config, 2, 16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(**batch).loss.backward()
    opt.step()
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    state = {id(p): {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}

    profile(model, batch, optimizer=opt, hardware=cpu_hardware, repeats=1)

    for n, p in model.named_parameters():
        assert torch.equal(p, weights[n]), n
        assert p.grad is not None and torch.equal(p.grad, grads[n]), n
    for p, s in opt.state.items():
        for k, v in s.items():
            assert torch.equal(v, state[id(p)][k]), k
