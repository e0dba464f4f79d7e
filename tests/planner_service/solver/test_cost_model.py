"""Hand-checked cost-model cases: everything fits, all-checkpoint, bandwidth-bound offload.

Every expected figure below is derived by hand from the trace's round numbers (the derivation is in the
comments), not by calling the model.
"""

from __future__ import annotations

import numpy as np
import pytest

from client.contract import (
    ActivationMode,
    BlockKind,
    BlockPolicy,
    Chunk,
    Constraints,
    DeviceType,
    Placement,
    Policy,
)
from planner_service.solver.chunk_grid import pack
from planner_service.solver.cost_model import evaluate, evaluate_decision, iteration_ns_batch
from planner_service.solver.instance import CostParams, Decision, Mode, build_instance
from planner_service.solver.testing.synthetic import BlockSpec, hand_trace, synthetic_trace

MiB = 2**20
GiB = 2**30
NO_MARGIN = CostParams(alpha=0.0)


def five_block_trace(
    fwd: float,
    bwd: float,
    rec: float,
    host_rate: float = 1e12,
    *,
    device_type: DeviceType = DeviceType.cuda,
    runtime_costs: bool = False,
):
    """prologue (4 MiB params) + 3 blocks (8 MiB) + epilogue (4 MiB); fp32 Adam: a chunk of S bytes = 4S of state.

    `runtime_costs`: the runtime costs the profiler's runtime probe measures, per block: offloading 0.5 ms
    and uploading 0.1 ms (every block), swapping out 3 ms and in 2 ms (the three middle blocks)."""
    edge = dict(forward_s=fwd, backward_s=bwd, recompute_s=rec)
    costs = dict(offload_overhead_s=0.0005, upload_overhead_s=0.0001) if runtime_costs else {}
    swaps = dict(swap_out_s=0.003, swap_in_s=0.002) if runtime_costs else {}
    return hand_trace(
        [
            BlockSpec(
                4 * MiB, activation_bytes=1 * MiB, input_bytes=0, kind=BlockKind.prologue, **edge, **costs
            )
        ]
        + [
            BlockSpec(
                8 * MiB,
                activation_bytes=16 * MiB,
                input_bytes=1 * MiB,
                forward_peak_bytes=2 * MiB,
                backward_peak_bytes=4 * MiB,
                **edge,
                **costs,
                **swaps,
            )
        ]
        * 3
        + [
            BlockSpec(
                4 * MiB,
                activation_bytes=2 * MiB,
                input_bytes=1 * MiB,
                kind=BlockKind.epilogue,
                **edge,
                **costs,
            )
        ],
        h2d_bytes_per_s=10e9,
        d2h_bytes_per_s=10e9,
        device_optimizer_bytes_per_s=100e9,
        host_optimizer_bytes_per_s=host_rate,
        device_type=device_type,
    )


def policy(
    trace,
    chunk_size: int,
    groups: list[list[int]],
    placement: Placement,
    n_buffers: int,
    modes: list[ActivationMode],
) -> Policy:
    return Policy(
        chunk_size_bytes=chunk_size,
        chunks=[
            Chunk(
                index=i,
                placement=placement,
                parameters=[f"blocks.{b}.weight" for b in g],
                blocks=g,
                used_bytes=sum(trace.model.blocks[b].parameter_bytes for b in g),
            )
            for i, g in enumerate(groups)
        ],
        n_buffers=n_buffers,
        blocks=[
            BlockPolicy(block=b.index, module=b.name, mode=m)
            for b, m in zip(trace.model.blocks, modes, strict=True)
        ],
    )


K, C, S = ActivationMode.keep, ActivationMode.checkpoint, ActivationMode.swap
ROOMY = Constraints(device_memory_bytes=80 * GiB)


