"""The wire contract: the one definition of Trace (schema 2), Plan and Feedback (schema 1), shared by agent and
service."""

from client.contract.api import (
    ErrorBody,
    FeedbackRecord,
    HardwareSummary,
    ModelSummary,
    Page,
    PlanHeadline,
    PlanRecord,
    PlanRequest,
    TraceCreated,
    TraceRecord,
    TraceSummary,
)
from client.contract.chunk_bytes import (
    PARAMETER_ALIGN_BYTES,
    SHARD_ALIGN_ELEMENTS,
    compute_copy_shared,
    offloaded_chunk_pinned_bytes,
    parameter_slot_bytes,
    shard_elements,
    sharded_chunk_pinned_bytes,
)
from client.contract.common import SCHEMA_VERSION, TRACE_SCHEMA_VERSION, ContractModel
from client.contract.distributed import (
    IN_STEP_BURST_S,
    CollectiveBackend,
    CollectiveCopyOverlap,
    CollectiveCurves,
    CollectiveSample,
    Distributed,
    Interconnect,
)
from client.contract.feedback import Feedback, MeasuredPhases
from client.contract.hardware import (
    CatalogEntry,
    DenseThroughput,
    HardwareCatalog,
    HostLink,
    LinkKind,
    PeerLink,
)
from client.contract.plan import (
    FINAL_PLAN_STATUSES,
    PENDING_PLAN_STATUSES,
    ActivationMode,
    AllocationPlan,
    BlockPolicy,
    BufferOffset,
    Chunk,
    Constraints,
    Objective,
    Placement,
    Plan,
    PlanStatus,
    Policy,
    Predictions,
    SolverReport,
    SolverStatus,
    TimelinePoint,
)
from client.contract.trace import (
    AllocationCategory,
    AllocationColumns,
    AllocationEvent,
    AllocationTrace,
    BandwidthCurves,
    BandwidthSample,
    BlockInfo,
    BlockKind,
    BlockMeasurement,
    DeviceType,
    EventArrays,
    Hardware,
    Measurements,
    ModelInfo,
    ModelledFrom,
    OptimizerKind,
    OptimizerMeasurement,
    ParameterInfo,
    Phase,
    Precision,
    Software,
    Trace,
    Workload,
)
from client.contract.whatif import (
    SweepPoint,
    SweepProgress,
    SweepRecord,
    SweepRequest,
    WhatIfAnswer,
    WhatIfRequest,
    WhatIfResponse,
)

__all__ = [name for name in dir() if not name.startswith("_")]
