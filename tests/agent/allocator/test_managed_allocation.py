"""A plan's allocation places the iteration the plan runs, not the profiled one (issue 19 defect 3, issue 16).

Real parts: a llama from the model zoo, the real profiler and solver under a device limit that forces
offloading and checkpointing, the real runtime running the plan on the CPU, the real allocation planner and
validator, and the real planner service (SQLite) on a loopback port for the end-to-end path.
"""

from __future__ import annotations

import copy
from typing import Any

import httpx
import pytest
import torch
from rich.console import Console
from typer.testing import CliRunner

from agent.allocator.managed import has_managed_allocation, with_managed_allocation
from agent.planning import solve_embedded
from agent.testing.model_zoo import build, sample_batch
from agent.wrapping import unwrap, wrap
from client.cli.render import plan_table
from client.contract import ActivationMode, AllocationCategory, Constraints, Placement, Plan
from client.sdk import Client
from planner_service.solver.allocation import validate_allocation

pytestmark = pytest.mark.slow
LIMIT_FRACTION = 0.5  # of the un-managed peak: chunks are offloaded and a block is checkpointed


@pytest.fixture(scope="module")
def job() -> dict[str, Any]:
    """The model, its batch, its profiled trace (whole, with its allocation trace) and a limit that forces
    offloading and checkpointing."""
    import agent

    model, config = build("llama", 4, 128, vocab=2048, seq=64)
    batch = sample_batch(config, 2, 64)
    probe = copy.deepcopy(model)
    trace = agent.profile(probe, batch, optimizer=torch.optim.AdamW(probe.parameters(), lr=1e-3), repeats=1)
    limit = int(trace.measurements.peak_device_bytes * LIMIT_FRACTION)
    return {"model": model, "batch": batch, "trace": trace, "limit": limit}