def test_everything_fits_costs_compute_plus_device_optimizer_and_sums_activations():
    trace = five_block_trace(fwd=0.002, bwd=0.004, rec=0.002)
    pol = policy(trace, 32 * MiB, [[0, 1, 2, 3, 4]], Placement.persistent, 0, [K] * 5)
    p = evaluate(trace, pol, ROOMY, NO_MARGIN)
    # no copies: forward = 5 * 2 ms, backward = 5 * 4 ms, device Adam on 32 MiB at 100 GB/s
    assert p.forward_s == pytest.approx(0.010, abs=1e-9)
    assert p.backward_s == pytest.approx(0.020, abs=1e-9)
    assert p.device_optimizer_s == pytest.approx(32 * MiB / 100e9, abs=1e-9)
    assert p.iteration_s == pytest.approx(0.030 + 32 * MiB / 100e9, abs=1e-9)
    assert p.host_optimizer_s == 0.0 and p.peak_host_bytes == 0
    # static: one persistent 32 MiB chunk * 4 (param + grad + two Adam moments, fp32) = 128 MiB.
    # walk (MiB): prologue 0+1; blocks fwd/bwd = prefix + 16 + 2 / prefix + 16 + 4 with prefixes 1, 17, 33;
    # the third block's backward is the peak: 33 + 20 = 53; epilogue 49 + 2 = 51.
    assert p.peak_device_bytes == 128 * MiB + 53 * MiB
    # the timeline walks forward, then backward in reverse, then the optimizer; its top is the peak
    timeline = p.device_memory_timeline
    assert [t.label for t in timeline][:2] == ["fwd blocks.0", "fwd blocks.1"]
    assert timeline[5].label == "bwd blocks.4" and timeline[-1].label == "optimizer"
    assert max(t.device_bytes for t in timeline) == p.peak_device_bytes
    assert timeline[-1].device_bytes == 128 * MiB


def test_all_checkpoint_adds_recompute_and_keeps_only_inputs():
    trace = five_block_trace(fwd=0.002, bwd=0.004, rec=0.002)
    pol = policy(trace, 32 * MiB, [[0, 1, 2, 3, 4]], Placement.persistent, 0, [K, C, C, C, K])
    p = evaluate(trace, pol, ROOMY, NO_MARGIN)
    assert p.forward_s == pytest.approx(0.010, abs=1e-9)
    assert p.backward_s == pytest.approx(0.020 + 3 * 0.002, abs=1e-9)  # three recomputes in backward
    assert p.breakdown["recompute_s"] == pytest.approx(0.006, abs=1e-9)
    # walk (MiB): prologue keeps 1; each checkpointed block keeps its 1 MiB input (prefixes 1, 2, 3) and in
    # backward holds input + recomputed 16 + transient 4 = 21: peaks 22, 23, 24; epilogue 4 + 2 = 6.
    assert p.peak_device_bytes == 128 * MiB + 24 * MiB


def test_bandwidth_bound_offload_is_paced_by_uploads_and_gradient_copies():
    trace = five_block_trace(fwd=0.0001, bwd=0.0002, rec=0.0001)
    pol = policy(trace, 8 * MiB, [[0], [1], [2], [3], [4]], Placement.offloaded, 2, [K] * 5)
    p = evaluate(trace, pol, ROOMY, NO_MARGIN)
    up4, up8 = 419_430, 838_861  # 4 MiB and 8 MiB at 10 GB/s, in ns (rounded once)
    # forward: first upload exposed, then each window waits for the next chunk's upload (compute 0.1 ms)
    fwd = up4 + 3 * up8 + max(100_000, up4) + 100_000
    assert round(p.forward_s * 1e9) == fwd
    # backward: with 2 buffers chunks 3 and 4 are still resident; chunks 2, 1, 0 are uploaded again.
    # window 4: compute 0.2 ms; windows 3..0 are paced by an 8 MiB upload or gradient copy (838 861 ns)
    bwd = 200_000 + 4 * up8
    assert round(p.backward_s * 1e9) == bwd
    # host Adam at 1e12 B/s (4 MiB: 4 194 ns, 8 MiB: 8 389 ns) steps chunk 0 last: its gradients land at the
    # end of backward + a 4 MiB copy (419 430 ns), then its step runs; chunk 1's bound (bwd - 838 861 +
    # 838 861 + 4 194 + 8 389) and the later ones are smaller
    host_end = bwd + up4 + 4_194
    assert round(p.breakdown["host_optimizer_end_s"] * 1e9) == host_end
    assert round(p.iteration_s * 1e9) == fwd + host_end
    # device: two buffers of 8 MiB params + 8 MiB grads (buffers are full chunk size); host: each chunk's
    # state at its used bytes, 4x (param, grad, two Adam moments), plus the `.grad` the runtime exposes after
    # backward (1x, fp32) and the staging buffer of added gradient copies (1x): 6 * (4 + 8 + 8 + 8 + 4) MiB; no
    # undo backup (the workload declares none)
    assert p.breakdown["static_device_bytes"] == 2 * 16 * MiB
    assert p.peak_host_bytes == 6 * 32 * MiB
    # pinned (the runtime's host arena): upload source, host gradient and staging, 3x (fp32: no separate master)
    assert p.pinned_host_bytes == 3 * 32 * MiB
    assert p.breakdown["host_optimizer_redo_s"] == 0.0


