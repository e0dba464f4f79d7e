"""Profiling a multi-rank job on every rank at once (issue 20).

Under a process group `agent.wrap` obtains one plan for the job on rank 0 and broadcasts it. The trace it solves
used to be rank 0's alone, profiled while the other ranks waited for the plan: on a node whose ranks share
resources (CPU cores for gloo jobs; PCIe and host-memory bandwidth, and the cores that run host optimizers, on
GPUs) that trace measured an idle machine, and the job, whose ranks all train at once, ran about twice as slow
as predicted (docs/BENCHMARKS.md, "Multi-rank: 2 gloo ranks through agent.wrap").

Now every rank profiles its own model on its own batch at the same time, through the same code
(`planning.profile_job`), so each measures the machine as loaded by the job itself:
1. rank 0, having found no plan in the service's history, broadcasts `ProfileEveryRank` in the place of the plan
   the other ranks wait for (a history hit is broadcast as the plan, and nobody profiles);
2. every rank measures its hardware where it has not yet (cached per process), then every rank profiles, all
   starting together (the exchange of step 3 after the hardware, so no rank profiles beside another's copy
   bandwidth probe, or alone while the others wait); the profiler's one collective is the group's barrier
   before each plain iteration, so the ranks time them in step, every rank computing at once as in the job
   (`profiler/lockstep.py`; a rank whose profiling failed still meets every barrier); the collectives were
   measured before, on every rank, by `collectives.probe_for_planning`; the runtime probes inside profiling
   run one process with no group;
3. every rank gathers every rank's outcome (its profiled iteration, or its error): a failure on any rank is then
   known to all, and every rank raises `RankProfilingError` naming the ranks and their errors, with no further
   collective (rank 0 does not broadcast it again: no rank waits for it);
4. the job's trace is the one of the rank with the largest batch (most rows x sequence length, then the longer
   sequence), and among equal batches the slowest rank's (largest profiled iteration; the lowest rank on a
   tie), sent to rank 0 when it is another rank's. Every rank runs the plan, so its activation memory must
   be budgeted for the largest batch any rank profiled (a padding collator pads each rank's first batch to
   its own longest example; before, the slowest rank's trace could be a shorter batch's, and the rank with
   the longer one ran past the plan's memory). A data-parallel step ends when its slowest rank's does (the
   gradient average waits for it), so among equal batches the slowest rank's iteration is the job's; its
   trace is taken whole, not block by block (a per-block maximum would mix samples of different iterations
   and add up every block's noise, and the trace's blocks, probes and memory stay one measurement). Rank 0
   then solves it or sends it to the service.

`agent.profile(process_group=...)` (and `memplan profile --process-group`) runs the same steps 2-4 with no plan
to wait for (every rank called it): nothing is announced, and every rank returns the job's trace.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from agent.runtime.process_group import batch_order

if TYPE_CHECKING:
    from agent.runtime.process_group import RankGroup
    from client.contract import Trace

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProfileEveryRank:
    """Rank 0's word to the ranks waiting for the plan: there is none yet; profile now, every rank at once."""


class RankProfilingError(RuntimeError):
    """Profiling failed on one rank or more; every rank of the group raises it (each learnt it from the
    exchange of outcomes), so it is not broadcast again."""


@dataclass(frozen=True)
class GroupTrace:
    """The job's trace (the largest batch's, then the slowest rank's: step 4 above), every rank's profiled
    iteration in rank order, and the rank whose trace it is."""

    trace: Trace
    iteration_s: tuple[float, ...]
    rank: int


