"""Plan: the memory policy and allocation the planner chose for a Trace, with its evidence."""

from __future__ import annotations

from enum import StrEnum
from typing import Literal

from pydantic import Field, model_validator

from client.contract.common import (
    MAX_ALLOCATION_EVENTS,
    MAX_BLOCKS,
    MAX_PARAMETERS,
    SCHEMA_VERSION,
    Bool,
    Bytes,
    ContractModel,
    Float,
    Int,
    Name,
    PositiveBytes,
    Seconds,
    Text,
)
from client.contract.trace import AllocationTrace


class Placement(StrEnum):
    persistent = "persistent"  # parameters, gradients and optimizer state stay on the device
    offloaded = "offloaded"  # fp32 master + optimizer state in pinned host memory, streamed through buffers


class ActivationMode(StrEnum):
    keep = "keep"
    checkpoint = "checkpoint"
    swap = "swap"

    @property
    def letter(self) -> str:
        """The mode's character in a mode strip (`Policy.mode_strip`): K keep, C checkpoint, S swap."""
        return self.value[0].upper()

    @classmethod
    def from_letter(cls, letter: str) -> ActivationMode:
        """The mode a mode strip's character stands for."""
        for mode in cls:
            if mode.letter == letter:
                return mode
        raise ValueError(f"mode strip: {letter!r} is none of K (keep), C (checkpoint), S (swap)")


class SolverStatus(StrEnum):
    optimal = "optimal"
    feasible = "feasible"
    infeasible = "infeasible"
    unknown = "unknown"


class Objective(StrEnum):
    min_iteration_time = "min_iteration_time"


class Constraints(ContractModel):
    """What a plan must respect. Unset host limit: the trace's host memory.

    In a multi-rank job (issue 20) `device_memory_bytes` is one rank's device and `host_memory_bytes` one
    node's host RAM, shared by the node's ranks; `pinned_memory_bytes` is one rank's (process's) limit."""

    device_memory_bytes: PositiveBytes
    host_memory_bytes: PositiveBytes | None = None
    pinned_memory_bytes: PositiveBytes | None = None
    time_limit_s: Float = Field(default=10.0, gt=0.0, le=3600.0)


class Chunk(ContractModel):
    index: Int = Field(ge=0)
    placement: Placement
    parameters: list[Name] = Field(description="parameter names in execution order, packed contiguously")
    blocks: list[Int] = Field(description="blocks whose parameters live in this chunk")
    used_bytes: Bytes = Field(description="bytes of parameters in the chunk (the rest is padding)")
    # Left out of the JSON when false: single-process plans are unchanged (issue 20).
    sharded: Bool = Field(
        default=False,
        exclude_if=lambda v: v is False,
        description="multi-rank jobs: each rank holds 1/world_size of the chunk's state. Persistent (ZeRO-3 on "
        "the device): its shard of the compute copy, fp32 master and optimizer state on the device, the chunk "
        "all-gathered into a device copy before its forward and its backward and released after, the gradient "
        "whole on the device and all-reduced; offloaded (ZeRO-2 on the host): its shard of the host master, "
        "host gradient and optimizer state, the gradient reduce-scattered; false: every rank holds the whole "
        "chunk (replicated, gradient all-reduced on the device; offloaded: then copied to the host and stepped "
        "whole)",
    )


class BlockPolicy(ContractModel):
    block: Int = Field(ge=0, description="index into the trace's `ModelInfo.blocks`")
    module: Name = Field(
        description="the block's module path, copied from the trace, so a plan applies alone"
    )
    mode: ActivationMode


