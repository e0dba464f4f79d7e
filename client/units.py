"""Human byte sizes: parse '8GiB', '512MiB', '1.5GB', '4096' and format bytes back."""

from __future__ import annotations

import re

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "ki": 2**10,
    "kib": 2**10,
    "mi": 2**20,
    "mib": 2**20,
    "gi": 2**30,
    "gib": 2**30,
    "ti": 2**40,
    "tib": 2**40,
}
_PATTERN = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str | int) -> int:
    """'8GiB' -> 8589934592. Decimal (GB) and binary (GiB) units; a bare number is bytes."""
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"byte size must not be negative: {text}")
        return text
    m = _PATTERN.match(text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a byte size: {text!r} (examples: 8GiB, 512MiB, 1.5GB, 4096)")
    value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    return int(round(value))


def format_bytes(n: float) -> str:
    """4294967296 -> '4.00 GiB'."""
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{sign}{n:.0f} {unit}" if unit == "B" else f"{sign}{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
