"""The one call: `agent.wrap(model, optimizer, sample_batch=...)` plans, applies, measures and reports.

Real models, the real profiler and solver, and the real service on a loopback port with SQLite.
"""

from __future__ import annotations

import copy
import logging
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from agent.testing.model_zoo import build, sample_batch
from agent.wrapping import Wrapped, unwrap, wrap
from client.contract import Feedback
from planner_service.embedded import EmbeddedServer, free_port

pytestmark = pytest.mark.slow
TOL = 1e-5
STEPS = 6


def adamw(m: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True)


@pytest.fixture(scope="module")
def job() -> dict[str, Any]:
    """A small llama, its batch, and the device limit that forces the planner to offload/recompute/swap."""
    import agent

    model, cfg = build("llama", layers=4, hidden=128, vocab=128, seq=64, seed=0)
    batch = sample_batch(cfg, 2, 64)
    probe = copy.deepcopy(model)
    trace = agent.profile(probe, batch, optimizer=adamw(probe), repeats=1, allocation_trace=False)
    return {"model": model, "batch": batch, "limit": int(trace.measurements.peak_device_bytes * 0.6)}


def train(
    model: nn.Module, opt: torch.optim.Optimizer, batch: dict[str, torch.Tensor], steps: int = STEPS
) -> list[float]:
    torch.manual_seed(0)
    out = []
    for _ in range(steps):
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


def plain_losses(job: dict[str, Any]) -> list[float]:
    m = copy.deepcopy(job["model"])
    return train(m, adamw(m), job["batch"])


def assert_close(got: list[float], ref: list[float]) -> None:
    for i, (a, b) in enumerate(zip(got, ref, strict=True)):
        assert abs(a - b) <= TOL * abs(b), f"step {i}: loss {a} vs {b}"


def run_wrapped(job: dict[str, Any], **kw: Any) -> tuple[Wrapped, list[float]]:
    model = copy.deepcopy(job["model"])
    run = wrap(model, adamw(model), sample_batch=job["batch"], device_memory=job["limit"], **kw)
    return run, train(run.model, run.optimizer, job["batch"])


def test_embedded_wrap_profiles_solves_applies_and_trains_like_plain_pytorch(
    job: dict[str, Any], tmp_path: Path
) -> None:
    path = tmp_path / "feedback.jsonl"
    run, losses = run_wrapped(job, feedback_steps=STEPS, feedback_path=path)
    assert run.source.origin == "embedded"
    policy = run.plan.policy
    assert policy is not None
    offloaded = sum(c.placement.value == "offloaded" for c in policy.chunks)
    assert offloaded > 0 or set(policy.mode_strip()) != {"K"}, (
        "the limit did not make the planner do anything"
    )
    assert_close(losses, plain_losses(job))
    rep = run.report()
    assert rep.measured is not None and rep.measured.steps_measured == STEPS - 3  # warm-up 2, metered 1
    assert rep.measured.peak_device_bytes > 0 and rep.measured.iteration_s > 0
    line = path.read_text().strip().splitlines()
    assert len(line) == 1 and Feedback.model_validate_json(
        line[0].split('"feedback": ', 1)[1].rsplit(', "plan_id"', 1)[0]
    )
    assert "predicted" in str(rep)
    unwrap(run)


def test_service_plan_is_applied_then_reused_from_history_and_receives_feedback(
    job: dict[str, Any], service: str
) -> None:
    from client.sdk import Client

    run, losses = run_wrapped(job, server=service, feedback_steps=4)
    assert run.source.origin == "service" and run.source.plan_id is not None
    assert_close(losses, plain_losses(job))
    assert run.report().feedback_to is not None and run.report().feedback_to.startswith("posted")
    with Client(service) as c:
        rec = c.get_plan(run.source.plan_id)
    assert len(rec.feedback) == 1 and rec.feedback[0].feedback.steps_measured == 1
    unwrap(run)

    t0 = time.perf_counter()
    fresh = copy.deepcopy(job["model"])
    again = wrap(
        fresh,
        adamw(fresh),
        sample_batch=job["batch"],
        device_memory=job["limit"],
        server=service,
        feedback_steps=None,
    )
    took = time.perf_counter() - t0
    assert again.source.origin == "history" and again.source.plan_id == run.source.plan_id
    assert again.source.trace is None, "the job was profiled again instead of reusing the plan"
    assert took < 10.0


