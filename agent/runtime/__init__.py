"""Agent runtime: applies a plan's model-state policy (chunks, offload, host optimizer) to a training job.

Modules, each with one job: `layout` (plan -> parameter offsets, checked against the model), `chunks`
(chunk memory), `buffers` (device buffer pool), `schedule` (recorded access order, prefetch, eviction),
`device` (streams and events; no-ops on CPU), `host_worker` (host optimizer thread), `optimizer`
(the user's optimizer) with `stepper` (one per chunk), `manager` (hooks, lifecycle; wires `residency`,
`gradients`, `saved_tensors`, `host_steps`), `phase`, `timing` (the timing hook), `accounting` (bytes held),
`manual` (hand-built plans), `node_shared` (sharded chunks' compute copies shared by the ranks of a node),
`activations` (per-block keep/checkpoint/swap) with `swap` (saved tensors to host memory and back, one block
ahead), `module_buffers` (a model's buffers put back after profiling and a checkpointed block's recompute).
"""

from agent.runtime.accounting import Counters, MemoryReport, RuntimeReport
from agent.runtime.layout import ChunkLayout, PlanMismatchError
from agent.runtime.manual import manual_plan, manual_policy
from agent.runtime.optimizer import ChunkedOptimizer, UnsupportedOptimizerError
from agent.runtime.options import RuntimeOptions

__all__ = [
    "ChunkLayout",
    "ChunkedOptimizer",
    "Counters",
    "MemoryReport",
    "PlanMismatchError",
    "RuntimeOptions",
    "RuntimeReport",
    "UnsupportedOptimizerError",
    "manual_plan",
    "manual_policy",
]
