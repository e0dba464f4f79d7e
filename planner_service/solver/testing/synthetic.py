"""Synthetic traces shaped like real transformer models, for solver tests and benchmarks.

These numbers are *modelled*, not measured: a synthetic trace is never used to plan a real job. The
shapes follow the usual decoder-only accounting (12*h^2 parameters per block; activations of roughly
34*b*s*h + 5*a*b*s^2 bytes per block in half precision, Korthikanti et al. 2022) and a throughput
guess, so solver benchmarks see realistic ratios between compute, memory and bandwidth.

The guess, which every time predicted from a synthetic trace depends on (docs/BENCHMARKS.md lists it beside
the figures that use it): compute at `MODELLED_DEVICE_FLOPS` (300 TFLOP/s) used at 100% (backward = 2 x
forward, recompute = forward); pinned copies at `MODELLED_PINNED_COPY_BYTES_PER_S` (24 GB/s each way, on
the curve of `_curve`), pageable at 10 GB/s; the optimizer step at 200 GB/s of parameter bytes on the
device and 2 GB/s on the host.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from client.contract import (
    BandwidthCurves,
    BandwidthSample,
    BlockInfo,
    BlockKind,
    BlockMeasurement,
    CollectiveBackend,
    CollectiveCopyOverlap,
    CollectiveCurves,
    CollectiveSample,
    DeviceType,
    Distributed,
    Hardware,
    Interconnect,
    Measurements,
    ModelInfo,
    OptimizerKind,
    OptimizerMeasurement,
    ParameterInfo,
    Precision,
    Software,
    Trace,
    Workload,
)

GiB = 2**30
MODELLED_DEVICE_FLOPS = 300e12  # FLOP/s, used at 100%
MODELLED_PINNED_COPY_BYTES_PER_S = 24e9  # each way (full duplex), the curve's asymptote
MODELLED_PAGEABLE_COPY_BYTES_PER_S = 10e9
MODELLED_DEVICE_OPTIMIZER_BYTES_PER_S = 200e9  # parameter bytes stepped per second
MODELLED_HOST_OPTIMIZER_BYTES_PER_S = 2e9


def _curve(peak_bytes_per_s: float) -> list[BandwidthSample]:
    # Latency-limited at small sizes, saturating at large ones: bw(s) = peak * s / (s + 1 MiB).
    sizes = [64 * 2**10, 1 * 2**20, 16 * 2**20, 64 * 2**20, 256 * 2**20]
    return [BandwidthSample(size_bytes=s, bytes_per_s=peak_bytes_per_s * s / (s + 2**20)) for s in sizes]


def synthetic_hardware(device_memory_bytes: int = 80 * GiB, host_memory_bytes: int = 512 * GiB) -> Hardware:
    return Hardware(
        device_type=DeviceType.cuda,
        device_name="Synthetic GPU (modelled)",
        device_count=1,
        device_memory_bytes=device_memory_bytes,
        host_memory_bytes=host_memory_bytes,
        pinned_memory_limit_bytes=None,
        cpu_cores=32,
        bandwidth=BandwidthCurves(
            h2d_pinned=_curve(MODELLED_PINNED_COPY_BYTES_PER_S),
            d2h_pinned=_curve(MODELLED_PINNED_COPY_BYTES_PER_S),
            h2d_pageable=_curve(MODELLED_PAGEABLE_COPY_BYTES_PER_S),
            d2h_pageable=_curve(MODELLED_PAGEABLE_COPY_BYTES_PER_S),
        ),
    )


def synthetic_trace(
    *,
    n_blocks: int = 8,
    hidden: int = 1024,
    vocab: int = 32000,
    heads: int = 16,
    batch: int = 4,
    seq: int = 1024,
    precision: Precision = Precision.bf16,
    device_flops: float = MODELLED_DEVICE_FLOPS,
    device_memory_bytes: int = 80 * GiB,
    host_memory_bytes: int = 512 * GiB,
    name: str | None = None,
) -> Trace:
    """A valid Trace for a decoder-only model with `n_blocks` blocks of width `hidden`."""
    elt = 2 if precision != Precision.fp32 else 4
    tokens = batch * seq
    blocks: list[BlockInfo] = []
    params: list[ParameterInfo] = []
    meas: list[BlockMeasurement] = []

    def add_block(
        kind: BlockKind, bname: str, cls: str, shapes: dict[str, list[int]], flops: float, act: int, inp: int
    ) -> None:
        idx = len(blocks)
        pbytes = 0
        for pname, shape in shapes.items():
            numel = 1
            for d in shape:
                numel *= d
            params.append(
                ParameterInfo(
                    name=f"{bname}.{pname}",
                    block=idx,
                    shape=shape,
                    dtype="bfloat16" if elt == 2 else "float32",
                    numel=numel,
                    bytes=numel * elt,
                )
            )
            pbytes += numel * elt
        blocks.append(BlockInfo(index=idx, name=bname, kind=kind, module_class=cls, parameter_bytes=pbytes))
        fwd = flops / device_flops
        meas.append(
            BlockMeasurement(
                block=idx,
                forward_s=fwd,
                backward_s=2 * fwd,
                recompute_s=fwd,
                activation_bytes=act,
                input_bytes=inp,
                forward_transient_peak_bytes=4 * tokens * hidden * elt,
                backward_transient_peak_bytes=8 * tokens * hidden * elt,
            )
        )

    h = hidden
    add_block(
        BlockKind.prologue,
        "embed",
        "Embedding",
        {"weight": [vocab, h]},
        2 * tokens * h,
        tokens * h * elt,
        tokens * 8,
    )
    for i in range(n_blocks):
        shapes = {
            "attn.qkv.weight": [3 * h, h],
            "attn.out.weight": [h, h],
            "mlp.up.weight": [4 * h, h],
            "mlp.down.weight": [h, 4 * h],
            "norm1.weight": [h],
            "norm2.weight": [h],
        }
        flops = 2 * tokens * 12 * h * h + 4 * batch * seq * seq * h
        act = (34 * tokens * h + 5 * heads * batch * seq * seq) * elt // 2
        add_block(BlockKind.block, f"layers.{i}", "DecoderLayer", shapes, flops, act, tokens * h * elt)
    add_block(
        BlockKind.epilogue,
        "head",
        "LMHead",
        {"norm.weight": [h], "lm_head.weight": [vocab, h]},
        6 * tokens * h * vocab / 3,
        tokens * vocab * 4,
        tokens * h * elt,
    )

    n_params = sum(p.numel for p in params)
    fp = hashlib.sha256(f"synthetic:{n_blocks}:{hidden}:{vocab}:{heads}".encode()).hexdigest()[:16]
    fwd_total = sum(m.forward_s for m in meas)
    return Trace(
        hardware=synthetic_hardware(device_memory_bytes, host_memory_bytes),
        software=Software(
            torch_version="synthetic", cuda_version=None, python_version="3.11", memplan_version="0.1.0"
        ),
        model=ModelInfo(
            name=name or f"synthetic-{n_blocks}L-{hidden}H",
            architecture="SyntheticDecoder",
            fingerprint=fp,
            parameter_count=n_params,
            dtype="bfloat16" if elt == 2 else "float32",
            blocks=blocks,
            parameters=params,
        ),
        workload=Workload(
            batch_size=batch,
            sequence_length=seq,
            precision=precision,
            optimizer=OptimizerKind.adamw,
            optimizer_state_bytes_per_param=8,
            master_bytes_per_param=4 if elt == 2 else 0,
            gradient_bytes_per_param=elt,
        ),
        measurements=Measurements(
            blocks=meas,
            optimizer=OptimizerMeasurement(
                device_bytes_per_s=MODELLED_DEVICE_OPTIMIZER_BYTES_PER_S,
                host_bytes_per_s=MODELLED_HOST_OPTIMIZER_BYTES_PER_S,
            ),
            iteration_s=3 * fwd_total,
            peak_device_bytes=0,
            extrapolated=False,
        ),
    )


# Published shapes (hidden, layers, heads) of the model families the benchmarks use.
MODEL_SHAPES: dict[str, tuple[int, int, int]] = {
    "gpt2-1.5b": (1600, 48, 25),
    "llama-7b": (4096, 32, 32),
    "llama-13b": (5120, 40, 40),
    "llama-34b": (8192, 48, 64),
    "llama-70b": (8192, 80, 64),
}


# ------------------------------------------------------------------------------ hand-built traces (tests)
@dataclass(frozen=True)
class BlockSpec:
    """Round numbers for one block of a hand-built trace (one parameter tensor per block)."""

    parameter_bytes: int
    forward_s: float
    backward_s: float
    recompute_s: float
    activation_bytes: int
    input_bytes: int
    forward_peak_bytes: int = 0
    backward_peak_bytes: int = 0
    kind: BlockKind = BlockKind.block
    # runtime costs as the profiler's runtime probe measures them (0: not measured)
    swap_out_s: float = 0.0
    swap_in_s: float = 0.0
    offload_overhead_s: float = 0.0
    upload_overhead_s: float = 0.0
    offload_forward_s: float = 0.0  # of offload_overhead_s, the part paid in forward


def hand_trace(
    specs: list[BlockSpec],
    *,
    h2d_bytes_per_s: float = 10e9,
    d2h_bytes_per_s: float = 10e9,
    device_optimizer_bytes_per_s: float = 100e9,
    host_optimizer_bytes_per_s: float = 1e9,
    device_memory_bytes: int = 80 * GiB,
    host_memory_bytes: int = 512 * GiB,
    pinned_memory_limit_bytes: int | None = None,
    name: str = "hand-built",
    device_type: DeviceType = DeviceType.cuda,
) -> Trace:
    """A fp32 + Adam trace with exactly the given per-block numbers and flat copy bandwidths (tests only).

    `device_type` cpu gives a CPU "device" (the cost model then assumes no copy/compute overlap).

    fp32: 4-byte elements, gradients 4 bytes, optimizer state 8 bytes, no master copy, so a chunk of S bytes
    carries 4*S bytes of model state. Each block owns one parameter `blocks.{i}.weight` of `parameter_bytes`
    (a multiple of 4).
    """
    blocks: list[BlockInfo] = []
    params: list[ParameterInfo] = []
    meas: list[BlockMeasurement] = []
    for i, s in enumerate(specs):
        if s.parameter_bytes % 4:
            raise ValueError(f"specs[{i}].parameter_bytes: {s.parameter_bytes} is not a multiple of 4 (fp32)")
        if s.parameter_bytes:
            params.append(
                ParameterInfo(
                    name=f"blocks.{i}.weight",
                    block=i,
                    shape=[s.parameter_bytes // 4],
                    dtype="float32",
                    numel=s.parameter_bytes // 4,
                    bytes=s.parameter_bytes,
                )
            )
        blocks.append(
            BlockInfo(
                index=i,
                name=f"blocks.{i}",
                kind=s.kind,
                module_class="HandBlock",
                parameter_bytes=s.parameter_bytes,
            )
        )
        meas.append(
            BlockMeasurement(
                block=i,
                forward_s=s.forward_s,
                backward_s=s.backward_s,
                recompute_s=s.recompute_s,
                activation_bytes=s.activation_bytes,
                input_bytes=s.input_bytes,
                forward_transient_peak_bytes=s.forward_peak_bytes,
                backward_transient_peak_bytes=s.backward_peak_bytes,
                swap_out_s=s.swap_out_s,
                swap_in_s=s.swap_in_s,
                offload_overhead_s=s.offload_overhead_s,
                upload_overhead_s=s.upload_overhead_s,
                offload_forward_s=s.offload_forward_s,
            )
        )
    flat = lambda bw: [BandwidthSample(size_bytes=1, bytes_per_s=bw)]  # noqa: E731
    hw = Hardware(
        device_type=device_type,
        device_name="Hand-built GPU" if device_type == DeviceType.cuda else "Hand-built CPU",
        device_count=1,
        device_memory_bytes=device_memory_bytes,
        host_memory_bytes=host_memory_bytes,
        pinned_memory_limit_bytes=pinned_memory_limit_bytes,
        cpu_cores=8,
        bandwidth=BandwidthCurves(h2d_pinned=flat(h2d_bytes_per_s), d2h_pinned=flat(d2h_bytes_per_s)),
    )
    return Trace(
        hardware=hw,
        software=Software(
            torch_version="synthetic", cuda_version=None, python_version="3.11", memplan_version="0.1.0"
        ),
        model=ModelInfo(
            name=name,
            architecture="HandModel",
            fingerprint=hashlib.sha256(repr(specs).encode()).hexdigest()[:16],
            parameter_count=sum(p.numel for p in params),
            dtype="float32",
            blocks=blocks,
            parameters=params,
        ),
        workload=Workload(
            batch_size=1,
            sequence_length=1,
            precision=Precision.fp32,
            optimizer=OptimizerKind.adam,
            optimizer_state_bytes_per_param=8,
            master_bytes_per_param=0,
            gradient_bytes_per_param=4,
        ),
        measurements=Measurements(
            blocks=meas,
            optimizer=OptimizerMeasurement(
                device_bytes_per_s=device_optimizer_bytes_per_s, host_bytes_per_s=host_optimizer_bytes_per_s
            ),
            iteration_s=sum(s.forward_s + s.backward_s for s in specs),
            peak_device_bytes=0,
        ),
    )


# Modelled collective rates for synthetic multi-rank traces (issue 20): an NVLink-class group, algorithm
# bandwidth of the whole tensor saturating at 100 GB/s, and collectives fully concurrent with host copies
# (separate links). Like every figure here, a guess for solver tests, never a measurement.
MODELLED_COLLECTIVE_BYTES_PER_S = 100e9


def synthetic_distributed(
    world_size: int,
    ranks_per_node: int | None = None,
    *,
    collective_bytes_per_s: float = MODELLED_COLLECTIVE_BYTES_PER_S,
    overlap_factor: float = 1.0,
    flat: bool = False,
    flat_sample_bytes: int = 1,
) -> Distributed:
    """A modelled process group: `flat` gives one sample per curve (the same rate at every size, for
    hand-computed tests; its size `flat_sample_bytes` sets the barrier the planner reads off it,
    `sharding.control_ns`); otherwise latency-limited curves like `_curve`. `overlap_factor` sets the measured
    overlap of each collective with the copy beside it (all-gather with H2D, reduce-scatter with D2H)."""
    rpn = ranks_per_node or world_size
    if flat:
        curve = [CollectiveSample(size_bytes=flat_sample_bytes, bytes_per_s=collective_bytes_per_s)]
    else:
        curve = [
            CollectiveSample(size_bytes=s.size_bytes, bytes_per_s=s.bytes_per_s)
            for s in _curve(collective_bytes_per_s)
        ]
    # alone 1 s each; together 2 - factor seconds: `CollectiveCopyOverlap.factor` reads back `overlap_factor`
    overlap = [
        CollectiveCopyOverlap(
            collective=c,
            direction=d,
            collective_bytes=2**20,
            copy_bytes=2**20,
            collective_s=1.0,
            copy_s=1.0,
            concurrent_s=2.0 - overlap_factor,
        )
        for c, d in (("all_gather", "h2d"), ("reduce_scatter", "d2h"))
    ]
    return Distributed(
        world_size=world_size,
        ranks_per_node=rpn,
        interconnect=Interconnect(
            backend=CollectiveBackend.nccl,
            intra_node="nvlink (modelled)",
            inter_node=None if rpn == world_size else "infiniband (modelled)",
        ),
        collectives=CollectiveCurves(all_gather=curve, reduce_scatter=list(curve), copy_overlap=overlap),
    )


def with_distributed(trace: Trace, distributed: Distributed | None) -> Trace:
    """`trace` measured in `distributed`'s process group (None: a single-process job), revalidated."""
    hw = trace.hardware.model_copy(update={"distributed": distributed})
    return Trace.model_validate_json(trace.model_copy(update={"hardware": hw}).model_dump_json())
