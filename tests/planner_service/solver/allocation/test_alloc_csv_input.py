"""MiniMalloc CSV reading and writing: bad rows are rejected with the line and id named."""

from __future__ import annotations

import pytest

from planner_service.solver.allocation import (
    AllocationInputError,
    Buffer,
    format_minimalloc_csv,
    parse_minimalloc_csv,
    plan_buffers,
)


def test_round_trip_keeps_rows_and_adds_offsets() -> None:
    buffers = parse_minimalloc_csv("id,lower,upper,size\nb1,0,3,4\nb2,3,9,4\n")
    assert buffers == [Buffer("b1", 0, 3, 4), Buffer("b2", 3, 9, 4)]
    text = format_minimalloc_csv(buffers, [0, 0])
    assert text.splitlines() == ["id,lower,upper,size,offset", "b1,0,3,4,0", "b2,3,9,4,0"]
    assert parse_minimalloc_csv(text) == buffers  # the offset column is ignored on input


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ("b2,0,3,0", "line 3 (id b2): size must be positive, got 0"),
        ("b2,0,3,-8", "line 3 (id b2): size must be positive, got -8"),
        ("b2,5,5,8", "line 3 (id b2): upper (5) must be greater than lower (5)"),
        ("b2,6,2,8", "line 3 (id b2): upper (2) must be greater than lower (6)"),
        ("b2,0,3,4.5", "line 3 (id b2): size must be an integer, got '4.5'"),
        ("b2,zero,3,4", "line 3 (id b2): lower must be an integer, got 'zero'"),
        ("b2,0,,4", "line 3 (id b2): upper must be an integer, got ''"),
        ("b1,0,3,4", "line 3 (id b1): id already used on line 2"),
        (",0,3,4", "line 3 (id ?): id is empty"),
    ],
)
def test_bad_row_names_the_line_and_field(row: str, message: str) -> None:
    with pytest.raises(AllocationInputError) as info:
        parse_minimalloc_csv(f"id,lower,upper,size\nb1,0,3,4\n{row}\n")
    assert str(info.value) == message


def test_missing_column_is_named() -> None:
    with pytest.raises(AllocationInputError, match="missing column"):
        parse_minimalloc_csv("id,lower,size\nb1,0,4\n")


def test_plain_buffers_with_bad_fields_are_rejected_before_solving() -> None:
    with pytest.raises(AllocationInputError, match=r"buffer 1 \(id y\): size must be positive"):
        plan_buffers([Buffer("x", 0, 2, 4), Buffer("y", 1, 3, 0)])
    with pytest.raises(AllocationInputError, match=r"buffer 0 \(id x\): size must be an integer"):
        plan_buffers([Buffer("x", 0, 2, 4.0)])  # type: ignore[arg-type]
