"""Distributed jobs: the process group a trace was measured in, its interconnect and its collectives (issue 20).

A multi-rank job is profiled on its own process group (every rank at once; the trace is the slowest rank's): `Hardware.distributed` says the world
size, how many ranks share a node (and so the node's host RAM) and what the collectives measured on that group
achieve. A single-process trace leaves it out (and keeps its content hash and hardware key).

Collective figures use *algorithm* bandwidth of the whole tensor, the quantity the cost model divides by:
- all-gather: `size_bytes` is the gathered (output) tensor, N shards of size_bytes / N; time = size / rate.
- reduce-scatter: `size_bytes` is the full (input) tensor each rank contributes; each rank keeps size / N.
- all-reduce (optional): `size_bytes` is the whole tensor every rank contributes and receives.
- control (optional): the seconds of one tiny collective, the latency the runtime's per-iteration checks pay.

How the agent times them (`agent/profiler/collectives.py`): on a CPU device each call after a burst of compute,
as a training step issues them (gloo and the compute share the cores); on a GPU back to back.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Literal

from pydantic import Field, model_validator

from client.contract.common import (
    MAX_BANDWIDTH_SAMPLES,
    BytesPerSecond,
    ContractModel,
    Int,
    Name,
    PositiveBytes,
    Seconds,
)

MAX_WORLD_SIZE = 65_536
IN_STEP_BURST_S = 0.005
"""The compute before each collective the profiler times in step on a CPU device (the in-step curves and
`CollectiveCurves.control_s`): about one block's backward of the development machine's 4-layer models. The
phase-end check (`phase_control_s`) is timed after four such bursts. The cost model reads it to price the wait
for the later rank after longer compute (`planner_service.solver.sharding.reduction_wait_ns`)."""
MAX_OVERLAP_SAMPLES = 8


class CollectiveBackend(StrEnum):
    """The `torch.distributed` backend of the process group."""

    gloo = "gloo"
    nccl = "nccl"
    mpi = "mpi"
    ucc = "ucc"


class Interconnect(ContractModel):
    """How the ranks of the job reach each other: the process group's backend and the links it runs over."""

    backend: CollectiveBackend
    intra_node: Name = Field(
        description="link between ranks of one node, e.g. 'nvlink', 'pcie', 'shared-memory' (gloo, one host)"
    )
    inter_node: Name | None = Field(
        default=None,
        description="link between nodes, e.g. 'infiniband', 'ethernet'; absent for a single-node job",
    )


class CollectiveSample(ContractModel):
    """One measured collective on a tensor of `size_bytes` (the whole tensor: see the module docstring),
    median of repetitions: `bytes_per_s` = size_bytes / seconds."""

    size_bytes: PositiveBytes
    bytes_per_s: BytesPerSecond


class CollectiveCopyOverlap(ContractModel):
    """A collective alone, a host<->device copy alone, and both started together, on the job's group.

    `factor` reads how much of the shorter one hides behind the longer: 1 = fully concurrent (both together
    take the longer one's time), 0 = serialised (they take the sum)."""

    collective: Literal["all_gather", "reduce_scatter"]
    direction: Literal["h2d", "d2h"] = Field(description="the copy's direction")
    collective_bytes: PositiveBytes = Field(description="size of the collective's whole tensor")
    copy_bytes: PositiveBytes
    collective_s: Seconds = Field(gt=0.0, description="the collective alone, median seconds")
    copy_s: Seconds = Field(gt=0.0, description="the copy alone, median seconds")
    concurrent_s: Seconds = Field(gt=0.0, description="both started together, until both are done")

    @property
    def factor(self) -> float:
        """(alone + alone - together) / shorter, clamped to [0, 1] (measurement noise can leave it)."""
        shorter = min(self.collective_s, self.copy_s)
        hidden = self.collective_s + self.copy_s - self.concurrent_s
        return min(1.0, max(0.0, hidden / shorter))