class Policy(ContractModel):
    """The model-state and activation decisions."""

    chunk_size_bytes: PositiveBytes
    chunks: list[Chunk] = Field(max_length=MAX_PARAMETERS)
    n_buffers: Int = Field(ge=0, le=1024, description="device buffers for offloaded chunks")
    blocks: list[BlockPolicy] = Field(max_length=MAX_BLOCKS)
    world_size: Int = Field(
        default=1,
        ge=1,
        le=65_536,
        exclude_if=lambda v: v == 1,
        description="ranks the policy was planned for (the trace's world size); left out when 1",
    )

    @model_validator(mode="after")
    def _sharding(self) -> Policy:
        for i, c in enumerate(self.chunks):
            if c.sharded and self.world_size == 1:
                raise ValueError(f"chunks[{i}].sharded: a single-rank policy (world_size 1) shards nothing")
        return self

    @model_validator(mode="after")
    def _consistent(self) -> Policy:
        for i, c in enumerate(self.chunks):
            if c.index != i:
                raise ValueError(f"chunks[{i}].index: is {c.index}, must equal its position {i}")
            if c.used_bytes > self.chunk_size_bytes:
                raise ValueError(f"chunks[{i}].used_bytes: {c.used_bytes} exceeds chunk_size_bytes")
        for i, b in enumerate(self.blocks):
            if b.block != i:
                raise ValueError(f"blocks[{i}].block: is {b.block}, must equal its position {i}")
        if self.n_buffers == 0 and any(c.placement == Placement.offloaded for c in self.chunks):
            raise ValueError("n_buffers: offloaded chunks need at least one buffer")

        return self

    @property
    def persistent_chunks(self) -> list[Int]:
        return [c.index for c in self.chunks if c.placement == Placement.persistent]

    @property
    def sharded_chunks(self) -> list[Int]:
        return [c.index for c in self.chunks if c.sharded]

    def mode_strip(self) -> str:
        """One character per block: K keep, C checkpoint, S swap."""
        return "".join(b.mode.letter for b in self.blocks)


class BufferOffset(ContractModel):
    id: Int = Field(ge=0, description="`AllocationEvent.id` of the buffer")
    offset_bytes: Bytes


class AllocationPlan(ContractModel):
    arena_bytes: Bytes = Field(description="peak address used: the arena to reserve")
    lower_bound_bytes: Bytes = Field(description="max over time of live bytes: no placement can do better")
    alignment_bytes: PositiveBytes = 512
    offsets: list[BufferOffset] = Field(max_length=MAX_ALLOCATION_EVENTS)
    status: SolverStatus
    solve_s: Seconds
    solver: Name
    iteration: Literal["profiled", "managed"] = Field(
        default="profiled",
        description="whose buffers are placed: 'profiled', the trace's un-managed iteration (what the service "
        "plans at solve time); 'managed', one iteration run under this plan's policy (its offloading, "
        "checkpointing and swap), recorded by the agent and planned after the policy",
    )
    events: AllocationTrace | None = Field(
        default=None,
        description="the allocation events the offsets place (each offset's id is an event id): with them "
        "the plan alone is enough to install the planned allocator, without the trace it was solved from",
    )

    @property
    def gap(self) -> float:
        return 0.0 if self.lower_bound_bytes == 0 else self.arena_bytes / self.lower_bound_bytes - 1.0


class TimelinePoint(ContractModel):
    """Predicted device memory in use at one step of the iteration (for charts and checks)."""

    label: Name = Field(description="e.g. 'fwd layers.3', 'bwd layers.3', 'optimizer'")
    phase: Literal["forward", "backward", "optimizer"]
    device_bytes: Bytes


