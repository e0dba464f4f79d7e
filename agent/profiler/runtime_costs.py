"""Per-block runtime costs (swap, checkpoint, chunk upload and offload) from the runtime probe of one block
(`runtime_probe.py`), spread over the blocks as the cost model reads them; step 4 of `profiling.profile`."""

from __future__ import annotations

import bisect
import math

from agent.profiler.optimizer_probe import host_step_overhead, host_step_throughput
from agent.profiler.parameters import OrderedParameter
from agent.profiler.runtime_probe import RuntimeProbe
from client.contract import BandwidthSample, Hardware


def runtime_costs(
    probe: RuntimeProbe,
    probed: int,
    act: list[int],
    recompute: list[float],
    ordered: list[OrderedParameter],
    hw: Hardware,
) -> tuple[list[float], list[float], list[float], list[float], list[float]]:
    """Per-block runtime costs from the probe of block `probed` (see runtime_probe.py).

    Repeated blocks (one module class): swap costs scale with the block's activation bytes, checkpointing's
    cost with its measured forward re-run (the probe measures the whole of it, recompute machinery included,
    where the re-run alone misses the machinery). Every block, edges included: the chunk runtime's costs per
    parameter tensor (the probe's, less the copies and the host step that the cost model charges by bandwidth
    and throughput) times the block's parameter tensors: once per offloaded chunk (`offload_overhead_s`) and
    per upload (`upload_overhead_s`).
    """
    n = len(act)
    swap_out, swap_in = [0.0] * n, [0.0] * n
    rec = list(recompute)
    for b in range(1, n - 1):
        if act[probed] > 0:
            swap_out[b] = probe.swap_out_s * act[b] / act[probed]
            swap_in[b] = probe.swap_in_s * act[b] / act[probed]
        if recompute[probed] > 0:  # never less than the block's own forward re-run
            rec[b] = recompute[b] * max(1.0, probe.checkpoint_extra_s / recompute[probed])
    # the probe's chunk is uploaded and released once in its timed run (offload_s, of which upload_s is the
    # upload and the release): the cost model charges each upload's copy by bandwidth plus the measured
    # rest of an upload and release, and once per chunk its gradient copy by bandwidth and its host step (per-call overhead plus
    # bytes over throughput) plus the measured rest of offload_s
    h2d = _copy_s(hw.bandwidth.h2d_pinned, probe.offload_bytes)
    d2h = _copy_s(hw.bandwidth.d2h_pinned, probe.offload_bytes)
    # the chunk's host step as the cost model charges it (one call: overhead + bytes / rate), so that the rest
    # is not charged twice
    rate = host_step_throughput()
    step = host_step_overhead(rate) + probe.offload_bytes / rate if probe.offload_stepped else 0.0
    upload_rest = max(0.0, probe.upload_s - h2d)
    # plus what the offloaded block costs outside the runtime's entry points (CPU: autograd calling the
    # hooks, kernels after the chunk's copies and host step)
    once = max(0.0, probe.offload_s - h2d - upload_rest - d2h - step) + probe.offload_outside_s
    n_params = max(1, probe.offload_params)
    counts = [0] * n
    for (
        o
    ) in ordered:  # every parameter tensor, as the cost model spreads a block's figure over its parameters
        counts[o.block] += 1
    upload = [upload_rest / n_params * counts[b] for b in range(n)]
    offload = [once / n_params * counts[b] for b in range(n)]
    return swap_out, swap_in, rec, offload, upload


def _copy_s(curve: list[BandwidthSample], nbytes: int) -> float:
    """Seconds to copy `nbytes` at the curve's bandwidth (log-size interpolation, as the cost model reads it)."""
    if nbytes <= 0:
        return 0.0
    sizes = [s.size_bytes for s in curve]
    if nbytes <= sizes[0]:
        return nbytes / curve[0].bytes_per_s
    if nbytes >= sizes[-1]:
        return nbytes / curve[-1].bytes_per_s
    i = bisect.bisect_right(sizes, nbytes)
    lo, hi = curve[i - 1], curve[i]
    w = (math.log(nbytes) - math.log(lo.size_bytes)) / (math.log(hi.size_bytes) - math.log(lo.size_bytes))
    return nbytes / (lo.bytes_per_s + w * (hi.bytes_per_s - lo.bytes_per_s))