def test_persistent_chunks_count_their_used_bytes_not_the_chunk_size():
    # what the runtime allocates: a persistent chunk's copy, gradient and optimizer state at its used size
    trace = five_block_trace(fwd=0.002, bwd=0.004, rec=0.002)
    pol = policy(trace, 16 * MiB, [[0, 1], [2], [3, 4]], Placement.persistent, 0, [K] * 5)
    p = evaluate(trace, pol, ROOMY, NO_MARGIN)
    # used: 12, 8 and 12 MiB of 16 MiB chunks -> 4 * 32 MiB of state, not 4 * 48 MiB
    assert p.breakdown["static_device_bytes"] == 4 * 32 * MiB


def test_half_duplex_link_adds_swap_to_prefetch_time():
    trace = five_block_trace(fwd=0.0001, bwd=0.0002, rec=0.0001)
    pol = policy(trace, 8 * MiB, [[0], [1], [2], [3], [4]], Placement.offloaded, 2, [K, S, S, S, K])
    full = evaluate(trace, pol, ROOMY, CostParams(alpha=0.0, full_duplex=True))
    half = evaluate(trace, pol, ROOMY, CostParams(alpha=0.0, full_duplex=False))
    # forward windows (ns), compute 100 000; uploads 838 861 (8 MiB) / 419 430 (4 MiB); swap-out of 16 MiB
    # 1 677 722. Full duplex: windows 1..3 are paced by the swap-out alone (max). Half duplex: windows 1 and 2
    # take upload + swap-out = 2 516 583, window 3 takes 419 430 + 1 677 722 = 2 097 152.
    assert round((half.forward_s - full.forward_s) * 1e9) == 2 * 838_861 + 419_430


def test_fragmentation_margin_shrinks_the_usable_device_memory():
    trace = five_block_trace(fwd=0.002, bwd=0.004, rec=0.002)
    lay = pack(trace, 32 * MiB)
    limit = Constraints(device_memory_bytes=200 * MiB)
    inst = build_instance(trace, lay, limit, CostParams(alpha=0.25))
    assert inst.usable_device_bytes == 160 * MiB
    cost = evaluate_decision(inst, Decision(offloaded=(False,), n_buffers=0, modes=(Mode.keep,) * 5))
    assert cost.peak_device_bytes == 181 * MiB and not cost.fits_device


def assert_batch_matches_reference(rng: np.random.Generator, inst, draws: int) -> None:
    """The vectorised timer equals the reference model on random placements, buffer counts and mode rows."""
    for i in range(draws):
        off = tuple(bool(x) for x in rng.integers(0, 2, inst.n_chunks))
        nb = (1 if i % 3 == 0 else int(rng.integers(1, sum(off) + 1))) if any(off) else 0
        rows = np.zeros((5, inst.n_blocks), dtype=np.int8)
        rows[:, 1:-1] = rng.integers(0, 3, (5, inst.n_blocks - 2))
        batch = iteration_ns_batch(inst, off, nb, rows)
        for r in range(5):
            d = Decision(offloaded=off, n_buffers=nb, modes=tuple(Mode(int(x)) for x in rows[r]))
            assert int(batch[r]) == evaluate_decision(inst, d).iteration_ns


def test_batch_timing_equals_the_reference_model_on_random_decisions():
    rng = np.random.default_rng(7)
    trace = synthetic_trace(n_blocks=6, hidden=512, vocab=5000, batch=2, seq=256)
    for size, duplex in ((8 * MiB, True), (8 * MiB, False), (32 * MiB, True)):
        inst = build_instance(trace, pack(trace, size), ROOMY, CostParams(full_duplex=duplex))
        assert_batch_matches_reference(rng, inst, draws=30)


