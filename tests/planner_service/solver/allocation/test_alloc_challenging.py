"""MiniMalloc's challenging instances A-F (../shared): every one placed within capacity 1048576.

minimize=False: the question is MiniMalloc's (fit the capacity), so the solve stops at the first fit."""

from __future__ import annotations

import pytest

from planner_service.solver.allocation import plan_buffers, read_minimalloc_csv, validate_placement
from tests.planner_service.solver.allocation.conftest import minimalloc_file

CAPACITY = 1048576


@pytest.mark.slow
@pytest.mark.parametrize("name", list("ABCDEF"))
def test_challenging_instance_fits_capacity(name: str) -> None:
    buffers = read_minimalloc_csv(minimalloc_file(f"{name}.1048576.csv"))
    plan = plan_buffers(buffers, capacity_bytes=CAPACITY, time_limit_s=60.0, minimize=False)
    assert plan.status.value in ("optimal", "feasible"), plan.log
    validate_placement(buffers, plan.offsets, capacity=CAPACITY)
    assert plan.arena_bytes <= CAPACITY