class CollectiveCurves(ContractModel):
    """Collective bandwidth by tensor size on the job's group; each curve sorted by size, sizes unique."""

    all_gather: list[CollectiveSample] = Field(min_length=1, max_length=MAX_BANDWIDTH_SAMPLES)
    reduce_scatter: list[CollectiveSample] = Field(min_length=1, max_length=MAX_BANDWIDTH_SAMPLES)
    copy_overlap: list[CollectiveCopyOverlap] = Field(
        default_factory=list,
        max_length=MAX_OVERLAP_SAMPLES,
        description="collectives measured beside host<->device copies; at most one per (collective, direction)",
    )
    # Left out of the JSON when empty (traces from before it keep their content hashes).
    all_reduce: list[CollectiveSample] = Field(
        default_factory=list,
        max_length=MAX_BANDWIDTH_SAMPLES,
        exclude_if=lambda v: not v,
        description="all-reduce (the gradient average of a replicated chunk), `size_bytes` the whole tensor; "
        "empty (older traces): the cost model reads it as a reduce-scatter plus an all-gather",
    )
    # Left out of the JSON when 0 (traces from before it keep their content hashes).
    control_s: Seconds = Field(
        default=0.0,
        exclude_if=lambda v: v == 0.0,
        description="one tiny collective (an all-gather of two int32 per rank), timed as the runtime's control "
        "checks issue them: the same-use check at each backward's start, the persistent chunks' union at its "
        "end, the device-shard agreements, the barrier at step(); mean seconds per call; 0 = not measured "
        "(older traces: the cost model reads the smallest all-gather sample's time instead)",
    )
    # Left out of the JSON when 0 (traces from before it keep their content hashes).
    phase_control_s: Seconds = Field(
        default=0.0,
        exclude_if=lambda v: v == 0.0,
        description="the same tiny collective timed after a compute span as long as a training phase (forward or "
        "backward) on a CPU device, where its time includes the wait for the rank that arrives later, which grows "
        "with the compute before it: what the checks at a phase's end pay (the same-use check at backward's start, "
        "the agreement on the entries with a gradient at its end, the device-shard agreements at the ends of forward and backward); 0 = not "
        "measured (a GPU, older traces: `control_s` prices them)",
    )

    @model_validator(mode="after")
    def _sorted_unique(self) -> CollectiveCurves:
        for name in ("all_gather", "reduce_scatter", "all_reduce"):
            sizes = [s.size_bytes for s in getattr(self, name)]
            if sizes != sorted(set(sizes)):
                raise ValueError(f"{name}: samples must be sorted by size_bytes with no repeated size")
        seen: set[tuple[str, str]] = set()
        for i, o in enumerate(self.copy_overlap):
            if (o.collective, o.direction) in seen:
                raise ValueError(f"copy_overlap[{i}]: ({o.collective}, {o.direction}) appears twice")
            seen.add((o.collective, o.direction))
        return self

    def overlap_factor(
        self, collective: Literal["all_gather", "reduce_scatter"], direction: Literal["h2d", "d2h"]
    ) -> float:
        """The measured factor for the pair; 0.0 (serialised, the cautious reading) when not measured."""
        for o in self.copy_overlap:
            if o.collective == collective and o.direction == direction:
                return o.factor
        return 0.0


class Distributed(ContractModel):
    """The process group of a multi-rank job, as rank 0 measured it."""

    world_size: Int = Field(default=1, ge=1, le=MAX_WORLD_SIZE, description="ranks in the job's group")
    ranks_per_node: Int = Field(
        default=1,
        ge=1,
        le=MAX_WORLD_SIZE,
        description="ranks sharing one node (and its host RAM); divides world_size",
    )
    interconnect: Interconnect | None = Field(
        default=None, description="backend and links; required when world_size > 1"
    )
    collectives: CollectiveCurves | None = Field(
        default=None, description="measured on the job's group; required when world_size > 1"
    )

    @model_validator(mode="after")
    def _consistent(self) -> Distributed:
        if self.ranks_per_node > self.world_size:
            raise ValueError(
                f"ranks_per_node: {self.ranks_per_node} is more than world_size {self.world_size}"
            )
        if self.world_size % self.ranks_per_node:
            raise ValueError(
                f"ranks_per_node: {self.ranks_per_node} does not divide world_size {self.world_size}"
            )
        if self.world_size > 1:
            if self.interconnect is None:
                raise ValueError("interconnect: required when world_size > 1")
            if self.collectives is None:
                raise ValueError("collectives: required when world_size > 1 (the plan times them)")
        return self

    @property
    def nodes(self) -> int:
        return self.world_size // self.ranks_per_node
