"""The service path of `wrap` under faults: one total budget, and only the service's failures are "down".

Real parts: the real planner service (SQLite) on a loopback port, behind a small real HTTP proxy on another
loopback port that lets chosen requests through and misbehaves on others (hangs, trickles one byte every
second, answers a status of its choosing). The agent talks HTTP to the proxy exactly as to a service.
"""

from __future__ import annotations

import copy
import http.server
import logging
import re
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
import torch
from torch import nn

from agent.testing.model_zoo import build_with_library_defaults, sample_batch
from planner_service.embedded import EmbeddedServer, free_port

pytestmark = pytest.mark.slow

Rule = Callable[
    [str, str], "str | tuple[int, str] | None"
]  # (method, path) -> "hang" | "trickle" | (status, body) | None


class MisbehavingProxy:
    """Forwards to `upstream` unless `rule(method, path)` says to hang, trickle or answer a status."""

    def __init__(self, upstream: str | None, rule: Rule) -> None:
        self.upstream, self.rule, self.stop = upstream, rule, threading.Event()
        self.seen: list[str] = []
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _handle(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                proxy.seen.append(f"{self.command} {self.path}")
                action = proxy.rule(self.command, self.path)
                if action == "hang":
                    proxy.stop.wait()
                    return
                if action == "trickle":
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", "100000")
                    self.end_headers()
                    while not proxy.stop.wait(1.0):
                        try:
                            self.wfile.write(b" ")
                            self.wfile.flush()
                        except OSError:
                            return
                    return
                if isinstance(action, tuple):
                    status, text = action
                    payload = text.encode()
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                    return
                assert proxy.upstream is not None
                headers = {
                    k: v for k, v in self.headers.items() if k.lower() not in ("host", "content-length")
                }
                r = httpx.request(
                    self.command, proxy.upstream + self.path, content=body, headers=headers, timeout=60
                )
                self.send_response(r.status_code)
                for k, v in r.headers.items():
                    if k.lower() not in (
                        "content-length",
                        "transfer-encoding",
                        "connection",
                        "content-encoding",
                    ):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(r.content)))
                self.end_headers()
                self.wfile.write(r.content)

            do_GET = do_POST = do_PUT = do_DELETE = _handle

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> MisbehavingProxy:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from planner_service.settings import Settings

    db = tmp_path_factory.mktemp("svc") / "memplan.db"
    with EmbeddedServer(Settings(database_url=f"sqlite:///{db}", workers=1)) as url:
        yield url


@pytest.fixture(scope="module")
def job() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    model, config = build_with_library_defaults("llama", layers=2, hidden=64, vocab=256, seq=64)
    return model, sample_batch(config, 2, 16)


