"""Traces in the wire forms a service must read: the current one and trace schema 1 (events as lists)."""

from __future__ import annotations

import json
from typing import Any

from client.contract import Trace
from planner_service.solver.allocation.scaled_traces import random_trace
from planner_service.solver.testing.synthetic import synthetic_trace


def trace_with_events(n: int = 300) -> Trace:
    """A small synthetic trace with `n` random allocation events."""
    raw = json.loads(synthetic_trace(n_blocks=3, hidden=64, vocab=100, batch=1, seq=16).canonical_json())
    raw["allocation_trace"] = json.loads(random_trace(n, seed=3, mean_live=20).model_dump_json())
    return Trace.model_validate(raw)


def schema_1(trace: Trace) -> dict[str, Any]:
    """`trace` as an agent before trace schema 2 sent it: events as JSON lists."""
    raw = json.loads(trace.canonical_json())
    assert trace.allocation_trace is not None
    raw["schema_version"] = 1
    raw["allocation_trace"] = {
        "source": trace.allocation_trace.source,
        "horizon": trace.allocation_trace.horizon,
        "event_columns": trace.allocation_trace.columns.model_dump(),
    }
    return raw
