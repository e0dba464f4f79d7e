"""The one error by which the solver says a request itself is wrong (as opposed to a bug in the solver)."""

from __future__ import annotations


class PlanRequestRefused(ValueError):
    """The request cannot be solved as asked (an unknown solver, limits that contradict each other): solving it
    again cannot help, and the message names the request's field. Any other exception out of the solver,
    ValueError included, is a bug in the solver: the worker retries it and its runner logs the traceback."""
