"""Per-rank device peaks of sharded plans with swapped and checkpointed blocks match the plan (issue 20).

Issue 20's bound: a rank's measured peak is within the single-process bounds, never more than 2% over the
prediction. Two forked gloo ranks on CPU train a small llama under a 2-rank plan (every offloaded chunk
sharded; one plan swaps the middle blocks, one checkpoints them) and each compares the peak the runtime's
meter measured (`wrapped.monitor.measured`) with the plan's `predictions.peak_device_bytes`.

Before the fix the CPU meter (`agent.measure`, the profiler's storage tracker) read the outputs of every
collective (reduce-scatter into the host gradient, all-gathers into `.grad` and the compute copy) as new
allocations, and the host worker's inline temporaries as device memory: +20% to +30% here.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from ddp_jobs import free_port

import agent
from agent.runtime import RuntimeOptions
from agent.testing.model_zoo import build, sample_batch
from client.contract import ActivationMode, Constraints, Placement, Plan
from planner_service.solver import solve
from planner_service.solver.cost_model import evaluate
from planner_service.solver.testing.synthetic import synthetic_distributed, with_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

WORLD = 2
ROWS = 2  # per rank
STEPS = 5
LOW, HIGH = -0.08, 0.02  # the single-process bounds: at most 8% under, never more than 2% over
STRIPS = {"swap": "KSSSKK", "checkpoint": "KCCCCK"}


def model_and_batch() -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    model, cfg = build("llama", layers=4, hidden=64, seq=64, seed=0)
    return model, sample_batch(cfg, ROWS * WORLD, 64)


def two_rank_plans(strips: dict[str, str], *, device: bool = False) -> dict[str, Plan]:
    """The solver's chunk layout at world size 2, then every chunk but the last offloaded and sharded, one
    buffer, the blocks' modes from each strip (K keep, C checkpoint, S swap); predictions from the cost model
    for exactly that policy. `device`: every chunk persistent and sharded on the device instead (ZeRO-3), no
    buffer."""
    model, full = model_and_batch()
    batch = {k: v[:ROWS] for k, v in full.items()}
    probe = copy.deepcopy(model)
    trace = agent.profile(
        probe,
        batch,
        optimizer=torch.optim.AdamW(probe.parameters(), lr=1e-3, fused=True),
        repeats=1,
        allocation_trace=False,
    )
    trace = with_distributed(trace, synthetic_distributed(WORLD))  # collectives' rates: not a peak term
    cons = Constraints(device_memory_bytes=int(trace.measurements.peak_device_bytes * 0.6), time_limit_s=5.0)
    plan = solve(trace, cons)
    assert plan.policy is not None, plan.solver.message
    p = plan.policy
    last = len(p.chunks) - 1
    chunks = [
        c.model_copy(
            update={
                "placement": Placement.offloaded if c.index < last and not device else Placement.persistent,
                "sharded": c.index < last or device,
            }
        )
        for c in p.chunks
    ]
    plans = {}
    for name, strip in strips.items():
        assert len(strip) == len(p.blocks), (strip, p.mode_strip())
        blocks = [
            b.model_copy(update={"mode": ActivationMode.from_letter(m)})
            for b, m in zip(p.blocks, strip, strict=True)
        ]
        pol = p.model_copy(update={"chunks": chunks, "blocks": blocks, "n_buffers": 0 if device else 1})
        plans[name] = plan.model_copy(update={"policy": pol, "predictions": evaluate(trace, pol, cons)})
    return plans


def _rank(rank: int, world: int, port: int, plans: dict[str, str], out: str) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from agent.wrapping import unwrap  # local import: as the benchmark's rows end

        model, full = model_and_batch()
        batch = {k: v[rank * ROWS : (rank + 1) * ROWS] for k, v in full.items()}
        peaks = {}
        for name, plan_json in plans.items():
            m = copy.deepcopy(model)
            w = agent.wrap(
                m,
                torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True),
                plan=Plan.model_validate_json(plan_json),
                options=RuntimeOptions(device=torch.device("cpu")),
                feedback_steps=STEPS,
                feedback_path=Path(out) / f"feedback{rank}.jsonl",
            )
            for _ in range(STEPS):
                w.model(**batch).loss.backward()
                w.optimizer.step()
                w.optimizer.zero_grad()
            assert w.monitor is not None
            peaks[name] = w.monitor.measured.peak_device_bytes
            ds = w.runtime.device_shards
            peaks[f"{name}/gathered"] = ds.max_gathered_bytes if ds is not None else 0
            unwrap(w)
        (Path(out) / f"rank{rank}.json").write_text(json.dumps(peaks))
    finally:
        dist.destroy_process_group()


def rank_peaks(plans: dict[str, Plan], tmp_path: Path) -> list[dict[str, int]]:
    """Train every plan on WORLD forked gloo ranks; each rank's measured peaks, by plan name (and, per plan,
    `<name>/gathered`: the most device-shard whole copies held at once)."""
    mp.start_processes(
        _rank,
        args=(WORLD, free_port(), {k: v.model_dump_json() for k, v in plans.items()}, str(tmp_path)),
        nprocs=WORLD,
        join=True,
        start_method="fork",
    )
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]


def test_measured_peak_per_rank_is_within_bounds_of_the_sharded_plan_with_swap_and_checkpoint(
    tmp_path: Path,
) -> None:
    plans = two_rank_plans(STRIPS)
    for plan in plans.values():
        assert plan.policy is not None and plan.policy.world_size == WORLD
        assert len(plan.policy.sharded_chunks) == len(plan.policy.chunks) - 1 > 0
    assert plans["swap"].policy.mode_strip().count("S") >= 2  # type: ignore[union-attr]
    assert plans["checkpoint"].policy.mode_strip().count("C") >= 2  # type: ignore[union-attr]
    errors = {}
    for r, peaks in enumerate(rank_peaks(plans, tmp_path)):
        for name, plan in plans.items():
            assert plan.predictions is not None
            errors[(r, name)] = peaks[name] / plan.predictions.peak_device_bytes - 1.0
    print({k: f"{v:+.2%}" for k, v in errors.items()})
    assert all(LOW <= e <= HIGH for e in errors.values()), errors


def test_measured_peak_per_rank_is_within_bounds_of_a_plan_sharding_every_chunk_on_the_device(
    tmp_path: Path,
) -> None:
    """Every chunk persistent and sharded on the device (ZeRO-3, `agent/runtime/device_shards.py`): the rank's
    shards, its whole gradient and the gathered copies (the planner counts two of the largest) against the
    plan's per-rank peak, keeping and checkpointing the middle blocks."""
    plans = two_rank_plans({"keep": "KKKKKK", "checkpoint": "KCCCCK"}, device=True)
    for plan in plans.values():
        assert plan.policy is not None and len(plan.policy.sharded_chunks) == len(plan.policy.chunks) > 1
        assert not any(c.placement == Placement.offloaded for c in plan.policy.chunks)
    errors = {}
    for r, peaks in enumerate(rank_peaks(plans, tmp_path)):
        for name, plan in plans.items():
            assert plan.predictions is not None
            # the CPU meter (a storage tracker) sees a storage's size when it is created: the whole copies, resized
            # in place from 0 bytes when gathered, are invisible to it; the runtime's own count of the most
            # gathered at once is added
            assert peaks[f"{name}/gathered"] > 0
            measured = peaks[name] + peaks[f"{name}/gathered"]
            errors[(r, name)] = measured / plan.predictions.peak_device_bytes - 1.0
    print({k: f"{v:+.2%}" for k, v in errors.items()})
    assert all(LOW <= e <= HIGH for e in errors.values()), errors
