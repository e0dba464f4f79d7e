"""Send a plan's managed allocation to the service that made the plan, so its record shows that plan's arena.

Best effort, like feedback: the training job never fails because the service is down or refuses; the
reason is logged once. The service places the events itself (`PUT /v1/plans/{id}/allocation`), with the
same planner and validator as the agent's in-process placement.
"""

from __future__ import annotations

import logging

from client.contract import Plan
from client.sdk import Client

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
