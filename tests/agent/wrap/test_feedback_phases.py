"""Feedback by phase: the monitor times the model's forward, optimizer.step() and the rest of each timed step, and
counts the chunk runtime's uploads; the service stores them with each one's error against `Predictions.phases`.

Real parts: a Hugging Face llama at its library defaults, `import agent; agent.wrap(...)` as the README writes it,
the real planner service (SQLite) on a loopback port. The attribution checks use sleeps the test puts inside one
phase (a hook on a submodule, a step pre-hook, user code between forward and backward), so each bound holds on a
loaded machine: a phase is never shorter than the sleep it holds, and a sleep outside it never shows in it.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import agent
from agent.testing.model_zoo import build_with_library_defaults, sample_batch

pytestmark = pytest.mark.slow

STEPS = 7  # 2 warm-up, 1 metered, 4 timed


@pytest.fixture(scope="module")
def job() -> dict[str, Any]:
    model, cfg = build_with_library_defaults("llama", layers=2, hidden=128, vocab=2048, seq=64)
    batch = sample_batch(cfg, 2, 64)
    probe = copy.deepcopy(model)
    trace = agent.profile(probe, batch, repeats=1, allocation_trace=False)
    return {"model": model, "batch": batch, "limit": int(trace.measurements.peak_device_bytes * 0.7)}


def wrapped(job: dict[str, Any], **kw: Any) -> Any:
    model = copy.deepcopy(job["model"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return agent.wrap(
        model, opt, sample_batch=job["batch"], device_memory=job["limit"], feedback_steps=STEPS, **kw
    )


def test_the_service_stores_the_phases_with_their_errors_and_the_uploads_match_the_plan(
    job: dict[str, Any], service: str
) -> None:
    from client.cli.render import phases_text
    from client.sdk import Client

    w = wrapped(job, server=service)
    assert w.source.origin == "service"
    for _ in range(STEPS):
        w.model(**job["batch"]).loss.backward()
        w.optimizer.step()
        w.optimizer.zero_grad()
    report = w.report()
    assert report.feedback_to is not None and report.feedback_to.startswith("posted"), report.feedback_to
    with Client(service) as c:
        rec = c.get_plan(w.source.plan_id).feedback[0]
    ph = rec.feedback.phases
    assert ph is not None and ph.forward_s > 0 and ph.backward_s > 0 and ph.step_s >= 0
    # the three phases are the iteration cut in three: their medians add up to about the median iteration
    assert ph.forward_s + ph.backward_s + ph.step_s == pytest.approx(rec.feedback.iteration_s, rel=0.25)
    pred = w.plan.predictions
    assert pred is not None and pred.uploads_per_iteration is not None and pred.uploads_per_iteration > 0
    assert ph.uploads_per_iteration == pred.uploads_per_iteration, (
        "uploads per iteration: measured != predicted"
    )
    assert rec.phase_errors is not None and rec.phase_errors["uploads_per_iteration"] == 0.0
    assert rec.phase_errors["forward_s"] == pytest.approx(ph.forward_s / pred.phases()["forward_s"] - 1)
    text = phases_text(rec)
    assert text.startswith("forward ") and "uploads" in text
    rows = [r[0].strip() for r in report.rows()]
    assert {"forward", "backward, rest", "optimizer.step()", "chunk uploads/iter"} <= set(rows)
    agent.unwrap(w)


def test_each_phase_holds_its_own_time_and_not_the_others(job: dict[str, Any], tmp_path: Path) -> None:
    """Two micro-batches per step (both forwards count), an evaluation forward under no_grad between steps (not
    the step's), user code between forward and backward (the rest), a step pre-hook (optimizer.step())."""
    w = wrapped(job, feedback_path=str(tmp_path / "fb.jsonl"))  # a str path, as users pass it
    inner = w.model.model.embed_tokens
    naps = {"train": 0.02, "eval": 1.0}  # eval: longer than two forwards take on a loaded machine
    inner.register_forward_pre_hook(
        lambda *_: time.sleep(naps["train" if torch.is_grad_enabled() else "eval"])
    )
    w.optimizer.register_step_pre_hook(lambda *_: time.sleep(0.03))
    half = {k: v[:1] for k, v in job["batch"].items()}
    for step in range(STEPS):
        for _micro in range(2):
            loss = w.model(**half).loss / 2
            time.sleep(0.04)  # the user's code between forward and backward
            loss.backward()
        w.optimizer.step()
        w.optimizer.zero_grad()
        if step >= 2:  # in each timed step's window (steps 3-6: from the previous step's end to its own)
            with torch.no_grad():
                w.model(**half)
    fb = w.report().measured
    assert fb is not None and fb.phases is not None
    ph = fb.phases
    assert ph.forward_s >= 2 * naps["train"], "a micro-batch's forward was not counted"
    assert ph.forward_s < naps["eval"], "the evaluation forward (no_grad) was counted as the step's forward"
    assert ph.step_s >= 0.03
    assert ph.backward_s >= 2 * 0.04 + naps["eval"], "user code and the evaluation forward belong to the rest"
    assert (tmp_path / "fb.jsonl").read_text().count('"phases"') == 1
    agent.unwrap(w)


def test_with_gradient_accumulation_the_iteration_is_the_last_pass_of_the_planned_batch(
    job: dict[str, Any], tmp_path: Path
) -> None:
    """Four passes of the whole planned batch per optimizer.step() (a Trainer's gradient_accumulation_steps,
    whose sample batch is one micro-batch): four iterations of the plan, of which the feedback measures the last
    (its forward to the step's end, the final micro-step's gradient work and the step included). Defect (session
    32): the whole step was measured as one iteration, ~4x the prediction and 4x its uploads. User code between
    the passes (a sleep longer than a pass takes here) is in none of it."""
    w = wrapped(job, feedback_path=str(tmp_path / "fb.jsonl"))
    nap, passes = 0.5, 4
    for _step in range(STEPS):
        for micro in range(passes):
            (w.model(**job["batch"]).loss / passes).backward()
            if micro < passes - 1:
                time.sleep(nap)  # the user's code between passes (logging, the next batch's loading)
        w.optimizer.step()
        w.optimizer.zero_grad()
    fb = w.report().measured
    assert fb is not None and fb.phases is not None
    pred = w.plan.predictions
    assert pred is not None and pred.uploads_per_iteration is not None and pred.uploads_per_iteration > 0
    assert fb.phases.uploads_per_iteration == pred.uploads_per_iteration, "uploads of the last pass only"
    assert fb.iteration_s < nap, "time between the passes was counted as the iteration's"
    assert 0 < fb.phases.forward_s < fb.iteration_s
    assert f"up to {passes} forward/backward passes" in fb.notes
    agent.unwrap(w)
