"""The hardware catalogue: the shipped entries plus the user's, and a catalogue entry as a contract Hardware.

The shipped entries live in `catalog.json` next to this module (every figure sourced in
docs/architecture/hardware.md). Users add or override entries with files of the same shape
(`{"entries": [...]}`), given by `--catalog FILE` or the `MEMPLAN_CATALOG` environment variable
(several files separated by the path separator); a user entry with a shipped key replaces it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from functools import cache
from importlib import resources
from pathlib import Path

from pydantic import ValidationError

from client.contract import (
    BandwidthCurves,
    BandwidthSample,
    CatalogEntry,
    DeviceType,
    Hardware,
    HardwareCatalog,
)

CATALOG_ENV = "MEMPLAN_CATALOG"

# Copy latency assumed for the bandwidth curves built from an entry's sustained rates: a copy of s bytes
# takes COPY_LATENCY_S + s / rate (an estimate of launch + DMA setup; it matters only for small copies).
COPY_LATENCY_S = 10e-6
_CURVE_SIZES = (64 * 2**10, 2**20, 16 * 2**20, 64 * 2**20, 256 * 2**20)


class CatalogError(ValueError):
    """A catalogue file is unreadable or invalid, or a key names no entry."""


@cache
def shipped() -> HardwareCatalog:
    """The catalogue shipped with memplan (validated once per process)."""
    text = resources.files("planner_service.whatif").joinpath("catalog.json").read_text()
    return HardwareCatalog.model_validate_json(text)


def read_catalog_file(path: str | Path) -> HardwareCatalog:
    """A user's catalogue file, validated; errors name the file and the offending field."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise CatalogError(f"catalog {p}: cannot read ({exc.strerror or exc})") from None
    try:
        json.loads(text)
    except json.JSONDecodeError as exc:
        raise CatalogError(f"catalog {p}: not JSON ({exc.msg} at line {exc.lineno})") from None
    try:
        return HardwareCatalog.model_validate_json(text)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(x) for x in first["loc"]) or "(top level)"
        raise CatalogError(f"catalog {p}: {where}: {first['msg']}") from None


def load_catalog(files: Sequence[str | Path] = (), *, use_env: bool = True) -> dict[str, CatalogEntry]:
    """Shipped entries, then those of `MEMPLAN_CATALOG` files, then `files` (later ones replace earlier keys)."""
    entries = {e.key: e for e in shipped().entries}
    paths: list[str | Path] = []
    if use_env and (env := os.environ.get(CATALOG_ENV)):
        paths.extend(p for p in env.split(os.pathsep) if p)
    paths.extend(files)
    for path in paths:
        for e in read_catalog_file(path).entries:
            entries[e.key] = e
    return entries


def entry(catalog: dict[str, CatalogEntry], key: str) -> CatalogEntry:
    try:
        return catalog[key]
    except KeyError:
        raise CatalogError(
            f"hardware: {key!r} is not in the catalogue; known keys: {', '.join(sorted(catalog))}"
        ) from None


def _curve(rate: float) -> list[BandwidthSample]:
    return [BandwidthSample(size_bytes=s, bytes_per_s=s / (COPY_LATENCY_S + s / rate)) for s in _CURVE_SIZES]


def to_hardware(
    e: CatalogEntry, *, host_memory_bytes: int | None = None, cpu_cores: int | None = None
) -> Hardware:
    """The contract Hardware of one device of entry `e` with its typical host (or the given overrides)."""
    return Hardware(
        device_type=DeviceType.cuda,
        device_name=e.name,
        device_count=1,
        device_memory_bytes=e.device_memory_bytes,
        host_memory_bytes=host_memory_bytes if host_memory_bytes is not None else e.host_memory_bytes,
        pinned_memory_limit_bytes=None,
        cpu_cores=cpu_cores if cpu_cores is not None else e.cpu_cores,
        bandwidth=BandwidthCurves(
            h2d_pinned=_curve(e.host_link.h2d_bytes_per_s),
            d2h_pinned=_curve(e.host_link.d2h_bytes_per_s),
            # both ways at once: the entry's duplex rates, else each direction's own (full-duplex links;
            # docs/architecture/hardware.md)
            duplex_h2d_pinned=_curve(e.host_link.duplex_h2d_bytes_per_s or e.host_link.h2d_bytes_per_s),
            duplex_d2h_pinned=_curve(e.host_link.duplex_d2h_bytes_per_s or e.host_link.d2h_bytes_per_s),
        ),
    )
