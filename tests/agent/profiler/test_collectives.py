"""The collective probe on a real 2-rank gloo group (issue 20): every rank measures, rank 0 profiles and the
one trace of the job says world size, ranks per node, interconnect and the measured collectives."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest
import torch

from agent.profiler import profiling
from agent.profiler.collectives import CollectiveProbeError, ProbeSettings, probe_process_group
from agent.testing import model_zoo
from client.contract import CollectiveBackend, Distributed, Hardware, Trace

KiB = 2**10
SLOW_ROWS = 32
"""Rows of rank 1's batch in `profile(process_group=)` (rank 0's: 2): rank 1 profiles the slowest iteration."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank(rank: int, port: int, out: str, hardware_json: str) -> None:
    import torch.distributed as dist

    from agent.profiler import profile
    from agent.testing.model_zoo import build, sample_batch
    from client.contract import Hardware

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        d = probe_process_group(sizes=(4 * KiB, 64 * KiB), overlap_size=256 * KiB, repeats=3)
        Path(out, f"group{rank}.json").write_text(d.model_dump_json())
        if rank == 0:  # rank 0 profiles and builds the job's one trace
            torch.manual_seed(0)
            model, config = build("gpt2", layers=2, hidden=32, vocab=128, seq=16)
            hw = Hardware.model_validate_json(hardware_json)  # measured once per test session
            trace = profile(
                model,
                sample_batch(config, 2, 16),
                hardware=hw,
                repeats=1,
                allocation_trace=False,
                distributed=d,
            )
            Path(out, "trace.json").write_text(trace.model_dump_json())
        # agent.profile(process_group=): every rank calls it, measures the group and profiles its own model;
        # rank 1's batch is 16x rank 0's, so rank 1 is the slowest
        torch.manual_seed(0)
        model, config = build("gpt2", layers=2, hidden=32, vocab=128, seq=16)
        own = profile(
            model,
            sample_batch(config, SLOW_ROWS if rank == 1 else 2, 16),
            hardware=Hardware.model_validate_json(hardware_json),
            repeats=1,
            allocation_trace=False,
            process_group=dist.new_group([0, 1]),
        )
        Path(out, f"own{rank}.json").write_text(own.model_dump_json())
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory, cpu_hardware: Hardware) -> Path:
    out = tmp_path_factory.mktemp("collectives")
    os.environ.pop("LOCAL_WORLD_SIZE", None)
    args = (_free_port(), str(out), cpu_hardware.model_dump_json())
    torch.multiprocessing.spawn(_rank, args=args, nprocs=2, join=True)
    return out


def test_every_rank_gets_the_same_measured_group(two_ranks: Path) -> None:
    groups = [Distributed.model_validate_json((two_ranks / f"group{r}.json").read_text()) for r in (0, 1)]
    # the slowest rank's medians are kept, so both ranks hold the same figures
    assert groups[0] == groups[1]
    d = groups[0]
    assert (d.world_size, d.ranks_per_node, d.nodes) == (2, 2, 1)
    assert d.interconnect is not None and d.interconnect.backend == CollectiveBackend.gloo
    assert d.interconnect.inter_node is None
    c = d.collectives
    assert c is not None
    assert [s.size_bytes for s in c.all_gather] == [4 * KiB, 64 * KiB]
    assert [s.size_bytes for s in c.reduce_scatter] == [4 * KiB, 64 * KiB]
    assert all(0 < s.bytes_per_s < 1e13 for s in c.all_gather + c.reduce_scatter)
    # one control check (a tiny all-gather read on the host, after a compute burst on the CPU): a latency,
    # measured, so the cost model does not fall back to the smallest all-gather sample
    assert 0 < c.control_s < 1.0
    # and the same call after a phase's worth of compute (4 bursts): what the checks at a phase's end pay
    assert 0 < c.phase_control_s < 1.0
    pairs = {(o.collective, o.direction) for o in c.copy_overlap}
    assert pairs == {("all_gather", "h2d"), ("reduce_scatter", "d2h")}
    for o in c.copy_overlap:
        assert o.collective_s > 0 and o.copy_s > 0 and o.concurrent_s > 0 and 0.0 <= o.factor <= 1.0


def test_rank_zero_builds_one_trace_for_the_job(two_ranks: Path) -> None:
    trace = Trace.model_validate_json((two_ranks / "trace.json").read_text())
    assert trace.hardware.world_size == 2 and trace.hardware.ranks_per_node == 2
    assert trace.hardware.key.endswith(":x2:w2r2") and trace.hardware.device_count == 2
    group = json.loads((two_ranks / "group0.json").read_text())
    assert json.loads(trace.hardware.distributed.model_dump_json()) == group  # type: ignore[union-attr]


def test_profile_with_the_group_measures_it_on_every_rank(two_ranks: Path) -> None:
    traces = [Trace.model_validate_json((two_ranks / f"own{r}.json").read_text()) for r in (0, 1)]
    groups = [t.hardware.distributed for t in traces]
    assert groups[0] is not None and groups[0] == groups[1]  # the same figures on both ranks (slowest rank's)
    assert (groups[0].world_size, groups[0].ranks_per_node) == (2, 2)
    assert all(t.hardware.key.endswith(":x2:w2r2") for t in traces)
    # every rank profiled at once and returns the job's trace: the slowest rank's (rank 1's 32-row batch), as
    # agent.wrap plans; before, each rank returned its own and rank 0's (the fastest) was written as the job's
    assert traces[0] == traces[1]
    assert traces[0].workload.batch_size == SLOW_ROWS
    # sized to the model (rank 0's settings, broadcast): its parameter bytes, not the 128 MiB default
    c = groups[0].collectives
    expected = ProbeSettings.for_model(traces[0].model.parameter_count * 4)
    assert c is not None and [s.size_bytes for s in c.all_gather] == list(expected.sizes)
    assert {o.copy_bytes for o in c.copy_overlap} == {expected.overlap_size}


def test_profile_refuses_a_group_and_an_earlier_probe_together(cpu_hardware: Hardware) -> None:
    model, config = model_zoo.build("gpt2", layers=2, hidden=32, vocab=128, seq=16)
    d = Distributed(world_size=1, ranks_per_node=1)
    with pytest.raises(ValueError, match="process_group: given with distributed="):
        profiling.profile(
            model,
            model_zoo.sample_batch(config, 2, 16),
            hardware=cpu_hardware,
            distributed=d,
            process_group=object(),
        )
    with pytest.raises(ValueError, match="process_group: given, but torch.distributed is not initialised"):
        profiling.profile(
            model, model_zoo.sample_batch(config, 2, 16), hardware=cpu_hardware, process_group=object()
        )


def test_the_probe_refuses_without_a_process_group() -> None:
    with pytest.raises(CollectiveProbeError, match="not initialised"):
        probe_process_group()


def test_a_one_rank_group_is_a_single_process_job_without_collectives() -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        d = probe_process_group()
    finally:
        dist.destroy_process_group()
    assert (d.world_size, d.ranks_per_node, d.collectives) == (1, 1, None)
    assert d.interconnect is not None and d.interconnect.backend == CollectiveBackend.gloo
