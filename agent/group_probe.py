"""Rank 0 plans a multi-rank job from a trace that carries the whole group (issue 20); every rank measures it.

Under a process group `agent.wrap` obtains the plan once, on rank 0 (history, the service, or profiling and
solving in-process), and broadcasts it. That plan is the job's, not rank 0's alone: it may shard offloaded
chunks across the ranks and it times the collectives that sharding and the gradient average add, so the trace
rank 0 profiles must say the world size, the ranks per node and what the collectives achieve on this group
(`Hardware.distributed`). `collectives.probe_process_group` measures that, and it is a collective: every rank
calls it, with the same sizes, or none does. Only rank 0 knows whether it will profile (a plan given to wrap,
or no sample batch, needs no probe), so rank 0 decides and broadcasts the decision together with the sizes
(`ProbeSettings`, scaled to the model so a small model's probe stays short); every rank then probes or not.

A plan from the service's history is found after the probe (the history look-up needs the hardware key, and
the key names the ranks per node, which takes a collective to learn): a history hit pays for a probe it does
not use, one `ProbeSettings.for_model` probe (see docs/architecture/runtime.md, "Multi-process jobs").
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from agent.profiler.collectives import ProbeSettings, probe_process_group

if TYPE_CHECKING:
    from torch import nn

    from agent.runtime.process_group import RankGroup
    from client.contract import Distributed

log = logging.getLogger(__name__)


def parameter_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters (the most one chunk of its plan can hold)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def probe_for_planning(group: RankGroup, profiled: nn.Module | None) -> Distributed | None:
    """The job's group as measured on every rank, or None when rank 0 will not profile. Every rank of `group`
    calls this (it broadcasts, then probes on every rank or on none). `profiled`: on rank 0, the model when
    rank 0 is about to profile it for a plan, else None; the other ranks' argument is not read."""
    settings: ProbeSettings | None = group.broadcast_object(
        ProbeSettings.for_model(parameter_bytes(profiled)) if group.is_main and profiled is not None else None
    )
    if settings is None:
        return None
    started = time.perf_counter()
    distributed = probe_process_group(
        group.group,
        group.device,
        sizes=settings.sizes,
        overlap_size=settings.overlap_size,
        repeats=settings.repeats,
    )
    log.info(
        "memplan: measured the collectives of the %d-rank group (%s, sizes up to %d bytes) in %.2f s",
        group.world_size,
        group.backend,
        max(settings.sizes),
        time.perf_counter() - started,
    )
    return distributed
