"""Training through the chunk runtime gives the same losses and parameters as plain PyTorch."""

from __future__ import annotations

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

from agent.runtime import RuntimeOptions
from agent.wrapping import unwrap, wrap

STEPS = 20
TOL = 1e-5


def adamw(m: torch.nn.Module) -> torch.optim.Optimizer:
    # fused=True: the kernel the host optimizer uses, so the reference runs the same arithmetic
    return torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.1, fused=True)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@pytest.mark.parametrize("offload", ["none", "all", "alternate"])
def test_training_matches_plain_pytorch(kind: str, offload: str) -> None:
    base = tiny_model(kind)
    data = batches(STEPS)
    ref_model = clone(base)
    ref = train(plain_trainer(ref_model, adamw), data)

    model = clone(base)
    plan = plan_for(model, alternate if offload == "alternate" else offload, n_buffers=2)
    w = wrap(model, adamw(model), plan=plan)
    got = train(Trainer(w.model, w.optimizer), data)

    assert max_rel_diff(got, ref) <= TOL
    w.synchronize()
    diff, name = param_rel_diff(model, ref_model)
    assert diff <= TOL, f"{name} differs by {diff}"
    assert ref[-1] < ref[0]  # it trained


def test_default_optimizer_persistent_chunks_are_bitwise_plain_pytorch() -> None:
    """Persistent chunks step with the user's own implementation choice (here torch's default)."""
    base = tiny_model("llama")
    data = batches(5)
    ref_model = clone(base)
    ref = train(plain_trainer(ref_model, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3)), data)
    model = clone(base)
    w = wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3), plan=plan_for(model, "none"))
    got = train(Trainer(w.model, w.optimizer), data)
    assert got == ref
    assert param_rel_diff(model, ref_model)[0] == 0.0


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_deferred_and_asynchronous_host_steps_match_overlapped_ones(kind: str) -> None:
    base = tiny_model(kind)
    data = batches(6)
    runs = []
    for overlap, async_step in ((True, False), (False, False), (False, True), (True, True)):
        model = clone(base)
        options = RuntimeOptions(overlap_host_step=overlap, async_step=async_step)
        w = wrap(model, adamw(model), plan=plan_for(model, "all"), options=options)
        runs.append((train(Trainer(w.model, w.optimizer), data), unwrap(w)))
    for losses, model in runs[1:]:
        assert losses == runs[0][0]
        assert param_rel_diff(model, runs[0][1])[0] == 0.0


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_evaluation_between_training_steps_sees_current_parameters_and_changes_nothing(kind: str) -> None:
    base = tiny_model(kind)
    data = batches(6)
    held_out = batches(1, seed=9)[0]

    def run(t: Trainer, model: torch.nn.Module) -> list[float]:
        out = train(t, data[:3])
        model.eval()
        with torch.no_grad():
            out.append(t.model(input_ids=held_out, labels=held_out).loss.item())
        model.train()
        return out + train(t, data[3:], seed=77)

    ref_model = clone(base)
    ref = run(plain_trainer(ref_model, adamw), ref_model)
    model = clone(base)
    w = wrap(model, adamw(model), plan=plan_for(model, "all"))
    got = run(Trainer(w.model, w.optimizer), model)
    assert max_rel_diff(got, ref) <= TOL
    w.synchronize()
    assert param_rel_diff(model, ref_model)[0] <= TOL


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_hugging_face_activation_checkpointing_trains_exactly(kind: str, reentrant: bool) -> None:
    """Recomputed blocks save tensors pointing into buffers: their chunks stay resident until done."""
    base = tiny_model(kind)
    data = batches(4)
    ckpt = {"activation_checkpointing_kwargs": {"use_reentrant": reentrant}}
    ref_model = clone(base)
    ref_model.activation_checkpointing_enable(**ckpt)
    ref = train(plain_trainer(ref_model, adamw), data)
    model = clone(base)
    model.activation_checkpointing_enable(**ckpt)
    w = wrap(model, adamw(model), plan=plan_for(model, "all", n_buffers=4))
    got = train(Trainer(w.model, w.optimizer), data)
    assert max_rel_diff(got, ref) <= TOL
    w.synchronize()
    assert param_rel_diff(model, ref_model)[0] <= TOL


