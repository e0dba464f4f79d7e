"""What a person types, resolved to what the API takes: short ids to whole ids, model and hardware names to
the catalog's names and keys.

The CLI prints ids cut to `SHORT_ID` characters; any unique prefix of an id is accepted back (as git does).
`--model` and `--hardware` match the catalog by exact name or key, then by prefix, then by substring (case
blind). A prefix that names more than one thing is an error that lists the candidates.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from client.contract import HardwareSummary, ModelSummary
from client.sdk import Client

SHORT_ID = 12
_FULL_ID = re.compile(r"[0-9a-f]{32}")
_ID_PREFIX = re.compile(r"[0-9a-f]{1,31}")
_CANDIDATES_SHOWN = 10


class LookupFailed(Exception):
    """Nothing, or more than one thing, matches what the user typed; the message says which."""


def short_id(full: str) -> str:
    return full[:SHORT_ID]


def _resolve_id(kind: str, typed: str, find: Callable[[str, int], Sequence[tuple[str, str]]]) -> str:
    """`typed` itself if it is a whole id (or not an id at all: the server answers 404 for it), else the one id
    that starts with it. `find(prefix, n)` gives up to n (id, description) pairs whose id starts with prefix."""
    text = typed.strip().lower()
    if _FULL_ID.fullmatch(text) or not _ID_PREFIX.fullmatch(text):
        return typed
    found = find(text, _CANDIDATES_SHOWN + 1)
    if not found:
        raise LookupFailed(f"no {kind} id starts with {typed!r}")
    if len(found) > 1:
        more = " (and more)" if len(found) > _CANDIDATES_SHOWN else ""
        lines = "\n".join(f"  {i}  {what}" for i, what in found[:_CANDIDATES_SHOWN])
        raise LookupFailed(
            f"{kind} id prefix {typed!r} is ambiguous; it starts{more}:\n{lines}\n"
            f"type more characters of the id"
        )
    return found[0][0]


def resolve_plan_id(client: Client, typed: str) -> str:
    def find(prefix: str, n: int) -> list[tuple[str, str]]:
        page = client.list_plans_page(id_prefix=prefix, limit=n)
        return [
            (r.id, f"{r.status}  {r.model_name}  {r.hardware_key}  {r.created_at:%Y-%m-%d %H:%M:%S}")
            for r in page.items
        ]

    return _resolve_id("plan", typed, find)


def resolve_trace_id(client: Client, typed: str) -> str:
    def find(prefix: str, n: int) -> list[tuple[str, str]]:
        page = client.list_traces_page(id_prefix=prefix, limit=n)
        return [
            (r.id, f"{r.model_name}  {r.hardware_key}  {r.created_at:%Y-%m-%d %H:%M:%S}") for r in page.items
        ]

    return _resolve_id("trace", typed, find)


@dataclass(frozen=True)
class NameMatch:
    """The catalog values a typed name stands for (the API filters on one value at a time)."""

    typed: str
    values: tuple[str, ...]


def _match(kind: str, typed: str, names: list[str]) -> NameMatch:
    """The exact name, else names that start with it, else names that contain it (case blind). Several matches
    stand for all of them; none is an error listing what there is."""
    if typed in names:
        return NameMatch(typed, (typed,))
    low = typed.lower()
    found = [n for n in names if n.lower().startswith(low)] or [n for n in names if low in n.lower()]
    if not found:
        known = ", ".join(names[:20]) + (" ..." if len(names) > 20 else "") if names else "none yet"
        raise LookupFailed(f"no {kind} matches {typed!r} (by name, prefix or substring); known: {known}")
    return NameMatch(typed, tuple(dict.fromkeys(found)))


def match_model(models: list[ModelSummary], typed: str) -> NameMatch:
    """By name as `_match` does, or by fingerprint (whole, or a prefix of at least 6 characters: lists show 12)."""
    names = sorted({m.name for m in models})
    fingerprints = {m.fingerprint: m.name for m in models}
    low = typed.lower()
    if typed not in names and len(low) >= 6:
        by_print = [fp for fp in fingerprints if fp.startswith(low)]
        if len(by_print) == 1:
            return NameMatch(typed, (by_print[0],))
        if len(by_print) > 1:
            lines = "\n".join(f"  {fp[:SHORT_ID]}  {fingerprints[fp]}" for fp in by_print)
            raise LookupFailed(f"model fingerprint prefix {typed!r} is ambiguous:\n{lines}")
    return _match("model", typed, names)


def match_hardware(hardware: list[HardwareSummary], typed: str) -> NameMatch:
    return _match("hardware", typed, sorted(h.key for h in hardware))
