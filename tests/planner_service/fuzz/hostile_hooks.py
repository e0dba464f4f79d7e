"""Schemathesis hooks (loaded by path through SCHEMATHESIS_HOOKS in test_openapi_fuzz.py): besides its own
data, every generated path, query and body may have all its strings replaced by one hostile string.

Schemathesis's generator allows NUL but rarely puts it where it matters (the issue 17 probes found the NUL
500s by hand: a filter, a path id, a feedback note); this makes each operation meet these on purpose."""

from __future__ import annotations

from typing import Any

import schemathesis
from hypothesis import strategies as st

HOSTILE = (
    "\x00",
    "a\x00b",
    "%00",
    "\\u0000",
    "' OR 1=1 --",
    "../../etc/passwd",
    "\u202e\u0301",
    "\ufeff",
    "\U0001f600" * 3,
    "\r\nX-Injected: 1",
    "A" * 5000,
    " ",
    "null",
    "-1",
    "9" * 40,
)


def _replace_strings(value: Any, hostile: str) -> Any:
    if isinstance(value, str):
        return hostile
    if isinstance(value, dict):
        return {k: _replace_strings(v, hostile) for k, v in value.items()}
    if isinstance(value, list):
        return [_replace_strings(v, hostile) for v in value]
    return value


def _maybe_hostile(value: Any) -> st.SearchStrategy[Any]:
    if not value:
        return st.just(value)
    return st.one_of(st.just(value), st.sampled_from(HOSTILE).map(lambda h: _replace_strings(value, h)))


@schemathesis.hook
def flatmap_path_parameters(context: Any, path_parameters: dict[str, Any]) -> st.SearchStrategy[Any]:
    return _maybe_hostile(path_parameters)


@schemathesis.hook
def flatmap_query(context: Any, query: dict[str, Any]) -> st.SearchStrategy[Any]:
    return _maybe_hostile(query)


@schemathesis.hook
def flatmap_body(context: Any, body: Any) -> st.SearchStrategy[Any]:
    return _maybe_hostile(body)
