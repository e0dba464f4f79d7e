"""The profile's plain iterations at two moments in a CPU job of several ranks (`late_plain_iterations`): every
meeting of the group's barrier starts a plain iteration, and the trace's iteration is the median over both
moments; a single process keeps its one moment (and a rank that does not time the late ones still meets)."""

from __future__ import annotations

import pytest
import torch

from agent.profiler import profile
from agent.profiler.lockstep import PLAIN_MOMENTS_IN_GROUP
from agent.profiler.profiling import late_plain_iterations
from agent.profiler.session import TrainingStep
from agent.testing.model_zoo import build, sample_batch
from client.contract import Hardware
from planner_service.solver.testing.synthetic import synthetic_distributed

REPEATS = 2
SLOW_S = 10.0  # added to each plain iteration timed after the first moment's: unmistakable in the median


class Meetings:
    """The group's barrier in one process: counts its meetings and marks the next `timed` call as the plain
    iteration that meeting starts."""

    def __init__(self) -> None:
        self.held = 0
        self.pending: int | None = None  # the meeting whose plain iteration has not been timed yet
        self.plain: list[int] = []  # per plain iteration timed: the meeting that started it

    def __call__(self) -> None:
        self.held += 1
        self.pending = self.held


@pytest.fixture
def meetings(monkeypatch: pytest.MonkeyPatch) -> Meetings:
    met = Meetings()
    real = TrainingStep.timed

    def timed(self: TrainingStep, clock: object) -> tuple[float, float, float]:
        total, step_s, zero_s = real(self, clock)  # type: ignore[arg-type]
        if met.pending is None:
            return total, step_s, zero_s  # not a plain iteration (a probe's managed one)
        met.plain.append(met.pending)
        late = met.pending > REPEATS
        met.pending = None
        return total + (SLOW_S if late else 0.0), step_s, zero_s

    monkeypatch.setattr(TrainingStep, "timed", timed)
    return met


def _profile(hardware: Hardware, meetings: Meetings, world_size: int) -> float:
    torch.manual_seed(0)
    model, config = build("gpt2", layers=2, hidden=32, vocab=128, seq=16)
    trace = profile(
        model,
        sample_batch(config, 2, 16),
        hardware=hardware,
        repeats=REPEATS,
        allocation_trace=False,
        distributed=synthetic_distributed(world_size, world_size),
        lockstep=meetings,
    )
    return trace.measurements.iteration_s


def test_a_cpu_job_of_two_ranks_times_its_plain_iterations_again_after_the_probes(
    cpu_hardware: Hardware, meetings: Meetings
) -> None:
    iteration_s = _profile(cpu_hardware, meetings, world_size=2)
    assert meetings.held == REPEATS * PLAIN_MOMENTS_IN_GROUP
    assert meetings.plain == list(range(1, meetings.held + 1))  # every meeting started a plain iteration
    # the median of 2 quick and 2 slow iterations: half-way, so neither moment alone decides it
    assert SLOW_S / 2 < iteration_s < SLOW_S


def test_a_single_process_profile_keeps_one_moment_and_still_holds_every_meeting(
    cpu_hardware: Hardware, meetings: Meetings
) -> None:
    iteration_s = _profile(cpu_hardware, meetings, world_size=1)
    assert meetings.plain == list(range(1, REPEATS + 1))
    assert meetings.held == REPEATS * PLAIN_MOMENTS_IN_GROUP  # the late ones' meetings, held at the end
    assert iteration_s < 1.0


def test_the_second_moment_is_for_cpu_jobs_of_several_ranks_only() -> None:
    assert late_plain_iterations(torch.device("cpu"), 2)
    assert not late_plain_iterations(torch.device("cpu"), 1)
    assert not late_plain_iterations(torch.device("cuda", 0), 4)
