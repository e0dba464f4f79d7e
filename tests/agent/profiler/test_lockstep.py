"""`Lockstep`: every rank meets the group's barrier as often as the others, however its profiling ends."""

from __future__ import annotations

import pytest

from agent.profiler.lockstep import Lockstep


def test_a_rank_meets_every_barrier_even_when_its_profiling_ended_early() -> None:
    calls: list[int] = []
    steps = Lockstep(lambda: calls.append(1), 3)
    steps.meet()
    steps.settle()  # an error after the first plain iteration: the two left are still met
    steps.settle()
    steps.meet()
    assert len(calls) == 3


def test_a_failed_barrier_leaves_no_meeting_to_hold() -> None:
    calls: list[int] = []

    def broken() -> None:
        calls.append(1)
        raise RuntimeError("a rank is gone")

    steps = Lockstep(broken, 3)
    with pytest.raises(RuntimeError, match="a rank is gone"):
        steps.meet()
    steps.settle()  # the group is broken: waiting at it again would only fail (or hang) again
    assert len(calls) == 1


def test_a_single_process_meets_nobody() -> None:
    steps = Lockstep(None, 3)
    steps.meet()
    steps.settle()
