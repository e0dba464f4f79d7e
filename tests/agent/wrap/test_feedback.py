"""Feedback never stalls or breaks training: a silent service gets the post in the background, then a local file."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from agent.feedback import LocalSink, ServiceSink, StepMonitor
from agent.runtime import manual_plan
from agent.testing.model_zoo import build, sample_batch
from agent.wrapping import unwrap, wrap
from tests.loopback import LoopbackServer


@pytest.fixture
def silent_server() -> Iterator[str]:
    """Accepts connections and never answers (a hung service)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(srv.accept()[0])
            except OSError:
                continue

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.getsockname()[1]}"
    stop.set()
    t.join(5)
    for c in held:
        c.close()
    srv.close()


def test_feedback_to_a_hung_service_is_posted_in_the_background_then_recorded_locally(
    silent_server: str, tmp_path: Path
) -> None:
    model, cfg = build("gpt2", layers=2, hidden=64, vocab=128, seq=32, seed=0)
    batch = sample_batch(cfg, 2, 32)
    w = wrap(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True),
        plan=manual_plan(model, chunk_size_bytes=2**20),
        feedback_steps=None,
    )
    local = tmp_path / "fb.jsonl"
    mon = StepMonitor(
        model,
        w.optimizer,
        torch.device("cpu"),
        manager=w.runtime,
        activations=w.activations,
        sink=ServiceSink(silent_server, "plan-1", fallback=LocalSink(local), timeout_s=1.0),
        steps=4,
    )
    for _ in range(4):
        w.model(**batch).loss.backward()
        w.optimizer.step()
        w.optimizer.zero_grad()
    assert mon.measured.sent is not None, "feedback was not built after 4 steps"
    assert mon.measured.sent_to == "posting", "the step waited for the service"
    mon.wait_sent(60)
    assert mon.measured.sent_to is not None and mon.measured.sent_to.startswith("recorded locally")
    line = json.loads(local.read_text().splitlines()[0])
    assert line["plan_id"] == "plan-1" and line["feedback"]["steps_measured"] == 1
    assert line["feedback"]["peak_device_bytes"] > 0
    mon.close()
    unwrap(w)


def test_feedback_kept_locally_says_where_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    model, cfg = build("gpt2", layers=2, hidden=64, vocab=128, seq=32, seed=0)
    batch = sample_batch(cfg, 2, 32)
    local = tmp_path / "fb.jsonl"
    for _ in range(2):  # two jobs in one process: told once
        w = wrap(
            model,
            torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True),
            plan=manual_plan(model, chunk_size_bytes=2**20),
            feedback_steps=4,
            feedback_path=local,
        )
        with caplog.at_level("WARNING", logger="agent.feedback"):
            for _ in range(4):
                w.model(**batch).loss.backward()
                w.optimizer.step()
                w.optimizer.zero_grad()
        assert w.report().feedback_to == f"recorded locally in {local}"
        unwrap(w)
    told = [r.getMessage() for r in caplog.records if str(local) in r.getMessage()]
    assert len(told) == 1 and "MEMPLAN_SERVER" in told[0] and "MEMPLAN_FEEDBACK_PATH" in told[0]
    assert len(local.read_text().splitlines()) == 2


def test_once_feedback_is_sent_the_monitor_stops_hooking_the_training_loop(tmp_path: Path) -> None:
    """Issue 19 defect 9: the monitor's post-step hook synchronised the device after every step of the whole
    run (its hooks were never removed), cancelling the overlap `async_step` exists for. Once the feedback is
    sent, its hooks go at the next forward and no later step is counted or synchronised."""
    model, cfg = build("gpt2", layers=2, hidden=64, vocab=128, seq=32, seed=0)
    batch = sample_batch(cfg, 2, 32)
    w = wrap(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True),
        plan=manual_plan(model, chunk_size_bytes=2**20),
        feedback_steps=4,
        feedback_path=tmp_path / "fb.jsonl",
    )
    assert w.monitor is not None
    hooks_before = len(model._forward_pre_hooks), len(w.optimizer._optimizer_step_post_hooks)
    for _ in range(7):
        w.model(**batch).loss.backward()
        w.optimizer.step()
        w.optimizer.zero_grad()
    assert w.monitor.measured.sent is not None and w.monitor.measured.steps == 4  # nothing counted after
    assert len(model._forward_pre_hooks) == hooks_before[0] - 1  # the monitor's forward hook is gone
    assert len(w.optimizer._optimizer_step_post_hooks) == hooks_before[1] - 1  # and its post-step hook
    unwrap(w)


class ServiceBeforePhases(LoopbackServer):
    """A planner service of the release before feedback phases, as far as feedback goes: its contract refuses
    unknown keys (422 naming `body.phases`, the service's error shape), and it stores what it knows."""

    def __init__(self) -> None:
        from starlette.applications import Starlette
        from starlette.requests import Request
        from starlette.responses import JSONResponse
        from starlette.routing import Route

        self.received: list[dict[str, object]] = []

        async def feedback(request: Request) -> JSONResponse:
            body = await request.json()
            if "phases" in body:
                detail = [{"field": "body.phases", "message": "Extra inputs are not permitted"}]
                return JSONResponse({"error": "validation failed", "detail": detail}, status_code=422)
            self.received.append(body)
            record = {
                "id": "f" * 32,
                "plan_id": request.path_params["plan_id"],
                "feedback": body,
                "iteration_error": None,
                "peak_device_error": None,
                "created_at": "2026-11-30T00:00:00Z",
            }
            return JSONResponse(record, status_code=201)

        super().__init__(
            Starlette(routes=[Route("/v1/plans/{plan_id}/feedback", feedback, methods=["POST"])])
        )


def test_feedback_to_a_service_from_before_phases_is_posted_without_them(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Session 19 probe: a service started before `Feedback.phases` refused the new agent's feedback (422), which
    was then kept only locally; the agent now posts the iteration and peaks it knows, and says so."""
    from client.contract import Feedback, MeasuredPhases

    fb = Feedback(
        iteration_s=0.1,
        peak_device_bytes=10,
        peak_host_bytes=0,
        steps_measured=3,
        phases=MeasuredPhases(forward_s=0.03, backward_s=0.06, step_s=0.01, uploads_per_iteration=4.0),
    )
    old = ServiceBeforePhases()
    with old as url, caplog.at_level("WARNING", logger="agent.feedback"):
        sink = ServiceSink(url, "p" * 32, fallback=LocalSink(tmp_path / "fb.jsonl"))
        where = sink.send(fb)
    assert where.startswith(f"posted to {url}"), where
    assert old.received == [fb.model_dump(mode="json", exclude={"phases"})]
    assert any("predates feedback phases" in r.getMessage() for r in caplog.records)
    assert not (tmp_path / "fb.jsonl").exists()