def test_activation_checkpointing_with_too_few_buffers_fails_loudly() -> None:
    model = tiny_model("llama")
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    # deferred host steps: nothing is applied by the aborted backward (overlapped steps would be)
    w = wrap(
        model,
        adamw(model),
        plan=plan_for(model, "all", n_buffers=2),
        options=RuntimeOptions(overlap_host_step=False),
    )
    x = batches(1)[0]
    with pytest.raises(RuntimeError, match="activation checkpointing stay resident"):
        w.model(input_ids=x, labels=x).loss.backward()
    # the runtime recovers from the aborted backward: without checkpointing, training goes on exactly
    model.activation_checkpointing_disable()
    ref_model = tiny_model("llama")
    ref = train(plain_trainer(ref_model, adamw), batches(3))
    w.optimizer.zero_grad()
    assert max_rel_diff(train(Trainer(w.model, w.optimizer), batches(3)), ref) <= TOL


def test_two_forwards_into_one_backward_and_inference_mode_match_plain_pytorch() -> None:
    base = tiny_model("llama")
    data = batches(4)

    def loop(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[float]:
        out = []
        for x1, x2 in zip(data[:3], data[1:], strict=True):
            loss = model(input_ids=x1, labels=x1).loss + 0.5 * model(input_ids=x2, labels=x2).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            out.append(loss.item())
        with torch.inference_mode():
            out.append(model(input_ids=data[0], labels=data[0]).loss.item())
        return out

    ref_model = clone(base)
    ref = loop(ref_model, adamw(ref_model))
    model = clone(base)
    w = wrap(model, adamw(model), plan=plan_for(model, "all"))
    assert max_rel_diff(loop(w.model, w.optimizer), ref) <= TOL
    w.synchronize()
    assert param_rel_diff(model, ref_model)[0] <= TOL


def test_calling_submodules_directly_instead_of_the_wrapped_model_trains_exactly() -> None:
    """Custom heads call the backbone on its own: saved tensors must still be recorded by chunk."""
    base = tiny_model("llama")
    data = batches(4)

    def loop(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[float]:
        out = []
        for x in data:
            hidden = model.model(input_ids=x).last_hidden_state
            logits = model.lm_head(hidden)
            loss = torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1)
            )
            loss.backward()
            opt.step()
            opt.zero_grad()
            out.append(loss.item())
        return out

    ref_model = clone(base)
    ref = loop(ref_model, adamw(ref_model))
    model = clone(base)
    w = wrap(model, adamw(model), plan=plan_for(model, "all", n_buffers=2))
    assert max_rel_diff(loop(w.model, w.optimizer), ref) <= TOL
    w.synchronize()
    assert param_rel_diff(model, ref_model)[0] <= TOL


@pytest.mark.parametrize("offload", ["none", "all", "alternate"])
def test_bf16_training_matches_plain_pytorch_with_fp32_master_weights(offload: str) -> None:
    """Reference: a bf16 model whose fp32 master copies are stepped by AdamW and copied back."""
    from runtime_helpers import chunk_bytes_for

    from agent.runtime import manual_plan

    base = tiny_model("llama")
    data = batches(8)
    ref_model = clone(base)
    masters = [p.detach().clone() for p in ref_model.parameters()]  # fp32 values of the original model
    for p in ref_model.parameters():  # parameters only: buffers (rotary frequencies) keep their dtype
        p.data = p.data.to(torch.bfloat16)
    opt = torch.optim.AdamW(masters, lr=1e-3, weight_decay=0.1, fused=True)
    ref = []
    torch.manual_seed(1234)
    for x in data:
        loss = ref_model(input_ids=x, labels=x).loss
        loss.backward()
        with torch.no_grad():
            for m, p in zip(masters, ref_model.parameters(), strict=True):
                m.grad = p.grad.float()  # type: ignore[union-attr]
            opt.step()
            for m, p in zip(masters, ref_model.parameters(), strict=True):
                p.copy_(m)
                p.grad = None
        ref.append(loss.item())

    model = clone(base)
    plan = manual_plan(
        model,
        chunk_size_bytes=chunk_bytes_for(model, 8) // 2,
        offload=alternate if offload == "alternate" else offload,
        n_buffers=2,
        compute_dtype=torch.bfloat16,
    )
    w = wrap(model, adamw(model), plan=plan, options=RuntimeOptions(compute_dtype=torch.bfloat16))
    got = train(Trainer(w.model, w.optimizer), data)
    assert got == ref
    state = w.optimizer.state_dict()["state"]
    for i, m in enumerate(masters):
        torch.testing.assert_close(
            state[i]["master_param"], m.detach().reshape(state[i]["master_param"].shape), rtol=0, atol=0
        )
