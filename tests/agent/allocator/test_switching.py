"""Choosing the allocator: the late-switch refusal, `select` on CPU, and plans that do not fit their trace."""

from __future__ import annotations

import pytest
import torch

from agent.allocator import (
    AllocatorSwitchError,
    PlanReplayError,
    check_can_install,
    install_cuda_planned_allocator,
    plan_slots,
    select,
)
from client.contract import AllocationPlan, BufferOffset, Constraints, Plan, SolverReport, SolverStatus
from tests.agent.allocator.conftest import event, plan_for


def test_a_late_switch_is_refused_once_cuda_is_initialised() -> None:
    with pytest.raises(
        AllocatorSwitchError, match=r"before the first CUDA allocation.*torch.cuda.is_initialized"
    ):
        check_can_install(cuda_available=True, cuda_initialized=True, already_installed=False)


def test_a_second_install_is_refused() -> None:
    with pytest.raises(AllocatorSwitchError, match="already installed"):
        check_can_install(cuda_available=True, cuda_initialized=False, already_installed=True)


def test_an_early_install_with_cuda_present_is_allowed() -> None:
    check_can_install(cuda_available=True, cuda_initialized=False, already_installed=False)


@pytest.mark.skipif(torch.cuda.is_available(), reason="would really swap this process's CUDA allocator")
def test_installing_without_cuda_fails_with_a_clear_error(three_buffers) -> None:
    evs, plan = three_buffers
    with pytest.raises(AllocatorSwitchError, match=r"torch.cuda.is_available\(\) is False"):
        install_cuda_planned_allocator(plan, evs)


def _plan(allocation: AllocationPlan | None) -> Plan:
    return Plan(
        trace_hash="t",
        constraints=Constraints(device_memory_bytes=1 << 30),
        allocation=allocation,
        solver=SolverReport(solver="hand", solver_version="0", status=SolverStatus.infeasible, solve_s=0.0),
    )


def test_select_caching_changes_nothing() -> None:
    sel = select("caching")
    assert (sel.mode, sel.allocator, sel.stats()) == ("caching", None, None)


def test_select_planned_on_cpu_keeps_pytorchs_allocator_and_says_why(three_buffers) -> None:
    evs, alloc = three_buffers
    sel = select("planned", _plan(alloc), evs, device="cpu")
    assert (sel.requested, sel.mode, sel.allocator) == ("planned", "caching", None)
    assert "no pluggable allocator" in sel.reason


def test_select_rejects_an_unknown_mode_and_a_plan_without_allocation(three_buffers) -> None:
    evs, _ = three_buffers
    with pytest.raises(ValueError, match="allocation: must be one of planned, caching"):
        select("expandable")
    with pytest.raises(ValueError, match="plan.allocation"):
        select("planned", _plan(None), evs, device="cpu")
    with pytest.raises(ValueError, match="events"):
        select("planned", _plan(plan_for(evs, {0: 0, 1: 1024, 2: 0})), None, device="cpu")


def test_a_plan_that_does_not_fit_its_trace_names_the_field() -> None:
    evs = [event(0, 1000, 0, 2), event(1, 600, 1, 3)]
    good = plan_for(evs, {0: 0, 1: 1024})
    missing = good.model_copy(update={"offsets": good.offsets[:1]})
    with pytest.raises(PlanReplayError, match="no offset for allocation_trace event id 1"):
        plan_slots(missing, evs)
    unaligned = good.model_copy(
        update={"offsets": [BufferOffset(id=0, offset_bytes=0), BufferOffset(id=1, offset_bytes=1000)]}
    )
    with pytest.raises(
        PlanReplayError, match=r"allocation.offsets \(id 1\).offset_bytes: 1000 is not a multiple of 512"
    ):
        plan_slots(unaligned, evs)
    beyond = good.model_copy(update={"arena_bytes": 1024})
    with pytest.raises(PlanReplayError, match="beyond arena_bytes 1024"):
        plan_slots(beyond, evs)
    twice = good.model_copy(update={"offsets": [*good.offsets, BufferOffset(id=1, offset_bytes=0)]})
    with pytest.raises(PlanReplayError, match=r"allocation.offsets\[2\].id: 1 appears twice"):
        plan_slots(twice, evs)
    stranger = good.model_copy(update={"offsets": [*good.offsets, BufferOffset(id=9, offset_bytes=0)]})
    with pytest.raises(PlanReplayError, match=r"offsets\[2\].id: 9 names no allocation_trace event"):
        plan_slots(stranger, evs)
    infeasible = good.model_copy(update={"status": SolverStatus.infeasible})
    with pytest.raises(PlanReplayError, match="allocation.status"):
        plan_slots(infeasible, evs)
