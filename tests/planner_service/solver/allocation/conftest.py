"""Shared helpers for the allocation planner tests: the vendored MiniMalloc instances and small traces."""

from __future__ import annotations

from pathlib import Path

from client.contract import AllocationCategory, AllocationEvent, AllocationTrace, Phase

# MiniMalloc's instances, Apache-2.0, vendored with their licence (see data/minimalloc/README.md)
MINIMALLOC_DATA = Path(__file__).resolve().parent / "data" / "minimalloc"


def minimalloc_file(name: str) -> Path:
    """A vendored MiniMalloc instance; a missing one is an error, never a skip."""
    path = MINIMALLOC_DATA / name
    if not path.is_file():
        raise FileNotFoundError(f"{path}: vendored MiniMalloc instance missing from the repository")
    return path


def event(eid: int, size: int, alloc: int, free: int | None, category: str = "activation") -> AllocationEvent:
    return AllocationEvent(
        id=eid,
        size_bytes=size,
        alloc_index=alloc,
        free_index=free,
        category=AllocationCategory(category),
        phase=Phase.forward,
    )


def trace(horizon: int, *events: AllocationEvent) -> AllocationTrace:
    return AllocationTrace(source="dispatch_tracker", horizon=horizon, events=list(events))
