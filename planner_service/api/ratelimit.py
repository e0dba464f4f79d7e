"""Per-token token-bucket rate limiting (in process): 429 with Retry-After when a bucket is empty."""

from __future__ import annotations

import math
import threading
import time


class TokenBuckets:
    """One bucket per key, refilled at `rate` per second up to `burst`. Thread-safe; memory bounded."""

    def __init__(self, rate: float, burst: int, max_keys: int = 100_000) -> None:
        self.rate, self.burst, self.max_keys = rate, burst, max_keys
        self._buckets: dict[str, tuple[float, float]] = {}
        self._lock = threading.Lock()

    def take(self, key: str, now: float | None = None) -> float:
        """Take one token; returns 0.0 if allowed, else the seconds until one is available."""
        now = time.monotonic() if now is None else now
        with self._lock:
            tokens, last = self._buckets.get(key, (float(self.burst), now))
            tokens = min(float(self.burst), tokens + (now - last) * self.rate)
            if tokens >= 1.0:
                self._buckets[key] = (tokens - 1.0, now)
                return 0.0
            self._buckets[key] = (tokens, now)
            if len(self._buckets) > self.max_keys:  # forget the idle: a full bucket needs no memory
                self._buckets = {k: v for k, v in self._buckets.items() if v[0] < self.burst - 1}
            return (1.0 - tokens) / self.rate


def retry_after_header(wait_s: float) -> str:
    return str(max(1, math.ceil(wait_s)))
