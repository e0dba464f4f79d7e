"""Shards of a sharded offloaded chunk (issue 20, docs/architecture/runtime.md "Sharded chunks").

A chunk marked `sharded` in a job of N ranks is cut into N equal shards of `s` elements
(`client.contract.shard_elements`, the function the planner counts with): `s` is the chunk's
padded element count divided by N, rounded up to a multiple of 4 elements (16 bytes in fp32, so every shard
starts aligned), and the flat chunk is zero padded to N*s. Rank r owns elements [r*s, (r+1)*s): it keeps the
master, host gradient, staging buffer and optimizer state of that range only (the last shards may cover
padding only). The compute copy and the gradient users see stay whole on every rank (the compute copy once per
node where the ranks share it: `node_shared.py`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Shard:
    """This rank's range of a sharded chunk."""

    rank: int
    world_size: int
    size: int  # s: elements per rank

    @property
    def start(self) -> int:
        return self.rank * self.size

    @property
    def end(self) -> int:
        return self.start + self.size

    @property
    def total(self) -> int:
        """Elements of the zero-padded flat chunk (N*s): what the collectives move."""
        return self.world_size * self.size