def profile_on_every_rank(
    group: RankGroup,
    run: Callable[[Callable[[], None]], Trace],
    meetings: int,
    prepare: Callable[[], object] | None = None,
    *,
    every_rank: bool = False,
) -> GroupTrace | None:
    """Profile this rank's model (`run`, given the group's barrier for its plain iterations' lockstep) together
    with every other rank; the job's trace on rank 0, None on the others. `meetings`: how often the profile `run`
    makes meets the barrier (`profiler.lockstep.meetings(repeats)`): a rank whose `run` ends early, however
    (an error before its profile started, say), holds the rest before telling the others, so no rank waits at
    a barrier nobody else reaches. Rank 0 calls it instead of profiling alone, which first tells the waiting
    ranks to profile; the others call it when they receive `ProfileEveryRank`. `prepare`: what each rank does
    before the ranks start profiling together (the hardware probe, cached per process: rank 0 has it from the
    history look-up, and a rank that has none measures it here, not while the others profile). Raises `RankProfilingError` on every
    rank when any rank's `prepare` or `run` raised. `every_rank` (`agent.profile(process_group=)`: every rank
    called it, none waits for a plan): nothing is announced, and every rank gets the job's trace."""
    if group.is_main and not every_rank:
        group.broadcast_object(ProfileEveryRank())
    failure: Exception | None = None
    try:
        if prepare is not None:
            prepare()
    except Exception as exc:  # noqa: BLE001 - every rank must learn of it before anyone raises
        failure = exc
    _exchange(group, None, failure)  # also the start line: every rank is ready, all profile at once
    started = time.perf_counter()
    trace: Trace | None = None
    # local import: agent.profiler's package imports this module (profiling's group path) before it has lockstep
    from agent.profiler.lockstep import Lockstep

    steps = Lockstep(group.barrier, meetings)
    try:
        trace = run(steps.meet)  # the ranks time their plain iterations in step (profiler/lockstep.py)
    except Exception as exc:  # noqa: BLE001 - every rank must learn of it before anyone raises
        failure = exc
    finally:
        steps.settle()
    outcomes = _exchange(group, _outcome(trace) if trace is not None else None, failure)
    assert trace is not None
    times = tuple(float(o[0]) if o else 0.0 for o in outcomes)
    batches = [batch_order((o[1], o[2])) if o else (0, 0) for o in outcomes]
    chosen = max(range(group.world_size), key=lambda r: (batches[r], times[r], -r))
    log.info(
        "memplan: rank %d profiled its model in %.2f s (iteration %.4f s); ranks' iterations %s s, the job's "
        "trace is rank %d's%s",
        group.rank,
        time.perf_counter() - started,
        trace.measurements.iteration_s,
        ", ".join(f"{t:.4f}" for t in times),
        chosen,
        (
            f" (its batch is the largest; the ranks' batches (rows x sequence): "
            f"{', '.join(f'{o[1]}x{o[2]}' for o in outcomes if o)})"
            if len(set(batches)) > 1
            else ""
        ),
    )
    job_trace: Trace | None = trace
    if chosen != 0 or every_rank:  # rank 0 solves (or uploads) the job's trace: the chosen rank sends it
        job_trace = group.broadcast_object(trace if group.rank == chosen else None, src=chosen)
    if not group.is_main and not every_rank:
        return None
    assert job_trace is not None
    return GroupTrace(trace=job_trace, iteration_s=times, rank=chosen)


def _outcome(trace: Trace) -> tuple[float, int, int]:
    """What a rank tells the others of its profile: its iteration, and its batch's rows and sequence length."""
    w = trace.workload
    return trace.measurements.iteration_s, w.batch_size, w.sequence_length


def _exchange(group: RankGroup, outcome: Any, failure: Exception | None) -> list[Any]:
    """Every rank's outcome of one step (this rank's `outcome`, or its `failure`), rank order; raises
    `RankProfilingError` on every rank when any rank failed."""
    mine: float | str | None = f"{type(failure).__name__}: {failure}" if failure is not None else outcome
    outcomes = group.all_gather_object(mine)
    failed = {r: o for r, o in enumerate(outcomes) if isinstance(o, str)}
    if failed:
        why = "; ".join(f"rank {r}: {o}" for r, o in failed.items())
        raise RankProfilingError(
            f"memplan: profiling the job failed on {len(failed)} of {group.world_size} ranks ({why})"
        ) from failure
    return outcomes
