"""PLACEHOLDER solver entry point (issue 'Foundation' only) -- replaced by the CP-SAT policy solver.

!!! This is NOT a memory planner. It keeps every chunk persistent and every block's activations,
!!! predicts nothing beyond sums of measured times, and reports status 'unknown'. It exists only so the
!!! service, SDK and CLI can be exercised end to end before the issue 'Cost model and CP-SAT
!!! memory-policy solver' lands.
"""

from __future__ import annotations

import time

from client.contract import (
    ActivationMode,
    BlockPolicy,
    Chunk,
    Constraints,
    Placement,
    Plan,
    Policy,
    Predictions,
    SolverReport,
    SolverStatus,
    Trace,
)

SOLVER_VERSION = "placeholder-0"


def solve(trace: Trace, constraints: Constraints, *, solver: str = "cpsat", seed: int = 0) -> Plan:
    t0 = time.perf_counter()
    params = trace.model.parameters
    total = sum(p.bytes for p in params) or 1
    chunk = Chunk(index=0, placement=Placement.persistent, parameters=[p.name for p in params],
                  blocks=sorted({p.block for p in params}), used_bytes=sum(p.bytes for p in params))
    policy = Policy(chunk_size_bytes=total, chunks=[chunk], n_buffers=0,
                    blocks=[BlockPolicy(block=b.index, module=b.name, mode=ActivationMode.keep) for b in trace.model.blocks])
    m = trace.measurements
    fwd = sum(b.forward_s for b in m.blocks)
    bwd = sum(b.backward_s for b in m.blocks)
    opt = total / m.optimizer.device_bytes_per_s
    return Plan(
        trace_hash=trace.content_hash(),
        constraints=constraints,
        policy=policy,
        predictions=Predictions(iteration_s=fwd + bwd + opt, forward_s=fwd, backward_s=bwd, device_optimizer_s=opt,
                                host_optimizer_s=0.0, peak_device_bytes=m.peak_device_bytes, peak_host_bytes=0),
        solver=SolverReport(solver=f"placeholder(requested {solver})", solver_version=SOLVER_VERSION,
                            status=SolverStatus.unknown, solve_s=time.perf_counter() - t0,
                            message="PLACEHOLDER policy: everything persistent; not a real solve"),
    )
