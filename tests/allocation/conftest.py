"""Shared helpers for the allocation planner tests: the MiniMalloc data folder and small traces."""

from __future__ import annotations

from pathlib import Path

import pytest

from client.contract import AllocationCategory, AllocationEvent, AllocationTrace, Phase

MINIMALLOC_DATA = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "minimalloc"


def minimalloc_file(name: str) -> Path:
    path = MINIMALLOC_DATA / name
    if not path.exists():
        pytest.skip(f"{path} absent (the MiniMalloc benchmark instances live in ../shared)")
    return path


def event(eid: int, size: int, alloc: int, free: int | None, category: str = "activation") -> AllocationEvent:
    return AllocationEvent(id=eid, size_bytes=size, alloc_index=alloc, free_index=free,
                           category=AllocationCategory(category), phase=Phase.forward)


def trace(horizon: int, *events: AllocationEvent) -> AllocationTrace:
    return AllocationTrace(source="dispatch_tracker", horizon=horizon, events=list(events))