def test_evaluate_rejects_a_policy_whose_chunks_do_not_follow_the_trace():
    trace = five_block_trace(fwd=0.002, bwd=0.004, rec=0.002)
    pol = policy(trace, 32 * MiB, [[0, 2, 1, 3, 4]], Placement.persistent, 0, [K] * 5)
    with pytest.raises(ValueError, match=r"policy.chunks: parameter #1"):
        evaluate(trace, pol, ROOMY)


def test_fragmentation_margin_comes_from_a_measured_allocation_trace_when_there_is_one():
    from client.contract import AllocationCategory, AllocationEvent, AllocationTrace, Phase, Trace
    from planner_service.solver.instance import DEFAULT_ALPHA, alpha_for

    trace = five_block_trace(fwd=0.002, bwd=0.004, rec=0.002)
    assert alpha_for(trace) == DEFAULT_ALPHA  # nothing measured: the documented default
    # live bytes peak at 300 MiB (events 0 and 2 overlap); the measured peak of 360 MiB means 20% over
    events = [
        AllocationEvent(id=i, size_bytes=mib * MiB, alloc_index=a, free_index=f, category=cat, phase=phase)
        for i, (mib, a, f, cat, phase) in enumerate(
            [
                (100, 0, 3, AllocationCategory.activation, Phase.forward),
                (50, 0, 1, AllocationCategory.temp, Phase.forward),
                (200, 1, 4, AllocationCategory.activation, Phase.backward),
            ]
        )
    ]
    data = trace.model_dump()
    data["allocation_trace"] = AllocationTrace(
        source="dispatch_tracker", horizon=4, events=events
    ).model_dump()
    data["measurements"]["peak_device_bytes"] = 360 * MiB
    measured = Trace.model_validate(data)
    assert alpha_for(measured) == pytest.approx(0.2)


# --- CPU device: copies and the host optimizer do not overlap compute (hand-checked serial costs) ---------


def cpu_five_block_trace(fwd: float, bwd: float, rec: float, host_rate: float = 1e12):
    """`five_block_trace` measured on a CPU "device" (the same numbers; only the device type differs)."""
    gpu = five_block_trace(fwd, bwd, rec, host_rate)
    return gpu.model_copy(
        update={"hardware": gpu.hardware.model_copy(update={"device_type": DeviceType.cpu})}
    )


def gpu_and_cpu_costs(policy_args: tuple, fwd: float, bwd: float, rec: float):
    """One policy costed (no margin) on `five_block_trace` and on its CPU twin: (GPU cost, CPU cost)."""
    gpu = five_block_trace(fwd, bwd, rec)
    cpu = cpu_five_block_trace(fwd, bwd, rec)
    return (
        evaluate(gpu, policy(gpu, *policy_args), ROOMY, NO_MARGIN),
        evaluate(cpu, policy(cpu, *policy_args), ROOMY, NO_MARGIN),
    )


def test_copy_overlap_defaults_to_the_trace_device_type():
    gpu = five_block_trace(fwd=0.002, bwd=0.004, rec=0.002)
    cpu = cpu_five_block_trace(fwd=0.002, bwd=0.004, rec=0.002)
    lay = pack(gpu, 32 * MiB)
    assert build_instance(gpu, lay, ROOMY).copy_overlap
    assert not build_instance(cpu, lay, ROOMY).copy_overlap
    # an explicit setting wins over the trace
    assert build_instance(cpu, lay, ROOMY, CostParams(copy_overlap=True)).copy_overlap
    assert not build_instance(gpu, lay, ROOMY, CostParams(copy_overlap=False)).copy_overlap


def test_cpu_everything_fits_costs_the_same_as_on_a_gpu():
    # no copies and no host optimizer: nothing to serialise, so the CPU model changes nothing
    pol_args = (32 * MiB, [[0, 1, 2, 3, 4]], Placement.persistent, 0, [K, C, C, K, K])
    p_gpu, p_cpu = gpu_and_cpu_costs(pol_args, fwd=0.002, bwd=0.004, rec=0.002)
    assert p_cpu.iteration_s == p_gpu.iteration_s
    assert p_cpu.iteration_s == pytest.approx(0.010 + 0.020 + 2 * 0.002 + 32 * MiB / 100e9, abs=1e-9)
    assert p_cpu.breakdown["copy_overlap"] == 0.0 and p_gpu.breakdown["copy_overlap"] == 1.0


