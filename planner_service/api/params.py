"""Typed path and query parameters of the API: the strings the database will see obey the contract's rules.

A NUL character in an id or a filter reaches PostgreSQL as a parameter it refuses (`psycopg.DataError`, a 500
before this module). These types give a 422 naming the parameter instead, on every backend, with the same
pattern the wire contract's strings use (`client.contract.common.NO_NUL_PATTERN`). Cursors are not here:
they are opaque, and any malformed one is a 400 from `db.keyset_cursor.decode_cursor`.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Path, Query

from client.contract.common import MAX_NAME_CHARS, NO_NUL_PATTERN
from planner_service.db.repositories import MAX_SEARCH_CHARS, PLAN_SORT_KEYS

TraceId = Annotated[str, Path(description="a trace id", pattern=NO_NUL_PATTERN)]
PlanId = Annotated[str, Path(description="a plan id", pattern=NO_NUL_PATTERN)]
SweepId = Annotated[str, Path(description="a sweep id", pattern=NO_NUL_PATTERN)]
ModelFilter = Annotated[
    str | None,
    Query(description="model fingerprint or name", max_length=MAX_NAME_CHARS, pattern=NO_NUL_PATTERN),
]
HardwareFilter = Annotated[
    str | None, Query(description="hardware key", max_length=4 * MAX_NAME_CHARS, pattern=NO_NUL_PATTERN)
]
SearchFilter = Annotated[
    str | None,
    Query(
        description="free text: plans whose model name, hardware key, workload or a feedback note contains every "
        "word, or whose id or model fingerprint starts with it (case-insensitive)",
        max_length=MAX_SEARCH_CHARS,
        pattern=NO_NUL_PATTERN,
    ),
]
PLAN_SORT_PATTERN = "^-?(" + "|".join(PLAN_SORT_KEYS) + ")$"
PlanSort = Annotated[
    str,
    Query(
        pattern=PLAN_SORT_PATTERN,
        description="the column to sort by, '-' first for descending: "
        + ", ".join(PLAN_SORT_KEYS)
        + " (error, peak_error: the latest feedback's |measured / predicted - 1|); plans without a value last",
    ),
]
WorldSizeFilter = Annotated[
    int | None, Query(ge=1, le=65_536, description="only jobs of this many ranks (1: single-process jobs)")
]
RanksPerNodeFilter = Annotated[
    int | None, Query(ge=1, le=65_536, description="only jobs with this many ranks per node")
]
