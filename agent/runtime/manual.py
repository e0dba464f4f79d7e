"""Hand-built plans: chunk a model's parameters in `named_parameters()` order, without solving anything.

For tests, benchmarks and users who want to choose placements themselves. The result is a wire-contract
Plan whose solver report says plainly that it was built by hand (status `unknown`), so it is never
mistaken for a solved plan. `named_parameters()` order is close to, but not exactly, execution order;
the runtime learns the real access order in the first iteration, so the layout stays correct either way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from agent.runtime.device import element_size
from client.contract import (
    Chunk,
    Constraints,
    Placement,
    Plan,
    Policy,
    SolverReport,
    SolverStatus,
    parameter_slot_bytes,
)

PlacementRule = Callable[[int, int], Placement]  # (chunk index, chunk count) -> placement


def manual_policy(
    model: nn.Module,
    *,
    chunk_size_bytes: int,
    offload: str | Sequence[int] | PlacementRule = "none",
    n_buffers: int = 2,
    compute_dtype: torch.dtype | None = None,
) -> Policy:
    """Greedy packing of parameters into chunks; `offload` is "none", "all", chunk indices, or a rule.

    Each parameter takes its aligned slot (`client.contract.parameter_slot_bytes`), as in the runtime."""
    params = list(model.named_parameters())
    if not params:
        raise ValueError("model: has no parameters to chunk")
    dtype = compute_dtype or params[0][1].dtype
    esize = element_size(dtype)
    groups: list[list[tuple[str, int]]] = [[]]
    used = 0
    for name, p in params:
        nbytes = parameter_slot_bytes(p.numel(), esize)  # 16-byte aligned, as the runtime lays it out
        if nbytes > chunk_size_bytes:
            raise ValueError(
                f"chunk_size_bytes: {chunk_size_bytes} is smaller than parameter {name!r} ({nbytes} bytes)"
            )
        if used + nbytes > chunk_size_bytes:
            groups.append([])
            used = 0
        groups[-1].append((name, nbytes))
        used += nbytes
    n = len(groups)

    def placement(i: int) -> Placement:
        if offload == "none":
            return Placement.persistent
        if offload == "all":
            return Placement.offloaded
        if isinstance(offload, str):
            raise ValueError(f"offload: {offload!r} is not 'none', 'all', a list of chunk indices or a rule")
        if callable(offload):
            return offload(i, n)
        return Placement.offloaded if i in set(offload) else Placement.persistent

    chunks = [
        Chunk(
            index=i,
            placement=placement(i),
            parameters=[name for name, _ in g],
            blocks=[],
            used_bytes=sum(b for _, b in g),
        )
        for i, g in enumerate(groups)
    ]
    has_offload = any(c.placement == Placement.offloaded for c in chunks)
    return Policy(
        chunk_size_bytes=chunk_size_bytes, chunks=chunks, n_buffers=n_buffers if has_offload else 0, blocks=[]
    )


def manual_plan(model: nn.Module, *, device_memory_bytes: int = 2**40, **policy_args: object) -> Plan:
    """A Plan around `manual_policy(model, **policy_args)`; nothing in it was predicted or solved."""
    policy = manual_policy(model, **policy_args)  # type: ignore[arg-type]
    return Plan(
        trace_hash="manual",
        constraints=Constraints(device_memory_bytes=device_memory_bytes),
        policy=policy,
        solver=SolverReport(
            solver="manual",
            solver_version="0",
            status=SolverStatus.unknown,
            solve_s=0.0,
            message="hand-built plan (agent.runtime.manual): not solved, no predictions",
        ),
    )