def test_cpu_swap_copies_add_to_compute_instead_of_hiding_behind_it():
    args = (32 * MiB, [[0, 1, 2, 3, 4]], Placement.persistent, 0, [K, S, S, S, K])
    p_gpu, p_cpu = gpu_and_cpu_costs(args, fwd=0.0001, bwd=0.0002, rec=0.0001)
    swap16 = 1_677_722  # 16 MiB at 10 GB/s, ns
    # one window: GPU forward = max(5 * 0.1 ms, 3 swap-outs); CPU forward = compute + 3 swap-outs
    assert round(p_gpu.forward_s * 1e9) == 3 * swap16
    assert round(p_cpu.forward_s * 1e9) == 500_000 + 3 * swap16
    # backward: the swap-ins of the only window are exposed before it on both (nothing earlier to hide them)
    assert round(p_cpu.backward_s * 1e9) == 3 * swap16 + 1_000_000
    assert round(p_cpu.iteration_s * 1e9) == 500_000 + 3 * swap16 + 3 * swap16 + 1_000_000 + round(
        32 * MiB / 100e9 * 1e9
    )


def test_cpu_offload_pays_every_upload_gradient_copy_and_host_step_serially():
    trace = cpu_five_block_trace(fwd=0.0001, bwd=0.0002, rec=0.0001)
    pol = policy(trace, 8 * MiB, [[0], [1], [2], [3], [4]], Placement.offloaded, 2, [K] * 5)
    p = evaluate(trace, pol, ROOMY, NO_MARGIN)
    up4, up8 = 419_430, 838_861  # 4 MiB and 8 MiB at 10 GB/s (both directions), ns
    # forward: first upload (chunk 0, 4 MiB), then every window = 0.1 ms compute + the next chunk's upload
    # (chunks 1..3: 8 MiB, chunk 4: 4 MiB)
    fwd = up4 + 5 * 100_000 + 3 * up8 + up4
    assert round(p.forward_s * 1e9) == fwd
    # backward, 2 buffers: chunks 3 and 4 stay resident. Window c = 0.2 ms + upload of c-1 if needed +
    # gradient copy of c+1:  w4: 0;  w3: up8 (chunk 2) + up4 (grad 4);  w2: up8 + up8;  w1: up4 (chunk 0) +
    # up8;  w0: up8 (grad 1)
    bwd = 5 * 200_000 + 5 * up8 + 2 * up4
    assert round(p.backward_s * 1e9) == bwd
    # then chunk 0's gradient copy (4 MiB) and every host Adam step (1e12 B/s: 4 194 ns for 4 MiB,
    # 8 389 ns for 8 MiB), one after the other; no device optimizer (nothing persistent)
    host = 2 * 4_194 + 3 * 8_389
    assert round(p.breakdown["host_optimizer_end_s"] * 1e9) == bwd + up4 + host
    assert round(p.breakdown["host_optimizer_exposed_s"] * 1e9) == up4 + host
    assert round(p.iteration_s * 1e9) == fwd + bwd + up4 + host


def test_cpu_single_buffer_costs_the_same_serial_sum():
    # with one buffer the GPU model serialises upload and compute; the CPU model already does, so one and
    # two buffers differ only by the re-uploads of chunks that two buffers keep resident
    trace = cpu_five_block_trace(fwd=0.0001, bwd=0.0002, rec=0.0001)
    one = evaluate(
        trace,
        policy(trace, 8 * MiB, [[0], [1], [2], [3], [4]], Placement.offloaded, 1, [K] * 5),
        ROOMY,
        NO_MARGIN,
    )
    two = evaluate(
        trace,
        policy(trace, 8 * MiB, [[0], [1], [2], [3], [4]], Placement.offloaded, 2, [K] * 5),
        ROOMY,
        NO_MARGIN,
    )
    assert one.forward_s == two.forward_s
    # one buffer keeps only chunk 4 resident: chunk 3 (8 MiB) is uploaded again in window 4
    assert round((one.backward_s - two.backward_s) * 1e9) == 838_861