class Predictions(ContractModel):
    iteration_s: Seconds
    forward_s: Seconds
    backward_s: Seconds
    device_optimizer_s: Seconds
    host_optimizer_s: Seconds
    peak_device_bytes: Bytes
    peak_host_bytes: Bytes
    pinned_host_bytes: Bytes | None = Field(
        default=None,
        description="the page-locked part of peak_host_bytes: offloaded chunks' pinned buffers "
        "(`offloaded_chunk_pinned_bytes`) + swapped activations; the runtime's pinned host arena is this size "
        "(absent from planners before it was counted)",
    )
    breakdown: dict[Name, Float] = Field(default_factory=dict, description="named terms of the cost model")
    device_memory_timeline: list[TimelinePoint] = Field(
        default_factory=list,
        max_length=4 * MAX_BLOCKS + 8,
        description="predicted device bytes in use step by step (empty if the solver gives none)",
    )

    def phases(self) -> dict[str, float]:
        """The iteration by phase as the agent's monitor measures it (`MeasuredPhases`): `forward_s`; `step_s`,
        what optimizer.step() adds (the device steps, speculative host steps redone for clipping, and, from
        policy-1.11, the checks of the exposed gradients not hidden behind the host steps); `backward_s`, the
        rest (backward with the host work that ends in it and the control checks)."""
        b = self.breakdown
        step = (
            self.device_optimizer_s
            + b.get("host_optimizer_redo_s", 0.0)
            + b.get("host_validate_exposed_s", 0.0)
        )
        step = min(step, max(0.0, self.iteration_s - self.forward_s))
        return {
            "forward_s": self.forward_s,
            "backward_s": max(0.0, self.iteration_s - self.forward_s - step),
            "step_s": step,
        }

    @property
    def uploads_per_iteration(self) -> float | None:
        """Chunk uploads per iteration the plan predicts (None: a planner before it was counted)."""
        return self.breakdown.get("uploads_per_iteration")


class SolverReport(ContractModel):
    solver: Name = Field(description="'cpsat', 'protrain', ...")
    solver_version: Name
    status: SolverStatus
    objective: Float | None = Field(default=None, description="predicted iteration seconds of the answer")
    best_bound: Float | None = Field(default=None, description="proven lower bound on the objective")
    gap: Float | None = Field(default=None, ge=0.0, description="(objective - bound) / objective")
    solve_s: Seconds
    min_device_memory_bytes: Bytes | None = Field(
        default=None,
        description="when infeasible: the smallest device memory that would fit (an upper bound "
        "on it when min_device_memory_proven is not true)",
    )
    min_device_memory_proven: Bool | None = Field(
        default=None,
        description="true: min_device_memory_bytes is proven the smallest; false or absent: that "
        "much fits, but a smaller device was not ruled out in the time given",
    )
    message: Text = Field(default="", max_length=4096)

    def min_device_memory_text(self) -> str:
        """'the smallest device memory that fits is N bytes', with 'at most' unless that minimum was proven."""
        if self.min_device_memory_bytes is None:
            return ""
        if self.min_device_memory_proven:
            return f"the smallest device memory that fits is {self.min_device_memory_bytes} bytes"
        return (
            f"the smallest device memory that fits is at most {self.min_device_memory_bytes} bytes "
            "(not proven smallest in the time given)"
        )


class Plan(ContractModel):
    schema_version: Literal[1] = SCHEMA_VERSION
    trace_hash: Name = Field(description="content hash of the Trace this plan was solved for")
    constraints: Constraints
    objective: Objective = Objective.min_iteration_time
    policy: Policy | None = Field(default=None, description="absent when infeasible")
    allocation: AllocationPlan | None = None
    predictions: Predictions | None = None
    solver: SolverReport

    @model_validator(mode="after")
    def _policy_unless_infeasible(self) -> Plan:
        if self.solver.status in (SolverStatus.optimal, SolverStatus.feasible) and self.policy is None:
            raise ValueError("policy: a feasible plan must carry a policy")
        return self


class PlanStatus(StrEnum):
    """Where a plan request is: waiting for a worker, being solved, or one of the final outcomes."""

    queued = "queued"
    running = "running"
    done = "done"
    failed = "failed"
    infeasible = "infeasible"

    @property
    def final(self) -> bool:
        """True when the plan will not change status again (done, failed or infeasible)."""
        return self in FINAL_PLAN_STATUSES

    @property
    def pending(self) -> bool:
        """True while a worker has yet to finish the plan (queued or running)."""
        return not self.final


FINAL_PLAN_STATUSES: frozenset[PlanStatus] = frozenset(
    {PlanStatus.done, PlanStatus.failed, PlanStatus.infeasible}
)
PENDING_PLAN_STATUSES: frozenset[PlanStatus] = frozenset({PlanStatus.queued, PlanStatus.running})
