"""Calls to the planner service from inside `wrap`: one total time budget, and which failures mean "down".

httpx timeouts bound each read, not a whole exchange: a server that trickles a byte every few seconds, or
holds a long-poll, could stall a training job without end. `ServiceBudget.call(fn)` runs `fn` (a function of
the SDK client) on a daemon thread and waits at most the time left of the budget shared by every call of
one `wrap`; past it, the client is closed (which ends its reads) and `ServiceBudgetExceeded` is raised, so
`wrap` solves in-process instead.

`classify(exc)` sorts what a call raised: "down" (connection errors and timeouts, 5xx, 429, the budget:
the service is unreachable or busy: a warning and the in-process fallback), "rejected" (any other answer
the agent did not expect: a 4xx, a response that does not validate: an ERROR with the reason, then the
fallback, since the training job comes first), or None (anything else is a bug of the agent's own and is
raised).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Literal, TypeVar

import pydantic

from client.errors import APIConnectionError, APIStatusError, MemplanError

T = TypeVar("T")

Failure = Literal["down", "rejected"]


class ServiceBudgetExceeded(APIConnectionError):
    """The service path of `wrap` used up its total time budget."""


class ServiceBudget:
    """The time left for the service path of one `wrap`; `close` is called when a call overruns it."""

    def __init__(self, seconds: float, close: Callable[[], None]) -> None:
        if seconds <= 0:
            raise ValueError(f"service_budget_s: must be positive, got {seconds}")
        self.seconds = seconds
        self._deadline = time.monotonic() + seconds
        self._close = close

    def left(self) -> float:
        return max(0.0, self._deadline - time.monotonic())

    def call(self, fn: Callable[[], T], what: str) -> T:
        """`fn()` if it finishes within the budget left; else close the client and raise ServiceBudgetExceeded."""
        box: dict[str, object] = {}

        def run() -> None:
            try:
                box["value"] = fn()
            except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread below
                box["error"] = exc

        thread = threading.Thread(target=run, name=f"memplan-service-{what}", daemon=True)
        thread.start()
        thread.join(self.left())
        if thread.is_alive():
            self._close()  # ends the stalled read; the thread then finishes by itself
            raise ServiceBudgetExceeded(f"{what}: no answer within the service budget of {self.seconds:.0f}s")
        if "error" in box:
            raise box["error"]  # type: ignore[misc]
        return box["value"]  # type: ignore[return-value]


def classify(exc: BaseException) -> Failure | None:
    """ "down", "rejected" or None (not the service's doing: re-raise). See the module docstring."""
    if isinstance(exc, APIConnectionError):
        return "down"
    if isinstance(exc, APIStatusError):
        return "down" if exc.status_code >= 500 or exc.status_code == 429 else "rejected"
    if isinstance(exc, (MemplanError, pydantic.ValidationError)):
        return "rejected"
    return None