def test_cpu_batch_timing_equals_the_reference_model_on_random_decisions():
    rng = np.random.default_rng(11)
    trace = synthetic_trace(n_blocks=6, hidden=512, vocab=5000, batch=2, seq=256)
    for size, duplex in ((8 * MiB, True), (8 * MiB, False), (32 * MiB, True)):
        inst = build_instance(
            trace, pack(trace, size), ROOMY, CostParams(full_duplex=duplex, copy_overlap=False)
        )
        assert_batch_matches_reference(rng, inst, draws=20)


# --- measured runtime costs (the profiler's runtime probe): charged where copies are serial ------------------


def measured_trace(device_type: DeviceType, measured: bool = True):
    """`five_block_trace(0.1 ms, 0.2 ms, 0.1 ms)` plus runtime costs measured per block (or none)."""
    return five_block_trace(0.0001, 0.0002, 0.0001, device_type=device_type, runtime_costs=measured)


def test_cpu_swap_costs_are_the_measured_ones_instead_of_bytes_over_bandwidth():
    args = (32 * MiB, [[0, 1, 2, 3, 4]], Placement.persistent, 0, [K, S, S, S, K])
    cpu = measured_trace(DeviceType.cpu)
    p = evaluate(cpu, policy(cpu, *args), ROOMY, NO_MARGIN)
    # forward: 5 * 0.1 ms compute + 3 measured swap-outs of 3 ms; backward: 3 swap-ins of 2 ms + 5 * 0.2 ms
    assert round(p.forward_s * 1e9) == 500_000 + 3 * 3_000_000
    assert round(p.backward_s * 1e9) == 3 * 2_000_000 + 1_000_000
    # on a GPU the copies overlap compute: the bandwidth model stands, the measured fields change nothing
    gpu, plain_gpu = measured_trace(DeviceType.cuda), measured_trace(DeviceType.cuda, measured=False)
    assert (
        evaluate(gpu, policy(gpu, *args), ROOMY, NO_MARGIN).iteration_s
        == evaluate(plain_gpu, policy(plain_gpu, *args), ROOMY, NO_MARGIN).iteration_s
    )


def test_cpu_offload_costs_once_per_chunk_and_upload_costs_per_upload():
    args = (8 * MiB, [[0], [1], [2], [3], [4]], Placement.offloaded, 2, [K] * 5)
    with_costs, without = measured_trace(DeviceType.cpu), measured_trace(DeviceType.cpu, measured=False)
    p = evaluate(with_costs, policy(with_costs, *args), ROOMY, NO_MARGIN)
    q = evaluate(without, policy(without, *args), ROOMY, NO_MARGIN)
    # five offloaded chunks (0.5 ms each, once) and eight uploads (0.1 ms each): all five in forward, and
    # in backward chunks 0..2 again (two buffers keep chunks 3 and 4 resident)
    assert round((p.iteration_s - q.iteration_s) * 1e9) == 5 * 500_000 + 8 * 100_000
    assert round((p.forward_s - q.forward_s) * 1e9) == 5 * 100_000
    # persistent chunks pay none of it
    persistent = (8 * MiB, [[0], [1], [2], [3], [4]], Placement.persistent, 0, [K] * 5)
    assert (
        evaluate(with_costs, policy(with_costs, *persistent), ROOMY, NO_MARGIN).iteration_s
        == evaluate(without, policy(without, *persistent), ROOMY, NO_MARGIN).iteration_s
    )


def with_forward_part(trace, share: float, step: float = 0.0):
    """`trace` with `share` of every block's measured per-chunk cost paid in forward (`offload_forward_s`) and
    `step` of it in optimizer.step() (`offload_step_s`)."""
    blocks = [
        b.model_copy(
            update={
                "offload_forward_s": share * b.offload_overhead_s,
                "offload_step_s": step * b.offload_overhead_s,
            }
        )
        for b in trace.measurements.blocks
    ]
    return trace.model_copy(update={"measurements": trace.measurements.model_copy(update={"blocks": blocks})})


def every_other_chunk_offloaded(trace):
    """One chunk per block, chunks 0, 2 and 4 offloaded (two buffers), 1 and 3 persistent, every block kept."""
    pol = policy(trace, 8 * MiB, [[0], [1], [2], [3], [4]], Placement.offloaded, 2, [K] * 5)
    for chunk in (1, 3):
        pol.chunks[chunk].placement = Placement.persistent
    return pol