def _wrapped(job: dict[str, Any], **kwargs: Any) -> Any:
    model = copy.deepcopy(job["model"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return wrap(model, opt, sample_batch=job["batch"], device_memory=job["limit"], **kwargs)


def _check_managed(plan: Plan, *, checkpoint: bool) -> None:
    """The plan offloads (and checkpoints), and its allocation places every event of its managed iteration."""
    assert plan.policy is not None
    assert any(c.placement is Placement.offloaded for c in plan.policy.chunks)
    if checkpoint:
        assert any(b.mode is ActivationMode.checkpoint for b in plan.policy.blocks)
    a = plan.allocation
    assert a is not None and a.iteration == "managed" and a.events is not None
    validate_allocation(a.events, a)  # raises on an overlap, a missing or unknown buffer, a bad arena
    assert sorted(o.id for o in a.offsets) == sorted(e.id for e in a.events.events)


def _with_checkpointing(plan: Plan) -> Plan:
    """The solver's plan, with every repeated block checkpointed if it chose none (its choice between keeping
    and checkpointing at this limit depends on the timings measured on a shared machine)."""
    assert plan.policy is not None
    if any(b.mode is ActivationMode.checkpoint for b in plan.policy.blocks):
        return plan
    blocks = [
        b.model_copy(update={"mode": ActivationMode.checkpoint}) if 0 < i < len(plan.policy.blocks) - 1 else b
        for i, b in enumerate(plan.policy.blocks)
    ]
    return plan.model_copy(update={"policy": plan.policy.model_copy(update={"blocks": blocks})})


def test_the_plans_arena_is_that_of_its_managed_iteration(job: dict[str, Any]) -> None:
    trace = job["trace"]
    solved = solve_embedded(trace, Constraints(device_memory_bytes=job["limit"], time_limit_s=5.0))
    assert solved.allocation is not None and solved.allocation.iteration == "profiled"
    assert solved.allocation.events == trace.allocation_trace  # a plan carries the events it places
    solved = _with_checkpointing(solved)
    model = copy.deepcopy(job["model"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    plan = with_managed_allocation(model, opt, solved, job["batch"])  # what wrap does with a new plan
    _check_managed(plan, checkpoint=True)
    a, profiled = plan.allocation, solved.allocation
    assert a is not None and a.events is not None
    # offloaded chunks stream through two buffers and a checkpointed block keeps no activations: the managed
    # iteration holds far less than the profiled one, and its arena says so
    assert a.lower_bound_bytes < 0.7 * profiled.lower_bound_bytes
    assert a.arena_bytes < 0.7 * profiled.arena_bytes
    long_lived = {e.category for e in a.events.events if e.free_index is None}
    assert AllocationCategory.param in long_lived  # the runtime's chunk buffers, placed once
    # the recorded iteration is the one the plan runs: the feedback's metered step (a real training step of
    # the wrapped model, the same tracker rules) peaks at the arena's live-bytes bound
    run = wrap(model, opt, plan=plan, sample_batch=job["batch"], feedback_steps=4)
    try:
        for _ in range(4):
            loss = run.model(**job["batch"]).loss
            loss.backward()
            run.optimizer.step()
            run.optimizer.zero_grad()
        assert run.monitor is not None
        measured = run.monitor.measured.peak_device_bytes
        assert measured is not None
        assert abs(measured - a.lower_bound_bytes) <= 0.02 * a.lower_bound_bytes, (
            measured,
            a.lower_bound_bytes,
        )
    finally:
        unwrap(run)


def test_end_to_end_the_service_stores_the_managed_allocation_and_shows_it(
    job: dict[str, Any], service: str
) -> None:
    run = _wrapped(job, server=service, feedback_steps=None)
    try:
        assert run.source.origin == "service" and run.source.plan_id is not None
        _check_managed(run.plan, checkpoint=False)
        plan_id = run.source.plan_id
    finally:
        unwrap(run)
    with Client(service) as client:
        stored = client.get_plan(plan_id).plan
        assert stored is not None and stored.allocation is not None
        assert stored.allocation.iteration == "managed"
        assert stored.allocation.arena_bytes == run.plan.allocation.arena_bytes
        console = Console(width=200, record=True)
        console.print(plan_table(stored))
        text = console.export_text()
        assert "this plan's iteration: arena" in text and "un-managed" not in text
    page = httpx.get(f"{service}/ui/plans/{plan_id}", timeout=30).text
    assert (
        "Allocation plan of this plan&#39;s iteration" in page
        or "Allocation plan of this plan's iteration" in page
    )
    assert "arena of this plan" in page and "arena of the profiled iteration" not in page

    # the plan reused from history carries its managed allocation: nothing is recorded again
    again = _wrapped(job, server=service, feedback_steps=None)
    try:
        assert again.source.origin == "history"
        assert has_managed_allocation(again.source.plan)
        assert again.plan.allocation == stored.allocation
    finally:
        unwrap(again)


def test_a_cpu_jobs_metered_step_gives_its_plan_the_managed_allocation(
    job: dict[str, Any], service: str
) -> None:
    """Issue 16: no copy of the job at wrap when a feedback monitor meters a step: that real step of the job is
    recorded, placed and sent through the shared path (`place_and_publish`, as the CUDA job's history is), and
    `memplan plans get` and the plan page then show the arena of this plan."""
    from memplan.cli import app

    run = _wrapped(job, server=service, feedback_steps=5)
    try:
        assert run.source.origin == "service" and run.source.plan_id is not None
        plan_id = run.source.plan_id
        assert not has_managed_allocation(run.plan)  # nothing recorded at wrap: no copy of the job
        assert run.monitor is not None and run.monitor.recorder is not None
        recorder = run.monitor.recorder
        for step in range(5):
            loss = run.model(**job["batch"]).loss
            loss.backward()
            run.optimizer.step()
            run.optimizer.zero_grad()
            if step == run.monitor.meter_step:
                # recorded at the metered step; placed and sent only with the feedback, so the placement's CPU
                # time is in none of the timed steps
                assert recorder.events is not None and not recorder.sending
        run.monitor.wait_sent(60.0)
        assert recorder.sending
        assert recorder.failure is None
        _check_managed(run.plan, checkpoint=False)
        assert run.source.plan.allocation == run.plan.allocation
        # the placed events are the metered step's: its measured peak is the arena's live-bytes bound
        a, measured = run.plan.allocation, run.monitor.measured.peak_device_bytes
        assert a is not None and measured is not None
        assert abs(measured - a.lower_bound_bytes) <= 0.02 * a.lower_bound_bytes, (
            measured,
            a.lower_bound_bytes,
        )
    finally:
        unwrap(run)
    got = CliRunner().invoke(app, ["plans", "get", plan_id, "--server", service], catch_exceptions=False)
    assert got.exit_code == 0, got.output
    text = " ".join(got.output.split())  # the console wraps at its width: compare words
    assert "this plan's iteration: arena" in text and "un-managed" not in text
    page = httpx.get(f"{service}/ui/plans/{plan_id}", timeout=30).text
    assert "arena of this plan" in page and "arena of the profiled iteration" not in page


def test_a_cached_copy_of_the_plan_is_not_answered_304_once_the_allocation_changed(
    job: dict[str, Any], service: str
) -> None:
    """The stored Plan changes after it finished: its entity tag must change too (migration 0008's revision)."""
    with Client(service) as client:
        run = _wrapped(job, server=service, feedback_steps=None, reuse=False)
        unwrap(run)
        plan_id = run.source.plan_id
        assert plan_id is not None
        first = httpx.get(f"{service}/v1/plans/{plan_id}", timeout=30)
        tag = first.headers["etag"]
        assert (
            httpx.get(f"{service}/v1/plans/{plan_id}", headers={"if-none-match": tag}, timeout=30).status_code
            == 304
        )
        events = run.plan.allocation.events
        assert events is not None
        client.put_managed_allocation(plan_id, events)  # the same events again: a new revision all the same
        after = httpx.get(f"{service}/v1/plans/{plan_id}", headers={"if-none-match": tag}, timeout=30)
        assert after.status_code == 200 and after.headers["etag"] != tag


def test_the_service_refuses_a_managed_allocation_for_a_plan_that_is_not_done(service: str) -> None:
    from agent.allocator.managed import record_managed_trace  # noqa: F401 - the agent's side is not needed here
    from client.contract import AllocationTrace
    from client.errors import MemplanError

    events = AllocationTrace(
        source="dispatch_tracker",
        horizon=2,
        events=[
            {
                "id": 0,
                "size_bytes": 512,
                "alloc_index": 0,
                "free_index": 1,
                "category": "temp",
                "phase": "forward",
            }
        ],
    )
    with Client(service) as client, pytest.raises(MemplanError, match="not found"):
        client.put_managed_allocation("0" * 32, events)
