"""Per-block runtime costs (swap, checkpoint, chunk upload and offload) from the runtime probe of one block
(`runtime_probe.py`), spread over the blocks as the cost model reads them; step 4 of `profiling.profile`."""

from __future__ import annotations

import bisect
import logging
import math
from collections.abc import Callable
from typing import NamedTuple

from agent.profiler.offload_probe import OffloadProbe
from agent.profiler.optimizer_probe import host_step_overhead, host_step_throughput
from agent.profiler.parameters import OrderedParameter
from agent.profiler.runtime_probe import RuntimeProbe
from client.contract import BandwidthSample, Hardware

log = logging.getLogger(__name__)


class BlockRuntimeCosts(NamedTuple):
    """Per block, the runtime costs of the trace's `BlockMeasurement` fields of the same names (seconds)."""

    swap_out: list[float]
    swap_in: list[float]
    recompute: list[float]
    offload: list[float]  # per offloaded chunk, once per iteration (`offload_overhead_s`)
    upload: list[float]  # per upload (`upload_overhead_s`)
    offload_forward: list[float]  # of `offload`, the part paid in forward (`offload_forward_s`)
    offload_step: list[float]  # of `offload`, the part paid in optimizer.step() (`offload_step_s`)


def runtime_costs(
    probe: RuntimeProbe,
    probed: int,
    act: list[int],
    recompute: list[float],
    ordered: list[OrderedParameter],
    hw: Hardware,
    whole: OffloadProbe | None = None,
) -> BlockRuntimeCosts:
    """Per-block runtime costs from the probe of block `probed` (see runtime_probe.py).

    Repeated blocks (one module class): swap costs scale with the block's activation bytes, checkpointing's
    cost with its measured forward re-run (the probe measures the whole of it, recompute machinery included,
    where the re-run alone misses the machinery). Every block, edges included: the chunk runtime's costs per
    parameter tensor (the probe's, less the copies and the host step that the cost model charges by bandwidth
    and throughput) times the block's parameter tensors: once per offloaded chunk (`offload_overhead_s`) and
    per upload (`upload_overhead_s`). `whole` (CPU): the whole model offloaded (`offload_probe.py`), whose
    entry-point time scales those chunk costs (`whole_model_scale`). The per-chunk cost's parts paid in
    forward and in `optimizer.step()` (`offload_forward_s`, `offload_step_s`, a CPU device) are the probed
    block's shares of it (its forward beyond the plain block's less the moves inside it; its settling step's
    section; each over its whole per-chunk cost, together at most all of it), applied to every block's.
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
    overhead = host_step_overhead(rate)

    def step_s(nbytes: int) -> float:  # one chunk's host step: per-call overhead + bytes over the rate
        return overhead + nbytes / rate

    step = step_s(probe.offload_bytes) if probe.offload_stepped else 0.0
    upload_rest = max(0.0, probe.upload_s - h2d)
    # plus what the offloaded block costs outside the runtime's entry points (CPU: autograd calling the
    # hooks, kernels after the chunk's copies and host step)
    inside = max(0.0, probe.offload_s - h2d - upload_rest - d2h - step)  # in the runtime's entry points
    once = inside + probe.offload_outside_s
    n_params = max(1, probe.offload_params)
    counts = [0] * n
    for (
        o
    ) in ordered:  # every parameter tensor, as the cost model spreads a block's figure over its parameters
        counts[o.block] += 1
    scale = 1.0
    if whole is not None:
        # like with like: the one block's entry-point time (`inside`, without the cost outside the entry
        # points, which only a difference of block runs gives) against the whole model's
        scale = whole_model_scale(whole, inside / n_params, upload_rest / n_params, hw, step_of=step_s)
        log.debug("chunk costs scaled by %.3f from the offloaded whole model: %s", scale, whole)
    upload = [scale * upload_rest / n_params * counts[b] for b in range(n)]
    offload = [scale * once / n_params * counts[b] for b in range(n)]
    forward_share = min(1.0, probe.offload_forward_s / once) if once > 0 else 0.0
    step_share = min(1.0 - forward_share, probe.offload_step_s / once) if once > 0 else 0.0
    return BlockRuntimeCosts(
        swap_out,
        swap_in,
        rec,
        offload,
        upload,
        offload_forward=[forward_share * x for x in offload],
        offload_step=[step_share * x for x in offload],
    )


SCALE_BOUNDS = (0.5, 4.0)  # a whole-model figure outside these is a disturbed measurement, not the runtime's


def whole_model_scale(
    whole: OffloadProbe,
    inside_per_param: float,
    upload_per_param: float,
    hw: Hardware,
    step_of: Callable[[int], float],
) -> float:
    """The factor on the one-block probe's spread chunk costs from the whole model's (`offload_probe.py`):
    the whole model's entry-point time less what the cost model charges apart (each upload and gradient copy
    by bandwidth, each chunk's host step), over the same time spread from the one block (per parameter tensor,
    per chunk and per upload), within `SCALE_BOUNDS`; 1.0 when the spread time is 0 (nothing to scale). Both
    sides are timed directly in the entry points, out of the noise of the compute around them."""
    chunks = len(whole.chunk_bytes)
    per_chunk_uploads = whole.uploads / max(1, chunks)
    spread = sum((inside_per_param + per_chunk_uploads * upload_per_param) * n for n in whole.chunk_params)
    if spread <= 0:
        return 1.0
    apart = sum(
        per_chunk_uploads * _copy_s(hw.bandwidth.h2d_pinned, b)
        + _copy_s(hw.bandwidth.d2h_pinned, b)
        + step_of(b)
        for b in whole.chunk_bytes
    )
    lo, hi = SCALE_BOUNDS
    return min(hi, max(lo, (whole.entry_points_s - apart) / spread))


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
