"""Concurrent copies (issue 19 item 10c): a window that copies both ways is charged the duplex rates.

The trace's `duplex_h2d_pinned` / `duplex_d2h_pinned` curves are H2D and D2H measured running at the same
time. The cost model (evaluate, the vectorised timer and the CP-SAT model alike) charges them in the windows
where uploads or swap-ins overlap gradient offloads or swap-outs, and the one-direction curves elsewhere; a
trace without them (every trace from before they were measured) solves exactly as before.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from client.contract import BandwidthSample, Constraints, Placement, Trace
from planner_service.solver.bandwidth import transfer_ns
from planner_service.solver.chunk_grid import candidate_layouts, pack
from planner_service.solver.cost_model import evaluate
from planner_service.solver.cpsat_solve import solve_layout
from planner_service.solver.entry import solve
from planner_service.solver.instance import CostParams, build_instance
from planner_service.solver.testing.synthetic import synthetic_trace
from tests.planner_service.solver.test_cost_model import (
    ROOMY,
    K,
    S,
    assert_batch_matches_reference,
    five_block_trace,
    policy,
)
from tests.planner_service.solver.test_policy_bruteforce import (
    assert_cpsat_matches_brute_force,
    limits_between_extremes,
    random_trace,
)

MiB = 2**20
NO_MARGIN = CostParams(alpha=0.0)


def with_duplex(trace: Trace, up: float | None = None, down: float | None = None) -> Trace:
    """`trace` with flat duplex curves at `up` / `down` bytes/s (default: each direction's own curve)."""
    bw = trace.hardware.bandwidth
    flat = lambda rate: [BandwidthSample(size_bytes=1, bytes_per_s=rate)]  # noqa: E731
    curves = bw.model_copy(
        update={
            "duplex_h2d_pinned": flat(up) if up is not None else list(bw.h2d_pinned),
            "duplex_d2h_pinned": flat(down) if down is not None else list(bw.d2h_pinned),
        }
    )
    # validated again, as an upload would be
    return Trace.model_validate(
        trace.model_copy(
            update={"hardware": trace.hardware.model_copy(update={"bandwidth": curves})}
        ).model_dump()
    )


def test_windows_that_copy_both_ways_pay_the_concurrent_rates():
    # 10 GB/s each way alone, 5 GB/s each way at the same time
    single = five_block_trace(fwd=0.0001, bwd=0.0002, rec=0.0001)
    duplex = with_duplex(single, up=5e9, down=5e9)
    pol = policy(single, 8 * MiB, [[0], [1], [2], [3], [4]], Placement.offloaded, 2, [K, S, S, S, K])
    a = evaluate(single, pol, ROOMY, NO_MARGIN)
    b = evaluate(duplex, pol, ROOMY, NO_MARGIN)
    alone, both = single.hardware.bandwidth.h2d_pinned, duplex.hardware.bandwidth.duplex_h2d_pinned
    # forward windows 1..3 upload the next chunk (8, 8, 4 MiB) while swapping out 16 MiB: paced by the
    # swap-out, 1 677 722 ns alone, 3 355 443 ns beside the upload; window 0 (no swap-out) and window 4 (no
    # upload) copy one way only and keep the one-direction rate
    swap_alone, swap_both = transfer_ns(alone, 16 * MiB), transfer_ns(both, 16 * MiB)
    assert (swap_alone, swap_both) == (1_677_722, 3_355_443)
    assert round((b.forward_s - a.forward_s) * 1e9) == 3 * (swap_both - swap_alone)
    assert b.iteration_s > a.iteration_s


def test_windows_that_copy_one_way_keep_the_one_direction_rate():
    # keep everything, offload every chunk: forward only uploads (one way); backward uploads and copies
    # gradients out in the same windows (both ways)
    single = five_block_trace(fwd=0.0001, bwd=0.0002, rec=0.0001)
    duplex = with_duplex(single, up=5e9, down=5e9)
    pol = policy(single, 8 * MiB, [[0], [1], [2], [3], [4]], Placement.offloaded, 2, [K] * 5)
    a = evaluate(single, pol, ROOMY, NO_MARGIN)
    b = evaluate(duplex, pol, ROOMY, NO_MARGIN)
    assert b.forward_s == a.forward_s
    # backward windows 3..1 re-upload chunks 2..0 while chunk 4..2's gradients go out: 8 MiB each way
    # (window 1: a 4 MiB upload of chunk 0 beside chunk 2's 8 MiB of gradients); at 5 GB/s instead of 10
    up8 = transfer_ns(single.hardware.bandwidth.h2d_pinned, 8 * MiB)
    up8x = transfer_ns(duplex.hardware.bandwidth.duplex_h2d_pinned, 8 * MiB)
    assert round((b.backward_s - a.backward_s) * 1e9) == 3 * (up8x - up8)


def test_half_duplex_and_serial_links_ignore_the_concurrent_curves():
    single = five_block_trace(fwd=0.0001, bwd=0.0002, rec=0.0001)
    duplex = with_duplex(single, up=5e9, down=5e9)
    pol = policy(single, 8 * MiB, [[0], [1], [2], [3], [4]], Placement.offloaded, 2, [K, S, S, S, K])
    for params in (CostParams(alpha=0.0, full_duplex=False), CostParams(alpha=0.0, copy_overlap=False)):
        assert evaluate(duplex, pol, ROOMY, params) == evaluate(single, pol, ROOMY, params)


def test_vectorised_timer_equals_the_reference_model_with_concurrent_curves():
    rng = np.random.default_rng(11)
    trace = synthetic_trace(n_blocks=6, hidden=512, vocab=5000, batch=2, seq=256)
    bw = trace.hardware.bandwidth
    duplex = with_duplex(
        trace, up=0.6 * bw.h2d_pinned[-1].bytes_per_s, down=0.7 * bw.d2h_pinned[-1].bytes_per_s
    )
    for size in (8 * MiB, 32 * MiB):
        inst = build_instance(duplex, pack(duplex, size), ROOMY, CostParams())
        assert inst.duplex
        assert_batch_matches_reference(rng, inst, draws=30)


@pytest.mark.parametrize("seed", [0, 2, 6])
def test_cpsat_optimum_equals_brute_force_with_concurrent_curves(seed: int):
    rng = np.random.default_rng(1000 + seed)
    trace = random_trace(rng, n_blocks=int(rng.integers(3, 9)))
    cons = limits_between_extremes(rng, trace)
    bw = trace.hardware.bandwidth
    duplex = with_duplex(
        trace,
        up=float(rng.uniform(0.3, 0.9)) * bw.h2d_pinned[0].bytes_per_s,
        down=float(rng.uniform(0.3, 0.9)) * bw.d2h_pinned[0].bytes_per_s,
    )
    assert assert_cpsat_matches_brute_force(duplex, cons, CostParams(alpha=0.05)) >= 1


def _random_case() -> tuple[Trace, Constraints]:
    rng = np.random.default_rng(1002)  # a seed of the brute-force tests whose limits leave layouts feasible
    trace = random_trace(rng, n_blocks=int(rng.integers(3, 9)))
    return trace, limits_between_extremes(rng, trace)


def _half_the_state(trace: Trace) -> tuple[Trace, Constraints]:
    state = 4 * sum(p.bytes for p in trace.model.parameters)
    return trace, Constraints(device_memory_bytes=max(state // 2, 64 * MiB), time_limit_s=60)


@pytest.mark.parametrize(
    "make",
    [
        lambda: _half_the_state(synthetic_trace(n_blocks=6, hidden=512, vocab=5000, batch=2, seq=256)),
        lambda: _half_the_state(five_block_trace(fwd=0.0001, bwd=0.0002, rec=0.0001)),
        _random_case,
    ],
    ids=["synthetic", "five-block", "random"],
)
def test_traces_without_concurrent_curves_solve_as_before(make) -> None:
    # a trace without the curves (as every trace from before them) builds no concurrent terms; and one whose
    # concurrent curves equal the one-direction ones (nothing slows down when both run) solves to the same
    # plan and objective through the model that has them
    old, tight = make()
    assert not old.hardware.bandwidth.has_duplex
    # its JSON (and so its content hash, the plan's trace_hash) is what it was before the curves existed
    assert b"duplex" not in old.canonical_json()
    same = with_duplex(old)
    layout = candidate_layouts(old)[-1]
    assert not build_instance(old, layout, tight).duplex
    assert not build_instance(same, layout, tight).duplex  # equal figures: no terms to add
    a, b = solve(old, tight), solve(same, tight)
    assert a.solver.status == b.solver.status
    assert a.solver.objective == b.solver.objective
    assert a.policy == b.policy
    assert a.predictions == b.predictions
    # the concurrent terms themselves, forced in with the one-direction figures, change no layout's optimum
    for lay in candidate_layouts(old):
        inst = build_instance(old, lay, tight)
        forced = replace(
            inst,
            swap_out_duplex_ns=inst.swap_out_ns,
            swap_in_duplex_ns=inst.swap_in_ns,
            upload_duplex_ns=inst.upload_ns,
            grad_offload_duplex_ns=inst.grad_offload_ns,
        )
        assert forced.duplex
        x = solve_layout(inst, hint=None, time_limit_s=60, seed=0, gap_limit=0.0)
        y = solve_layout(forced, hint=None, time_limit_s=60, seed=0, gap_limit=0.0)
        assert x.status == y.status
        assert (x.cost and x.cost.iteration_ns) == (y.cost and y.cost.iteration_ns)
    # the limit makes the plan copy (so the concurrent terms were in the model): slower concurrent copies
    # change its time
    assert a.policy is not None and any(c.placement == Placement.offloaded for c in a.policy.chunks)
    bw = old.hardware.bandwidth
    slower = solve(
        with_duplex(old, up=bw.h2d_pinned[0].bytes_per_s / 4, down=bw.d2h_pinned[0].bytes_per_s / 4), tight
    )
    assert slower.solver.objective is not None and a.solver.objective is not None
    assert slower.solver.objective > a.solver.objective
