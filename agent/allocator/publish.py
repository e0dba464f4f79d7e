"""Send a plan's managed allocation to the service that made the plan, so its record shows that plan's arena.

Best effort, like feedback: the training job never fails because the service is down or refuses; the
reason is logged once. The service places the events itself (`PUT /v1/plans/{id}/allocation`), with the
same planner and validator as the agent's in-process placement.

`place_and_publish` is the one path from a managed iteration's events to the plan's record, whoever
recorded them: the CPU copy of the job at `wrap` (`agent.allocator.managed.record_managed_trace`), or the
job's own metered step, on the CPU from the storage tracker or on CUDA from the caching allocator's
memory-history snapshot (`agent.allocator.managed_step`).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING

from agent.allocator.managed import MANAGED_ALLOCATION_TIME_LIMIT_S, plan_managed_allocation
from client.contract import AllocationTrace, Plan
from client.sdk import Client

if TYPE_CHECKING:
    from agent.planning import PlanSource

log = logging.getLogger(__name__)

PUBLISH_TIMEOUT_S = 90.0


def publish_managed_allocation(
    server: str, plan_id: str, plan: Plan, *, timeout_s: float = PUBLISH_TIMEOUT_S
) -> bool:
    """Send `plan.allocation.events` (the managed iteration) for plan `plan_id`; True when the service stored
    it. Never raises for the service's failures."""

    a = plan.allocation
    if a is None or a.iteration != "managed" or a.events is None:
        raise ValueError("plan.allocation: has no managed iteration's events to send")
    try:
        with Client(server, timeout=timeout_s, max_retries=1) as client:
            client.put_managed_allocation(plan_id, a.events)
    except Exception as exc:  # noqa: BLE001 - the service's failure must not stop the training job
        log.warning(
            "memplan: the managed allocation of plan %s was not stored by %s (%s: %s); the plan's record "
            "keeps the placement of the profiled iteration",
            plan_id[:12],
            server,
            type(exc).__name__,
            exc,
        )
        return False
    log.info("memplan: plan %s now carries the allocation of its managed iteration", plan_id[:12])
    return True


def publish(source: PlanSource) -> None:
    """Send the plan's managed allocation to the service that made it (best effort)."""
    if source.server and source.plan_id and source.origin in ("service", "history"):
        publish_managed_allocation(source.server, source.plan_id, source.plan)


def place_and_publish(
    source: PlanSource, events: AllocationTrace, *, time_limit_s: float = MANAGED_ALLOCATION_TIME_LIMIT_S
) -> PlanSource:
    """`source` with its plan's allocation replaced by the placement of `events` (one iteration run under
    the plan; placed with the service's planner and validator), sent to the service that made the plan.
    Raises what the placement raises (an invalid trace); the service's failures are only logged."""
    placed = dataclasses.replace(
        source, plan=plan_managed_allocation(source.plan, events, time_limit_s=time_limit_s)
    )
    publish(placed)
    return placed
