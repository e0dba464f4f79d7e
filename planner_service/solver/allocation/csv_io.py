"""MiniMalloc's CSV format: `id,lower,upper,size` in, the same plus `offset` out.

The format of google/minimalloc's benchmarks, so this planner can be compared with other tools on the
same files. Bad rows raise `AllocationInputError` naming the line and the id.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Sequence
from pathlib import Path

from planner_service.solver.allocation.buffers import AllocationInputError, Buffer, check_buffer

REQUIRED_COLUMNS = ("id", "lower", "upper", "size")


def _int_field(row: dict[str, str], name: str, where: str) -> int:
    text = (row.get(name) or "").strip()
    try:
        return int(text)
    except ValueError:
        raise AllocationInputError(f"{where}: {name} must be an integer, got {text!r}") from None


def parse_minimalloc_csv(text: str) -> list[Buffer]:
    """Buffers of a MiniMalloc CSV text (an `offset` column, if present, is ignored)."""
    reader = csv.DictReader(io.StringIO(text))
    header = [h.strip() for h in (reader.fieldnames or [])]
    missing = [c for c in REQUIRED_COLUMNS if c not in header]
    if missing:
        raise AllocationInputError(
            f"line 1 (header): missing column(s) {', '.join(missing)}; need id,lower,upper,size"
        )
    reader.fieldnames = header
    buffers: list[Buffer] = []
    seen: dict[str, int] = {}
    for line, row in enumerate(reader, start=2):
        if None in row:
            raise AllocationInputError(f"line {line}: more fields than the header has")
        buffer_id = (row.get("id") or "").strip()
        where = f"line {line} (id {buffer_id or '?'})"
        if not buffer_id:
            raise AllocationInputError(f"{where}: id is empty")
        b = Buffer(
            id=buffer_id,
            lower=_int_field(row, "lower", where),
            upper=_int_field(row, "upper", where),
            size=_int_field(row, "size", where),
        )
        check_buffer(b, where)
        if buffer_id in seen:
            raise AllocationInputError(f"{where}: id already used on line {seen[buffer_id]}")
        seen[buffer_id] = line
        buffers.append(b)
    return buffers


def read_minimalloc_csv(path: str | Path) -> list[Buffer]:
    return parse_minimalloc_csv(Path(path).read_text())


def format_minimalloc_csv(buffers: Sequence[Buffer], offsets: Sequence[int]) -> str:
    out = io.StringIO()
    w = csv.writer(out, lineterminator="\n")
    w.writerow([*REQUIRED_COLUMNS, "offset"])
    for b, off in zip(buffers, offsets, strict=True):
        w.writerow([b.id, b.lower, b.upper, b.size, off])
    return out.getvalue()


def write_minimalloc_csv(path: str | Path, buffers: Sequence[Buffer], offsets: Sequence[int]) -> None:
    Path(path).write_text(format_minimalloc_csv(buffers, offsets))
