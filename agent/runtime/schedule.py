"""Access schedule: the order in which chunks are demanded in forward and in backward.

Recorded during the first iteration, then used to prefetch (the next chunks in the recorded order) and
to choose which resident chunk to evict (the one whose next use is furthest away, Belady's rule). Until
a recording exists, chunk index order stands in for execution order (forward ascending, backward
descending), which is what the plan's chunk order means.
"""

from __future__ import annotations

import math
from enum import StrEnum


class Direction(StrEnum):
    forward = "forward"
    backward = "backward"


class AccessSchedule:
    def __init__(self, offloaded: list[int]) -> None:
        self.offloaded = sorted(offloaded)
        self.recorded: dict[Direction, list[int]] = {}
        self._recording: list[int] | None = None
        self.direction = Direction.forward
        self.pos = -1
        self.current: int | None = None

    def start(self, direction: Direction, *, record: bool) -> None:
        if self._recording is not None and self.direction not in self.recorded:
            self.recorded[self.direction] = self._recording
        self.direction = direction
        self.pos = -1
        self.current = None
        self._recording = [] if record and direction not in self.recorded else None

    def finish_recording(self) -> None:
        if self._recording is not None and self.direction not in self.recorded:
            self.recorded[self.direction] = self._recording
        self._recording = None

    def demand(self, chunk: int) -> None:
        if chunk == self.current:
            return
        self.current = chunk
        if self._recording is not None:
            self._recording.append(chunk)
            return
        seq = self.recorded.get(self.direction)
        if seq is None:
            return
        for i in range(self.pos + 1, len(seq)):
            if seq[i] == chunk:
                self.pos = i
                return

    def upcoming(self, limit: int) -> list[int]:
        """The next distinct chunks expected after the current one, nearest first."""
        seq = self.recorded.get(self.direction)
        out: list[int] = []
        if seq is not None and self._recording is None:
            for c in seq[self.pos + 1 :]:
                if c != self.current and c not in out:
                    out.append(c)
                    if len(out) == limit:
                        break
            return out
        if self.current is None:
            return []
        if self.direction == Direction.forward:
            return [c for c in self.offloaded if c > self.current][:limit]
        return [c for c in reversed(self.offloaded) if c < self.current][:limit]

    def next_use(self, chunk: int) -> float:
        """Distance (in demands) to the chunk's next use in this phase; inf if not used again."""
        if chunk == self.current:
            return 0.0
        seq = self.recorded.get(self.direction)
        if seq is not None and self._recording is None:
            for i in range(self.pos + 1, len(seq)):
                if seq[i] == chunk:
                    return float(i - self.pos)
            return math.inf
        if self.current is None:
            return math.inf
        ahead = chunk - self.current if self.direction == Direction.forward else self.current - chunk
        return float(ahead) if ahead > 0 else math.inf
