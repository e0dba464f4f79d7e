"""Optimizer facts: its kind and per-parameter state, and measured step throughput on device and host.

Device throughput is the real optimizer's `step()` timed inside the profiler's plain iterations
(parameter bytes stepped / seconds). Host throughput is a fused AdamW (`fused=True`, falling back to
`foreach=True` where this build has no fused CPU kernel) stepping host fp32 tensors shaped like the
model's parameters, up to `HOST_SAMPLE_BYTES` of them (throughput, not total time, is what is reported,
so a sample suffices for large models). It is a property of the host, so it is measured once per process
and parameter-shape sample and then reused.
"""

from __future__ import annotations

import functools
import statistics
import time

import torch

from client.contract import OptimizerKind

HOST_SAMPLE_BYTES = 16 * 2**20

_KINDS: dict[str, OptimizerKind] = {"AdamW": OptimizerKind.adamw, "Adam": OptimizerKind.adam,
                                    "SGD": OptimizerKind.sgd}


def optimizer_kind(optimizer: torch.optim.Optimizer) -> OptimizerKind:
    name = type(optimizer).__name__
    kind = _KINDS.get(name)
    if kind is None:
        raise ValueError(
            f"optimizer: {name} is not one the wire contract v1 describes ({', '.join(_KINDS)}); "
            "profile with one of those (the cost model needs its state size and step cost)"
        )
    return kind


def state_tensors(optimizer: torch.optim.Optimizer) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every tensor of the optimizer's state, with the parameter it belongs to."""
    out: list[tuple[torch.Tensor, torch.Tensor]] = []
    for p, state in optimizer.state.items():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                out.append((p, v))
    return out


def state_bytes_per_param(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter]) -> int:
    """Measured optimizer-state bytes per parameter element (rounded), e.g. 8 for AdamW's fp32 moments."""
    numel = sum(p.numel() for p in params)
    if numel == 0:
        return 0
    ids = {id(p) for p in params}
    total = sum(v.numel() * v.element_size() for p, v in state_tensors(optimizer) if id(p) in ids)
    return round(total / numel)


def host_step_throughput(params: list[torch.nn.Parameter], reps: int = 3) -> float:
    """Parameter bytes per second of a fused (or foreach) AdamW step on host fp32 tensors like `params`."""
    shapes: list[tuple[int, ...]] = []
    total = 0
    for p in params:
        nbytes = p.numel() * 4
        if shapes and total + nbytes > HOST_SAMPLE_BYTES:
            break
        shapes.append(tuple(p.shape))
        total += nbytes
    if not shapes:
        shapes, total = [(1024,)], 4096
    return _measure_host_step(tuple(shapes), total, reps)


@functools.lru_cache(maxsize=16)
def _measure_host_step(shapes: tuple[tuple[int, ...], ...], total: int, reps: int) -> float:
    tensors = [torch.zeros(s, dtype=torch.float32, requires_grad=True) for s in shapes]
    for t in tensors:
        t.grad = torch.full_like(t, 1e-3)
    try:
        opt = torch.optim.AdamW(tensors, lr=1e-3, fused=True)
        opt.step()
    except (RuntimeError, TypeError, ValueError):
        opt = torch.optim.AdamW(tensors, lr=1e-3, foreach=True)
        opt.step()
    times: list[float] = []
    for _ in range(reps):
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    return total / max(statistics.median(times), 1e-9)
