"""The host copy probe copies more than the last-level cache, as the runtime's copies of whole chunks do (a copy
that fits the cache reads fast: 11.7 GB/s for 16 MiB against 8.5-8.8 GB/s for 256-512 MiB on a 32 MiB-L3 VM)."""

from __future__ import annotations

from pathlib import Path

from agent.profiler.optimizer_probe import (
    ASSUMED_CACHE_BYTES,
    COPY_SAMPLE_MAX_BYTES,
    COPY_SAMPLE_MIN_BYTES,
    host_copy_sample_bytes,
    host_copy_throughput,
    last_level_cache_bytes,
)

MiB = 2**20


def _cache(root: Path, *sizes: str) -> Path:
    for i, size in enumerate(sizes):
        (root / f"index{i}").mkdir(parents=True)
        (root / f"index{i}" / "size").write_text(size + "\n")
    return root


def test_the_largest_cache_the_os_reports_is_the_last_level(tmp_path: Path) -> None:
    assert last_level_cache_bytes(_cache(tmp_path / "a", "48K", "2048K", "300M")) == 300 * MiB
    assert last_level_cache_bytes(_cache(tmp_path / "b", "32K", "1M", "32768K")) == 32 * MiB
    assert last_level_cache_bytes(tmp_path / "none") is None  # no sysfs (a container, another OS)
    assert last_level_cache_bytes(_cache(tmp_path / "c", "unknown")) is None


def test_the_copy_sample_is_twice_the_cache_within_its_bounds() -> None:
    assert host_copy_sample_bytes(32 * MiB) == 64 * MiB
    assert host_copy_sample_bytes(100 * MiB) == 200 * MiB
    assert host_copy_sample_bytes(300 * MiB) == COPY_SAMPLE_MAX_BYTES  # the H200's host: 512 MiB, not 600
    assert host_copy_sample_bytes(4 * MiB) == COPY_SAMPLE_MIN_BYTES
    assert host_copy_sample_bytes(0) == max(COPY_SAMPLE_MIN_BYTES, 2 * ASSUMED_CACHE_BYTES)


def test_this_hosts_copy_rate_is_measured() -> None:
    rate = host_copy_throughput()
    assert 1e8 < rate < 1e12  # bytes written per second: a real measurement, not a default
