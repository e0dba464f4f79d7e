"""Retarget a measured trace to another catalogued GPU: its memory kept, its times scaled by the two entries.

Memory is the same on every device (same model, same kernels' saved tensors), so every byte figure of the
trace is kept. Times move by the ratio of the two entries' throughputs:
- block forward, backward and recompute seconds: by `compute_share` x (source / target dense throughput in
  the trace's precision) + (1 - compute_share) x (source / target memory bandwidth); `compute_share` 0.7 is
  an estimate of the share of a transformer block's time in GEMMs and attention at training sizes, stated
  in the trace's factors;
- device optimizer throughput: by the memory bandwidth ratio (the step is bandwidth-bound);
- host optimizer throughput: by the ratio of the hosts' cores (the same fused step per core);
- the runtime costs the profiler measured (swap, chunk runtime overheads): kept (they are host-side work);
- the hardware: the target entry's, with its typical host unless overridden.
The source entry is the one whose device name matches the trace's (`source_entry`), or the one named.
A CPU trace has no catalogue entry: name the entry whose speed it stands for, or retarget a GPU trace.
"""

from __future__ import annotations

from client.contract import CatalogEntry, DeviceType, ModelledFrom, Trace
from planner_service.whatif.catalog import CatalogError, to_hardware

COMPUTE_SHARE = 0.7


def source_entry(trace: Trace, catalog: dict[str, CatalogEntry]) -> CatalogEntry:
    """The catalogue entry whose device name is the trace's (exact, then case-insensitive)."""
    name = trace.hardware.device_name
    for e in catalog.values():
        if e.name == name:
            return e
    for e in catalog.values():
        if e.name.lower() == name.lower():
            return e
    kind = "a CPU trace" if trace.hardware.device_type == DeviceType.cpu else f"device {name!r}"
    raise CatalogError(f"trace: {kind} matches no catalogue entry; name the source with --from KEY")


def time_scale(
    source: CatalogEntry, target: CatalogEntry, precision: str, compute_share: float = COMPUTE_SHARE
) -> float:
    """Factor applied to the trace's block times: < 1 when the target is faster."""
    flops = getattr(source.dense_flops, precision) / getattr(target.dense_flops, precision)
    bandwidth = source.memory_bandwidth_bytes_per_s / target.memory_bandwidth_bytes_per_s
    return compute_share * flops + (1.0 - compute_share) * bandwidth


def retarget(
    trace: Trace,
    source: CatalogEntry,
    target: CatalogEntry,
    *,
    host_memory_bytes: int | None = None,
    cpu_cores: int | None = None,
) -> Trace:
    """`trace` as it would be on `target` (see the module docstring); marked modelled with its factors."""
    precision = trace.workload.precision.value
    scale = time_scale(source, target, precision)
    bw = target.memory_bandwidth_bytes_per_s / source.memory_bandwidth_bytes_per_s
    hardware = to_hardware(target, host_memory_bytes=host_memory_bytes, cpu_cores=cpu_cores)
    cores = hardware.cpu_cores / max(1, trace.hardware.cpu_cores)
    m = trace.measurements
    blocks = [
        b.model_copy(
            update={
                "forward_s": b.forward_s * scale,
                "backward_s": b.backward_s * scale,
                "recompute_s": b.recompute_s * scale,
            }
        )
        for b in m.blocks
    ]
    compute_s = sum(b.forward_s + b.backward_s for b in m.blocks)
    rest_s = max(0.0, m.iteration_s - compute_s)  # optimizer step and whatever else the iteration spent
    optimizer = m.optimizer.model_copy(
        update={
            "device_bytes_per_s": m.optimizer.device_bytes_per_s * bw,
            "host_bytes_per_s": m.optimizer.host_bytes_per_s * cores,
        }
    )
    measurements = m.model_copy(
        update={"blocks": blocks, "optimizer": optimizer, "iteration_s": compute_s * scale + rest_s / bw}
    )
    factors = {
        "time_scale": scale,
        "compute_share": COMPUTE_SHARE,
        "device_bandwidth_ratio": bw,
        "host_cores_ratio": cores,
    }
    method = f"retargeted measured trace {trace.content_hash()[:12]} from {source.key}"
    return Trace.model_validate(
        {
            **trace.model_dump(exclude={"hardware", "measurements", "modelled"}),
            "hardware": hardware.model_dump(),
            "measurements": measurements.model_dump(),
            "modelled": ModelledFrom(hardware_key=target.key, method=method, factors=factors).model_dump(),
        }
    )
