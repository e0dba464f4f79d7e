"""What-if for multi-rank jobs (issue 20): a catalogue entry's process group, modelled from its peer link.

The rule (docs/architecture/hardware.md, "Peer links"), for one node of N devices:
- the link between peers is the entry's `peer_link` (NVLink through NVSwitch) at its sustained rate; an
  entry without one reaches its peers over PCIe through the host, at the host link's sustained rate
  (the smaller direction);
- all-gather and reduce-scatter run as rings: each rank moves (N - 1)/N of the whole tensor over its link,
  in N - 1 steps of `catalog.COPY_LATENCY_S` set-up each, so a whole tensor of S bytes takes
  (N - 1) * latency + (N - 1)/N * S / rate;
- collectives on a separate peer link overlap host copies fully (factor 1); over PCIe they share the host
  link with the copies and are serialised with them (factor 0).
Several nodes need the network between them, which the catalogue does not hold: refused, naming it.
"""

from __future__ import annotations

from client.contract import (
    CatalogEntry,
    CollectiveBackend,
    CollectiveCopyOverlap,
    CollectiveCurves,
    CollectiveSample,
    Distributed,
    Interconnect,
    Trace,
)
from planner_service.whatif.catalog import _CURVE_SIZES, COPY_LATENCY_S


class GroupNotModelled(ValueError):
    """A process group the catalogue cannot describe (several nodes); the message names the option."""


def peer_rate(entry: CatalogEntry) -> tuple[float, str, bool]:
    """(sustained bytes/s per direction to the peers, the link's name, whether it is separate from the
    host link)."""
    if entry.peer_link is not None:
        p = entry.peer_link
        return p.sustained_bytes_per_s, f"nvlink {p.generation} (catalogue)", True
    h = entry.host_link
    name = f"pcie {h.pcie_generation} x{h.lanes} through the host" if h.pcie_generation else "host link"
    return min(h.h2d_bytes_per_s, h.d2h_bytes_per_s), name, False


def ring_seconds(size_bytes: int, world_size: int, rate: float) -> float:
    """A ring all-gather or reduce-scatter of a whole tensor of `size_bytes` across `world_size` ranks."""
    steps = world_size - 1
    return steps * COPY_LATENCY_S + steps / world_size * size_bytes / rate


def modelled_group(entry: CatalogEntry, world_size: int, ranks_per_node: int | None = None) -> Distributed:
    """The process group of `world_size` devices of `entry` in one node, by the rule above."""
    per_node = ranks_per_node if ranks_per_node is not None else world_size
    if per_node != world_size:
        raise GroupNotModelled(
            f"ranks_per_node: {per_node} ranks per node of {world_size} means several nodes; the catalogue "
            "has no inter-node network figures (what-if models one node: give --ranks-per-node equal to "
            "--world-size)"
        )
    rate, link, separate = peer_rate(entry)
    if world_size == 1:
        return Distributed(world_size=1, ranks_per_node=1)
    curve = [
        CollectiveSample(size_bytes=s, bytes_per_s=s / ring_seconds(s, world_size, rate))
        for s in _CURVE_SIZES
    ]
    factor = 1.0 if separate else 0.0
    # recorded as the times that give `factor` (1 s each alone; together 2 - factor s), as a measurement would
    overlap = [
        CollectiveCopyOverlap(
            collective=c,
            direction=d,
            collective_bytes=_CURVE_SIZES[-1],
            copy_bytes=_CURVE_SIZES[-1],
            collective_s=1.0,
            copy_s=1.0,
            concurrent_s=2.0 - factor,
        )
        for c, d in (("all_gather", "h2d"), ("reduce_scatter", "d2h"))
    ]
    return Distributed(
        world_size=world_size,
        ranks_per_node=per_node,
        interconnect=Interconnect(backend=CollectiveBackend.nccl, intra_node=f"{link}, modelled"),
        collectives=CollectiveCurves(all_gather=curve, reduce_scatter=list(curve), copy_overlap=overlap),
    )


def in_group(
    trace: Trace,
    entry: CatalogEntry,
    world_size: int,
    ranks_per_node: int | None = None,
    *,
    node_host_memory_bytes: int | None = None,
) -> Trace:
    """`trace` (modelled or retargeted to `entry`) as one rank of a job of `world_size` devices in one node.

    The node's host RAM is `node_host_memory_bytes` when given, else the entry's typical host per device
    times the ranks on the node (the catalogue's host is one device's share of an instance)."""
    if world_size == 1:
        return trace
    group = modelled_group(entry, world_size, ranks_per_node)
    host = (
        node_host_memory_bytes
        if node_host_memory_bytes is not None
        else entry.host_memory_bytes * group.ranks_per_node
    )
    hw = trace.hardware.model_copy(
        update={"distributed": group, "device_count": group.ranks_per_node, "host_memory_bytes": host}
    )
    return Trace.model_validate_json(trace.model_copy(update={"hardware": hw}).model_dump_json())
