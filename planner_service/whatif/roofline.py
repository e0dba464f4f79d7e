"""FLOPs and bytes -> seconds on a catalogue entry: a roofline per op, with efficiency factors.

Each op of the fake iteration takes max(FLOPs / (dense peak of the precision * `matmul`),
bytes / (device bandwidth * `memory`)); ops without a FLOP formula (element-wise, reductions, norms) are
bandwidth-bound. A block's time is the larger of the sum of its ops' times and its op count times
`dispatch_s` (eager PyTorch issues ops from one CPU thread: small blocks are bound by that).

The defaults are estimates, not measurements (`calibrate.py` fits them to measured traces of an entry's
device; a trace priced with the defaults says `calibrated: false`):
- `matmul` 0.6: large bf16 GEMMs reach 60-80% of dense peak on current GPUs; 0.6 allows for the smaller
  and skinnier GEMMs of attention projections and the fused attention kernels;
- `memory` 0.7: element-wise kernels reach 70-90% of peak DRAM bandwidth;
- `dispatch_s` 8 us: PyTorch eager overhead per op on a server CPU core (launch + dispatcher);
- `host_adam_bytes_per_s_per_core` 3.3e9: half of the fused AdamW rate measured on one core of this project's
  CPU for a cache-resident 16 MiB sample (6.6e9 parameter bytes/s, agent/profiler/optimizer_probe.py),
  halved for DRAM-resident states; times the entry's cores.
The device optimizer step is bandwidth-bound: Adam reads parameter, gradient and two moments and writes
parameter and two moments (7 element accesses per parameter element), SGD reads two and writes one.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from client.contract import CatalogEntry, OptimizerKind
from planner_service.whatif.fake_iteration import OpCosts


@dataclass(frozen=True)
class Efficiency:
    matmul: float = 0.6
    memory: float = 0.7
    dispatch_s: float = 8e-6
    host_adam_bytes_per_s_per_core: float = 3.3e9

    def as_factors(self) -> dict[str, float]:
        return {k: float(v) for k, v in asdict(self).items()}


DEFAULT_EFFICIENCY = Efficiency()
_ACCESSES = {OptimizerKind.adamw: 7, OptimizerKind.adam: 7, OptimizerKind.sgd: 3}


def peak_flops(entry: CatalogEntry, dtype: str) -> float:
    return float(getattr(entry.dense_flops, dtype))


def block_seconds(
    costs: OpCosts, entry: CatalogEntry, dtype: str, eff: Efficiency = DEFAULT_EFFICIENCY
) -> float:
    """Seconds of one block's ops in one phase on `entry` in `dtype` (see the module docstring)."""
    flops, nbytes, _ = costs.arrays()
    if flops.size == 0:
        return 0.0
    compute = flops / (peak_flops(entry, dtype) * eff.matmul)
    memory = nbytes / (entry.memory_bandwidth_bytes_per_s * eff.memory)
    return float(max(np.maximum(compute, memory).sum(), flops.size * eff.dispatch_s))


def device_optimizer_bytes_per_s(
    entry: CatalogEntry, kind: OptimizerKind, eff: Efficiency = DEFAULT_EFFICIENCY
) -> float:
    """Parameter bytes per second of the optimizer step on the device (bandwidth-bound)."""
    return entry.memory_bandwidth_bytes_per_s * eff.memory / _ACCESSES[kind]


def host_optimizer_bytes_per_s(cpu_cores: int, eff: Efficiency = DEFAULT_EFFICIENCY) -> float:
    """Parameter bytes per second of a fused AdamW step on the host's cores."""
    return cpu_cores * eff.host_adam_bytes_per_s_per_core
