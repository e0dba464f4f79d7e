"""The placement validator catches overlaps (naming both buffers and the time), capacity and alignment."""

from __future__ import annotations

import pytest

from planner_service.solver.allocation import AllocationValidationError, Buffer, validate_placement

A = Buffer("a", 0, 10, 100)
B = Buffer("b", 5, 15, 50)


def test_overlap_names_both_buffers_and_the_time() -> None:
    with pytest.raises(AllocationValidationError) as info:
        validate_placement([A, B], [0, 80])
    assert str(info.value) == "buffers a and b overlap at time 5: addresses [0, 100) and [80, 130)"


def test_overlap_found_among_many_buffers() -> None:
    buffers = [Buffer(f"x{i}", i, i + 3, 10) for i in range(50)]
    offsets = [(i % 3) * 10 for i in range(50)]  # valid: three live at once, three slots
    validate_placement(buffers, offsets)
    offsets[40] = offsets[39]  # x39 lives over [39, 42): clash from time 40, when x40 arrives
    with pytest.raises(AllocationValidationError, match=r"buffers x39 and x40 overlap at time 40"):
        validate_placement(buffers, offsets)


def test_buffer_inside_another_is_an_overlap() -> None:
    with pytest.raises(AllocationValidationError, match="overlap"):
        validate_placement([A, Buffer("inner", 2, 4, 10)], [0, 40])


def test_touching_lifetimes_may_share_addresses() -> None:
    validate_placement([Buffer("a", 0, 5, 10), Buffer("b", 5, 9, 10)], [0, 0])


def test_same_time_disjoint_addresses_are_valid() -> None:
    validate_placement([A, B], [0, 100])


def test_capacity_is_enforced() -> None:
    with pytest.raises(AllocationValidationError, match="buffer b: ends at 150 bytes, beyond capacity 120"):
        validate_placement([A, B], [0, 100], capacity=120)


def test_alignment_is_enforced() -> None:
    with pytest.raises(
        AllocationValidationError, match="buffer b: offset 100 is not a multiple of alignment 64"
    ):
        validate_placement([A, B], [0, 100], alignment=64)


def test_negative_offset_and_count_mismatch_are_rejected() -> None:
    with pytest.raises(AllocationValidationError, match="negative"):
        validate_placement([A], [-1])
    with pytest.raises(AllocationValidationError, match="1 given for 2 buffers"):
        validate_placement([A, B], [0])