def wrap_in_thread(
    job: tuple[nn.Module, dict[str, torch.Tensor]], url: str, limit_s: float, **kw: Any
) -> Any:
    """`agent.wrap` against `url` on a thread; fails the test if it has not returned after `limit_s` (a stall)."""
    import agent

    model = copy.deepcopy(job[0])
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["wrapped"] = agent.wrap(
                model,
                torch.optim.AdamW(model.parameters(), lr=1e-3),
                sample_batch=job[1],
                device_memory="1GiB",
                server=url,
                **{"feedback_steps": None, **kw},
            )
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            box["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t0 = time.monotonic()
    t.start()
    t.join(limit_s)
    assert not t.is_alive(), f"wrap stalled for more than {limit_s}s against a misbehaving service"
    box["took"] = time.monotonic() - t0
    if "error" in box:
        raise box["error"]
    return box


PLAN_GET = re.compile(r"^/v1/plans/[^/?]+")


@pytest.mark.parametrize("misbehaviour", ["trickle", "hang"])
def test_a_service_that_trickles_or_hangs_on_get_plan_costs_at_most_the_budget(
    service: str,
    job: tuple[nn.Module, dict[str, torch.Tensor]],
    misbehaviour: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Issue 17 defect 7: a server trickling a byte every few seconds stalled wrap without end; one hanging on
    GET plan blocked it for 30 s + the wait, ignoring the agent's settings."""
    caplog.set_level(logging.WARNING, logger="agent")

    def rule(method: str, path: str) -> str | None:
        return misbehaviour if method == "GET" and PLAN_GET.match(path) else None

    with MisbehavingProxy(service, rule) as proxy:
        box = wrap_in_thread(job, proxy.url, limit_s=90, service_budget_s=4.0, reuse=False)
    wrapped = box["wrapped"]
    assert wrapped.source.origin == "fallback"
    assert "service budget of 4s" in wrapped.source.message
    assert any(s.startswith("POST /v1/plans") for s in proxy.seen) and any(
        PLAN_GET.match(s.split()[1]) for s in proxy.seen if s.startswith("GET")
    )
    said = [r for r in caplog.records if "unavailable" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING, [r.getMessage() for r in caplog.records]


def test_a_trickling_history_look_up_is_cut_by_the_budget_too(
    job: tuple[nn.Module, dict[str, torch.Tensor]], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="agent")
    with MisbehavingProxy(None, lambda m, p: "trickle") as proxy:
        box = wrap_in_thread(job, proxy.url, limit_s=90, service_budget_s=3.0)
    assert box["wrapped"].source.origin == "fallback"
    assert "history look-up: no answer within the service budget of 3s" in box["wrapped"].source.message
    assert [s.split("?")[0] for s in proxy.seen] == [
        "GET /v1/plans"
    ]  # nothing else was tried after the budget


def test_the_default_budget_is_the_wait_plus_a_margin() -> None:
    import inspect

    from agent.planning import SERVICE_BUDGET_MARGIN_S, obtain_plan

    assert inspect.signature(obtain_plan).parameters["service_budget_s"].default is None
    assert 0 < SERVICE_BUDGET_MARGIN_S <= 30


@pytest.mark.parametrize(
    ("status", "level"),
    [(503, logging.WARNING), (429, logging.WARNING), (422, logging.ERROR), (400, logging.ERROR)],
)
def test_only_5xx_429_and_connection_errors_are_service_down_other_answers_are_errors(
    service: str,
    job: tuple[nn.Module, dict[str, torch.Tensor]],
    status: int,
    level: int,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Issue 18: a 4xx (the service rejecting the agent's own trace) silently became an in-process fallback."""
    caplog.set_level(logging.WARNING, logger="agent")
    body = '{"error": "hostile answer", "detail": [{"field": "model.fingerprint", "message": "bad"}]}'

    def rule(method: str, path: str) -> tuple[int, str] | None:
        return (status, body) if method == "POST" and path.startswith("/v1/traces") else None

    with MisbehavingProxy(service, rule) as proxy:
        box = wrap_in_thread(job, proxy.url, limit_s=90, reuse=False)
    assert box["wrapped"].source.origin == "fallback"  # the job still trains
    said = [r for r in caplog.records if "solving in-process" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == level, [
        (r.levelname, r.getMessage()) for r in caplog.records
    ]
    assert str(status) in said[0].getMessage()
    if level == logging.ERROR:
        assert "rejected" in said[0].getMessage() and "model.fingerprint" in said[0].getMessage()


def test_a_connection_refused_is_service_down(
    job: tuple[nn.Module, dict[str, torch.Tensor]], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="agent")
    box = wrap_in_thread(job, f"http://127.0.0.1:{free_port()}", limit_s=90)
    assert box["wrapped"].source.origin == "fallback"
    said = [r for r in caplog.records if "solving in-process" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING and "unavailable" in said[0].getMessage()


def test_a_bug_in_the_agent_is_raised_not_reported_as_the_service_being_down(
    service: str, job: tuple[nn.Module, dict[str, torch.Tensor]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 18: fingerprint/workload_key ran inside `except Exception`, so their bugs read 'service unreachable'.
    The fault is injected into the agent's own function (a stand-in for a real bug); the service is real."""
    import agent.profiler.parameters as parameters

    def broken(model: nn.Module) -> str:
        raise TypeError("a bug in the agent's fingerprint")

    import agent

    monkeypatch.setattr(parameters, "fingerprint", broken)
    model = copy.deepcopy(job[0])
    with pytest.raises(TypeError, match="a bug in the agent's fingerprint"):
        agent.wrap(model, torch.optim.AdamW(model.parameters()), sample_batch=job[1], server=service)
    assert model.config.use_cache is True  # the failed wrap gave the cache setting back


def test_a_missing_token_is_told_as_such_not_as_a_defect_to_report(
    tmp_path: Any,
    job: tuple[nn.Module, dict[str, torch.Tensor]],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Defect: against a service with auth on (docker compose's), an agent without MEMPLAN_TOKEN logged
    "rejected the agent's history look-up (AuthenticationError: 401: ...); this is a defect, please report
    it": the fix is the user's setting, which the message did not name."""
    from planner_service.settings import Settings

    monkeypatch.delenv("MEMPLAN_TOKEN", raising=False)
    caplog.set_level(logging.WARNING, logger="agent")
    settings = Settings(database_url=f"sqlite:///{tmp_path / 'auth.db'}", workers=1, auth=True)
    with EmbeddedServer(settings) as url:
        box = wrap_in_thread(job, url, limit_s=90)
    assert box["wrapped"].source.origin == "fallback"
    said = [r.getMessage() for r in caplog.records if "solving in-process" in r.getMessage()]
    assert len(said) == 1 and "MEMPLAN_TOKEN" in said[0] and "401" in said[0], said
    assert "defect" not in said[0], said


@pytest.mark.parametrize("suffix", ["/v1", "/ui/plans"])
def test_a_url_that_is_not_the_services_root_is_told_as_such_not_as_a_defect_to_report(
    service: str,
    job: tuple[nn.Module, dict[str, torch.Tensor]],
    suffix: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Defect: `server="http://host:8000/v1"` (the API's paths start with /v1) got every request answered 404
    and logged "this is a defect, please report it" instead of saying the URL is not the service's root."""
    caplog.set_level(logging.WARNING, logger="agent")
    box = wrap_in_thread(job, service + suffix, limit_s=90)
    assert box["wrapped"].source.origin == "fallback"
    said = [r.getMessage() for r in caplog.records if "solving in-process" in r.getMessage()]
    assert len(said) == 1 and "defect" not in said[0], said
    assert f"no memplan API at {service + suffix}" in said[0] and f"e.g. {service}" in said[0], said


def tampered(upstream: str, path: str, edit: Callable[[dict[str, Any]], None]) -> tuple[int, str]:
    """The upstream's answer to GET `path`, edited (a faulty, stale or other-version service)."""
    import json

    record = httpx.get(upstream + path, timeout=60).json()
    edit(record)
    return 200, json.dumps(record)


def tampering(upstream: str, edit: Callable[[dict[str, Any]], None], *, wait: bool = True) -> Rule:
    """A proxy rule: every plan read answered with the upstream's record, edited (`wait=False`: asked upstream
    without the long-poll's `?wait=`)."""

    def rule(method: str, path: str) -> tuple[int, str] | None:
        if method == "GET" and PLAN_GET.match(path):
            return tampered(upstream, path if wait else path.split("?")[0], edit)
        return None

    return rule


def train_one_step(wrapped: Any, batch: dict[str, torch.Tensor]) -> float:
    loss = wrapped.model(**batch).loss
    loss.backward()
    wrapped.optimizer.step()
    wrapped.optimizer.zero_grad()
    return float(loss.item())


def test_a_304_to_a_plan_read_without_a_tag_falls_back_instead_of_crashing_the_job(
    service: str, job: tuple[nn.Module, dict[str, torch.Tensor]]
) -> None:
    """Session 19 probe: a proxy answering 304 Not Modified to a plain GET raised AssertionError out of wrap."""

    def rule(method: str, path: str) -> tuple[int, str] | None:
        return (304, "") if method == "GET" and PLAN_GET.match(path) else None

    with MisbehavingProxy(service, rule) as proxy:
        wrapped = wrap_in_thread(job, proxy.url, limit_s=90, reuse=False)["wrapped"]
    assert wrapped.source.origin == "fallback" and "304" in wrapped.source.message
    assert train_one_step(wrapped, job[1]) > 0


def test_a_service_that_answers_infeasible_is_checked_in_process(
    service: str, job: tuple[nn.Module, dict[str, torch.Tensor]]
) -> None:
    """Session 19 probe: a service answering "infeasible" for a model that fits 1 GiB many times over stopped the job
    with PlanInfeasibleError; the in-process solver now has the last word."""

    def infeasible(record: dict[str, Any]) -> None:
        record["status"] = "infeasible"
        if record.get("plan"):
            record["plan"]["policy"] = record["plan"]["allocation"] = record["plan"]["predictions"] = None
            record["plan"]["solver"]["status"] = "infeasible"

    with MisbehavingProxy(service, tampering(service, infeasible)) as proxy:
        wrapped = wrap_in_thread(job, proxy.url, limit_s=90, reuse=False)["wrapped"]
    assert wrapped.source.origin == "fallback" and "infeasible" in wrapped.source.message
    assert train_one_step(wrapped, job[1]) > 0


def test_a_plan_whose_buffers_exceed_the_limits_is_not_applied(
    service: str, job: tuple[nn.Module, dict[str, torch.Tensor]]
) -> None:
    """Session 19 probe: a plan passing every structural check, with 64 GiB chunks all offloaded, made wrap
    allocate 64 GiB and die."""

    def huge(record: dict[str, Any]) -> None:
        policy = record["plan"]["policy"] if record.get("plan") else None
        if policy:
            policy["chunk_size_bytes"] = 2**36
            policy["n_buffers"] = 1
            for chunk in policy["chunks"]:
                chunk["placement"] = "offloaded"

    with MisbehavingProxy(service, tampering(service, huge)) as proxy:
        wrapped = wrap_in_thread(job, proxy.url, limit_s=90, reuse=False)["wrapped"]
    assert wrapped.source.origin == "fallback"
    assert f"take {2**36} bytes of device memory, above the job's {2**30}" in wrapped.source.message
    assert train_one_step(wrapped, job[1]) > 0


def test_a_done_plan_with_no_policy_is_told_as_such(
    service: str, job: tuple[nn.Module, dict[str, torch.Tensor]]
) -> None:
    """Session 19 probe: a record "done" with no policy fell back with the words "is done after 120s"."""

    def empty(record: dict[str, Any]) -> None:
        if record.get("plan"):
            record["plan"]["policy"] = record["plan"]["allocation"] = record["plan"]["predictions"] = None
            record["plan"]["solver"]["status"] = "unknown"

    with MisbehavingProxy(service, tampering(service, empty)) as proxy:
        wrapped = wrap_in_thread(job, proxy.url, limit_s=90, reuse=False)["wrapped"]
    assert wrapped.source.origin == "fallback"
    assert "is done with no usable policy (solver status unknown)" in wrapped.source.message
    assert "after" not in wrapped.source.message
    assert train_one_step(wrapped, job[1]) > 0


def _other_world_size(policy: dict[str, Any]) -> None:
    policy["world_size"] = 4


def _no_blocks(policy: dict[str, Any]) -> None:
    policy["blocks"] = []


@pytest.mark.parametrize(
    ("edit", "said"),
    [
        (_other_world_size, "it was solved for 4 ranks; this job has 1"),
        (_no_blocks, "it plans 0 blocks; the trace it was asked for has"),
    ],
)
def test_a_plan_for_another_job_shape_is_not_applied(
    service: str,
    job: tuple[nn.Module, dict[str, torch.Tensor]],
    edit: Callable[[dict[str, Any]], None],
    said: str,
) -> None:
    """Session 19 probe: a plan solved for 4 ranks, or one with its block list emptied, was applied to the job
    with no word (its predictions, collectives and activation modes are another job's)."""

    def other(record: dict[str, Any]) -> None:
        if record.get("plan") and record["plan"].get("policy"):
            edit(record["plan"]["policy"])

    with MisbehavingProxy(service, tampering(service, other)) as proxy:
        wrapped = wrap_in_thread(job, proxy.url, limit_s=90, reuse=False)["wrapped"]
    assert wrapped.source.origin == "fallback" and said in wrapped.source.message
    assert train_one_step(wrapped, job[1]) > 0


def test_a_service_that_ignores_the_long_poll_is_not_polled_in_a_tight_loop(
    service: str, job: tuple[nn.Module, dict[str, torch.Tensor]]
) -> None:
    """Session 19 probe: a server answering every plan read at once ("queued", ignoring `?wait=`) got 191 reads in
    10 s; the agent now polls at most twice a second, then solves in-process when its wait is over."""

    def queued(record: dict[str, Any]) -> None:
        record.update(status="queued", plan=None, headline=None, started_at=None, finished_at=None)

    with MisbehavingProxy(service, tampering(service, queued, wait=False)) as proxy:
        wrapped = wrap_in_thread(job, proxy.url, limit_s=90, reuse=False, wait_s=3.0)["wrapped"]
    reads = [s for s in proxy.seen if s.startswith("GET") and PLAN_GET.match(s.split()[1])]
    assert wrapped.source.origin == "fallback" and "queued" in wrapped.source.message
    assert len(reads) <= 3 / 0.5 + 2, f"{len(reads)} plan reads in a 3 s wait"


def test_a_service_that_hangs_on_feedback_and_allocation_costs_the_jobs_end_one_wait(
    service: str,
    job: tuple[nn.Module, dict[str, torch.Tensor]],
    tmp_path: Any,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Session 20 probe: with the feedback POST and the managed allocation's PUT hanging, `report()` took 25 s and
    `unwrap` 15 s more (15 s per background thread per call). One wait now, over every call, and said once; the
    feedback is recorded locally."""
    import agent
    from agent.feedback import SEND_WAIT_S

    monkeypatch.setenv("MEMPLAN_FEEDBACK_PATH", str(tmp_path / "feedback.jsonl"))
    caplog.set_level(logging.WARNING, logger="agent")

    def rule(method: str, path: str) -> str | None:
        return "hang" if method in ("POST", "PUT") and path.endswith(("/feedback", "/allocation")) else None

    with MisbehavingProxy(service, rule) as proxy:
        box = wrap_in_thread(job, proxy.url, limit_s=90, reuse=False, feedback_steps=4)
        wrapped = box["wrapped"]
        for _ in range(5):
            train_one_step(wrapped, job[1])
        t0 = time.monotonic()
        report = wrapped.report()
        agent.unwrap(wrapped)
        took = time.monotonic() - t0
        assert any(s.startswith("PUT") for s in proxy.seen) and any(
            s.endswith("/feedback") for s in proxy.seen
        )
    assert took < SEND_WAIT_S + 5, f"report() and unwrap waited {took:.1f}s for a hanging service"
    assert "recorded locally" in str(report.feedback_to), report.feedback_to
    assert (tmp_path / "feedback.jsonl").exists()
    behind = [r.getMessage() for r in caplog.records if "not waiting for it" in r.getMessage()]
    assert len(behind) == 1 and "managed allocation" in behind[0], behind