def test_a_down_service_falls_back_to_the_embedded_solver_and_says_so_once(
    job: dict[str, Any], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    monkeypatch.setenv("MEMPLAN_SERVER", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    with caplog.at_level(logging.WARNING, logger="agent"):
        run, losses = run_wrapped(job, feedback_steps=4, feedback_path=tmp_path / "fb.jsonl")
    assert run.source.origin == "fallback"
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and r.name == "agent.planning"]
    assert len(warnings) == 1 and "solving in-process" in warnings[0].getMessage()
    assert_close(losses, plain_losses(job))
    assert (tmp_path / "fb.jsonl").exists()
    unwrap(run)


def test_a_slow_service_does_not_stall_training_it_falls_back_after_the_wait(
    job: dict[str, Any], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from planner_service.settings import Settings

    with (
        EmbeddedServer(Settings(database_url=f"sqlite:///{tmp_path / 'slow.db'}", workers=0)) as url,
        caplog.at_level(logging.INFO, logger="agent"),
    ):  # workers=0: the plan stays queued
        model = copy.deepcopy(job["model"])
        run = wrap(
            model,
            adamw(model),
            sample_batch=job["batch"],
            device_memory=job["limit"],
            server=url,
            wait_s=1.0,
            feedback_steps=None,
        )
    assert run.source.origin == "fallback" and "is queued after 1s" in run.source.message
    # The wait itself (first poll of the queued plan -> giving up) honours wait_s=1, not the 120 s default:
    # at least the 1 s asked for, at most that plus one long-poll's slack.
    planning = [r for r in caplog.records if r.name == "agent.planning"]
    first_poll = next(r.created for r in planning if "waiting for plan" in r.getMessage())
    gave_up = next(r.created for r in planning if "no plan from" in r.getMessage())
    assert 0.9 <= gave_up - first_poll <= 1.0 + 3.0, gave_up - first_poll
    assert_close(train(run.model, run.optimizer, job["batch"]), plain_losses(job))
    unwrap(run)


class NoBlocks(nn.Module):
    """Nothing repeated the profiler could find: no ModuleList of same-class blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 32)
        self.b = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x))).mean()


def test_wrap_on_a_model_it_cannot_handle_gives_a_clear_error_and_leaves_it_untouched() -> None:
    from agent.profiler import BlockDetectionError

    model = NoBlocks()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    params = list(model.parameters())
    with pytest.raises(
        BlockDetectionError,
        match=r"no nn.ModuleList or nn.Sequential of same-class blocks.*agent.wrap\(model, optimizer, ..., blocks=",
    ):
        wrap(model, opt, sample_batch=torch.randn(4, 16), loss_fn=lambda out, batch: out)
    assert list(model.parameters()) == params
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]) and p.grad is None
    assert not opt.state
    assert all(
        not m._forward_hooks and not m._forward_pre_hooks and "forward" not in m.__dict__
        for m in model.modules()
    )
    assert not getattr(model, "_memplan_wrapped", False)


def test_unwrap_gives_back_the_trained_model_with_every_change_undone(job: dict[str, Any]) -> None:
    ref = copy.deepcopy(job["model"])
    train(ref, adamw(ref), job["batch"])
    run, _ = run_wrapped(job, feedback_steps=4)
    model = unwrap(run)
    for m in model.modules():
        assert "forward" not in m.__dict__
        assert not m._forward_hooks and not m._forward_pre_hooks
    ref_params = dict(ref.named_parameters())
    for n, p in model.named_parameters():
        assert (
            not isinstance(p.data, torch.Tensor)
            or p.data.untyped_storage().nbytes() == p.numel() * p.element_size()
        )
        d = (
            (p.detach() - ref_params[n].detach()).norm() / ref_params[n].detach().norm().clamp_min(1e-12)
        ).item()
        assert d <= TOL, n


def test_planned_allocation_puts_the_runtime_buffers_in_one_arena_and_trains_the_same(
    job: dict[str, Any],
) -> None:
    from agent.runtime.arena import ArenaDeviceContext

    reference, _ = run_wrapped(job)
    plan = reference.plan
    unwrap(reference)
    model = copy.deepcopy(job["model"])
    wrapped = wrap(model, adamw(model), plan=plan, allocation="planned", feedback_steps=None)
    assert isinstance(wrapped.runtime.ctx, ArenaDeviceContext)
    assert wrapped.allocator is None  # CPU: no pluggable allocator, only the runtime's arena is planned
    assert_close(train(wrapped.model, wrapped.optimizer, job["batch"]), plain_losses(job))
    unwrap(wrapped)


def test_unknown_allocation_mode_is_refused_before_the_model_is_touched() -> None:
    model, _ = build("llama", 2, 64, seq=32)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match="allocation"):
        wrap(model, adamw(model), plan=None, sample_batch=None, allocation="magic")
    assert not getattr(model, "_memplan_wrapped", False)
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())
