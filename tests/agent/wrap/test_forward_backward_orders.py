"""Orders of forward, backward and step that users write beside the plain loop (session 19 probe findings).

A Hugging Face llama at its library defaults, every parameter chunk offloaded (a hand-built plan, so the orders
meet offloaded chunks whatever a solver would choose), against plain PyTorch in fp32:
- an evaluation forward under no_grad between backward and optimizer.step() sees the parameters before the step
  (it saw the ones the overlapped host step had already stepped: 5e-4 relative off), and training stays exact;
- a second backward before the next forward (an auxiliary loss backpropagated on its own with retain_graph=True;
  two forwards, then a backward for each) is refused with an error saying what to write instead (it gave every
  offloaded parameter a wrong `.grad`, silently), and the loop trains on exactly afterwards;
- `copy.deepcopy(wrapped.model)` is refused (the copy's forward ran on the training model's buffers);
- the feedback's uploads per iteration leave out the uploads of evaluation forwards.
"""

from __future__ import annotations

import copy
import io
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

import agent
from agent.model_guards import WrappedModelCopyError
from agent.runtime import RuntimeOptions, manual_plan
from agent.runtime.manager import SecondBackwardError
from agent.testing.model_zoo import build_with_library_defaults, sample_batch

pytestmark = pytest.mark.slow

TOL = 1e-5


@pytest.fixture(scope="module")
def job() -> dict[str, Any]:
    model, cfg = build_with_library_defaults("llama", layers=2, hidden=64, vocab=512, seq=32)
    return {"model": model, "batch": sample_batch(cfg, 2, 32), "other": sample_batch(cfg, 2, 32, seed=1)}


def adamw(m: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(m.parameters(), lr=1e-2)


def wrapped(job: dict[str, Any], **kw: Any) -> Any:
    model = copy.deepcopy(job["model"])
    plan = manual_plan(model, chunk_size_bytes=2**18, offload="all", n_buffers=2)
    return agent.wrap(model, adamw(model), plan=plan, **({"feedback_steps": None} | kw))


def plain(job: dict[str, Any]) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = copy.deepcopy(job["model"])
    return model, adamw(model)


def close(a: float, b: float) -> bool:
    return abs(a - b) <= TOL * abs(b)


@pytest.mark.parametrize("overlap", [True, False])
def test_an_evaluation_between_backward_and_step_sees_the_parameters_before_the_step(
    job: dict[str, Any], overlap: bool
) -> None:
    w = wrapped(job, options=RuntimeOptions(overlap_host_step=overlap))
    ref, ref_opt = plain(job)
    for step in range(4):
        seen = []
        for m, opt in ((w.model, w.optimizer), (ref, ref_opt)):
            loss = m(**job["batch"]).loss
            loss.backward()
            with torch.no_grad():
                evaluation = m(**job["other"]).loss.item()
            opt.step()
            opt.zero_grad()
            seen.append((loss.item(), evaluation))
        (got_loss, got_eval), (want_loss, want_eval) = seen
        assert close(got_eval, want_eval), f"step {step}: evaluation {got_eval} vs plain {want_eval}"
        assert close(got_loss, want_loss), f"step {step}: loss {got_loss} vs plain {want_loss}"
    agent.unwrap(w)


def test_a_second_backward_before_the_next_forward_is_refused_and_training_goes_on(
    job: dict[str, Any],
) -> None:
    w = wrapped(job)
    out = w.model(**job["batch"])
    out.loss.backward(retain_graph=True)
    with pytest.raises(SecondBackwardError, match=r"\(loss \+ aux_loss\)\.backward\(\)"):
        (0.5 * out.logits.pow(2).mean()).backward()
    w.optimizer.zero_grad()
    first = w.model(**job["batch"]).loss
    second = w.model(**job["other"]).loss
    first.backward()
    with pytest.raises(SecondBackwardError, match="gradient accumulation"):
        second.backward()
    w.optimizer.zero_grad()
    # what the message says to write gives plain PyTorch's losses
    ref, ref_opt = plain(job)
    for m, opt in ((w.model, w.optimizer), (ref, ref_opt)):
        losses = []
        for _ in range(3):
            out = m(**job["batch"])
            (out.loss + 0.5 * out.logits.pow(2).mean()).backward()
            opt.step()
            opt.zero_grad()
            losses.append(out.loss.item())
        m.losses = losses  # type: ignore[assignment]
    assert all(close(a, b) for a, b in zip(w.model.losses, ref.losses, strict=True)), (
        w.model.losses,
        ref.losses,
    )
    agent.unwrap(w)


def test_deepcopy_of_the_wrapped_model_is_refused_and_the_suggested_copy_is_frozen(
    job: dict[str, Any],
) -> None:
    w = wrapped(job)
    w.model(**job["batch"]).loss.backward()
    w.optimizer.step()
    w.optimizer.zero_grad()
    with pytest.raises(WrappedModelCopyError, match="load_state_dict"):
        copy.deepcopy(w.model)
    ref = type(w.model)(w.model.config)
    ref.load_state_dict(w.model.state_dict())
    ref.eval()
    with torch.no_grad():
        before = ref(**job["other"]).loss.item()
    w.model(**job["batch"]).loss.backward()
    w.optimizer.step()
    with torch.no_grad():
        assert ref(**job["other"]).loss.item() == before
    agent.unwrap(w)
    assert copy.deepcopy(w.model) is not w.model  # unwrapped: a plain model again


def test_saving_the_wrapped_model_by_pickle_is_refused_naming_the_state_dict(job: dict[str, Any]) -> None:
    """`torch.save(wrapped.model)` failed with a PicklingError naming one of the runtime's hook functions."""
    w = wrapped(job)
    w.model(**job["batch"]).loss.backward()
    w.optimizer.step()
    for save in (
        lambda: torch.save(w.model, io.BytesIO()),
        lambda: pickle.dumps(w.model),
        lambda: copy.copy(w.model),
    ):
        with pytest.raises(WrappedModelCopyError, match="state_dict"):
            save()
    state = io.BytesIO()
    torch.save(w.model.state_dict(), state)  # what works
    model = agent.unwrap(w)
    saved = io.BytesIO()
    torch.save(model, saved)  # unwrapped: a plain model again
    saved.seek(0)
    again = torch.load(saved, weights_only=False)
    for (name, p), q in zip(model.named_parameters(), again.parameters(), strict=True):
        assert torch.equal(p, q), name


def test_feedback_uploads_leave_out_evaluation_forwards(job: dict[str, Any], tmp_path: Path) -> None:
    w = wrapped(job, feedback_steps=6, feedback_path=tmp_path / "fb.jsonl")
    counts = []
    for _ in range(6):
        before = w.runtime.counters.uploads
        w.model(**job["batch"]).loss.backward()
        w.optimizer.step()
        w.optimizer.zero_grad()
        counts.append(w.runtime.counters.uploads - before)
        with torch.no_grad():
            w.model(**job["other"])
    fb = w.report().measured
    assert fb is not None and fb.phases is not None
    # the training iterations' own uploads (the evaluation after each step re-uploads chunks of its own)
    assert fb.phases.uploads_per_iteration == counts[-1] == counts[-2]
    agent.unwrap(w)
