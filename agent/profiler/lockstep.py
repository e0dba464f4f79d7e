"""The ranks of a group timing their plain iterations together, as their job runs them (issue 20).

In a data-parallel job every rank computes at the same moment: each backward's gradient reductions end it
together, so every forward starts together. The profile's plain iterations (`profiling.py` step 2, what the
per-block times are scaled to) were timed free-running: each rank iterated on its own, beside another rank
that was often in a lighter step of its session. On a node whose ranks share cores or memory bandwidth (two
gloo ranks on two vCPUs of one physical core: session 20 measured a plain forward of 9.2 ms free-running
against 12.8-13.2 ms with both ranks in step) the profile measured a faster machine than the job ran on, and
every 2-rank plan's forward came out 4-7 ms short.

`Lockstep` holds one meeting per plain iteration (the group's barrier, before the iteration's clock starts).
Every rank must meet as often as the others, or a rank waits at a barrier nobody else reaches: `settle()`,
called when a rank's profiling ends however it ends (an error in its warm-up, say), meets the ones it has not
(the error is then told to every rank by `group_profiling`'s exchange of outcomes, as before). A barrier that
fails (a rank gone) leaves no meeting to hold: the group is broken and its next collective says so.
"""

from __future__ import annotations

from collections.abc import Callable

# One meeting per plain iteration: `repeats` at the session's start and, on a CPU device in a job of several
# ranks, `repeats` more after the probes (`profiling.late_plain_iterations`); a rank that times one moment (a
# CUDA device) holds the other's meetings when its profiling ends (`Lockstep.settle`)
PLAIN_MOMENTS_IN_GROUP = 2


def meetings(repeats: int) -> int:
    """The meetings of one profile of `repeats` plain iterations per moment, under a group's barrier."""
    return repeats * PLAIN_MOMENTS_IN_GROUP


class Lockstep:
    """`meetings` meetings at `barrier` (None: a single process, nothing to meet)."""

    def __init__(self, barrier: Callable[[], None] | None, meetings: int) -> None:
        self._barrier = barrier
        self._left = max(meetings, 0) if barrier is not None else 0

    def meet(self) -> None:
        """The next meeting; nothing once every one was held."""
        if self._left <= 0:
            return
        assert self._barrier is not None
        self._left -= 1
        try:
            self._barrier()
        except BaseException:
            self._left = 0
            raise

    def settle(self) -> None:
        """Hold every meeting not held yet (the end of this rank's profiling, however it ended)."""
        for _ in range(self._left):
            self.meet()