def test_cpu_per_chunk_costs_forward_part_moves_from_backward_to_forward_and_the_iteration_stays():
    # chunks 0, 2 and 4 offloaded (two buffers), 1 and 3 persistent: of each offloaded chunk's 0.5 ms, 0.2 ms
    # is paid in its forward window; moved there from the gradient copy's window (or after backward, chunk 0)
    base = measured_trace(DeviceType.cpu)
    pol = every_other_chunk_offloaded(base)
    split = with_forward_part(base, 0.4)
    p = evaluate(split, pol, ROOMY, NO_MARGIN)
    q = evaluate(base, pol, ROOMY, NO_MARGIN)
    assert p.iteration_s == q.iteration_s
    assert round((p.forward_s - q.forward_s) * 1e9) == 3 * 200_000
    # chunks 2 and 4 copy their gradients in backward windows; chunk 0's after backward (no window after it)
    assert round((q.backward_s - p.backward_s) * 1e9) == 2 * 200_000
    # persistent chunks pay none of it; on a GPU it is not measured (the trace's field changes nothing there)
    for chunk in (0, 2, 4):
        pol.chunks[chunk].placement = Placement.persistent
    assert evaluate(split, pol, ROOMY, NO_MARGIN) == evaluate(base, pol, ROOMY, NO_MARGIN)
    gpu = with_forward_part(measured_trace(DeviceType.cuda), 0.4)
    assert build_instance(gpu, pack(gpu, 8 * MiB), ROOMY, NO_MARGIN).offload_forward_ns == ()


def test_cpu_per_chunk_costs_step_part_moves_from_backward_to_the_step_and_the_iteration_stays():
    # chunks 0, 2 and 4 offloaded: of each one's 0.5 ms, 0.2 ms paid in forward and 0.1 ms in optimizer.step()
    # (its settling); the step's predicted phase holds 0.3 ms more, backward 0.3 ms less (chunk 0's part was
    # after backward, in the host end, before)
    base = measured_trace(DeviceType.cpu)
    pol = every_other_chunk_offloaded(base)
    p = evaluate(with_forward_part(base, 0.4, 0.2), pol, ROOMY, NO_MARGIN)
    q = evaluate(with_forward_part(base, 0.4), pol, ROOMY, NO_MARGIN)
    assert p.iteration_s == q.iteration_s and p.forward_s == q.forward_s
    assert round((p.phases()["step_s"] - q.phases()["step_s"]) * 1e9) == 3 * 100_000
    assert round((q.backward_s - p.backward_s) * 1e9) == 2 * 100_000
    assert round((q.phases()["backward_s"] - p.phases()["backward_s"]) * 1e9) == 3 * 100_000


def test_batch_timing_equals_the_reference_model_with_measured_runtime_costs():
    rng = np.random.default_rng(12)
    for trace in (
        measured_trace(DeviceType.cpu),
        with_forward_part(measured_trace(DeviceType.cpu), 0.4, 0.3),
    ):
        for size in (8 * MiB, 16 * MiB):
            inst = build_instance(trace, pack(trace, size), ROOMY, NO_MARGIN)
            assert not inst.copy_overlap
            assert_batch_matches_reference(rng, inst, draws=20)


def test_a_swapped_blocks_activations_count_through_the_next_forward_where_copies_overlap():
    """Session 17 (one H200): the copy-out of a swapped block still reads its storages while the next block runs
    forward (the runtime lets them go at that block's end: `SwapStore.settle_through`). The walk counts them there
    on a device whose copies overlap compute; on a CPU the copy is synchronous and they are gone at once."""
    args = (32 * MiB, [[0, 1, 2, 3, 4]], Placement.persistent, 0, [K, K, S, K, K])
    p_gpu, p_cpu = gpu_and_cpu_costs(args, fwd=0.001, bwd=0.002, rec=0.001)
    gpu = [p.device_bytes for p in p_gpu.device_memory_timeline]
    cpu = [p.device_bytes for p in p_cpu.device_memory_timeline]
    fwd3 = 3  # forward points come first, one per block in order
    assert gpu[fwd3] - cpu[fwd3] == 16 * MiB  # block 2's activations, still being copied out
    assert [g for i, g in enumerate(gpu) if i != fwd3] == [c for i, c in enumerate(cpu) if i != fwd3]
