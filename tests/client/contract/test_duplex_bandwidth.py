"""The concurrent-copy curves of a trace's bandwidth (issue 19 item 10c): optional, paired, validated.

`duplex_h2d_pinned` / `duplex_d2h_pinned` are H2D and D2H measured running at the same time; a trace from
before them has neither. A bad value is refused with a 422 naming the field when uploaded to the service.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError

from client.contract import BandwidthCurves, BandwidthSample, Trace

MiB = 2**20


def curve(*rates: float) -> list[dict[str, Any]]:
    return [{"size_bytes": (i + 1) * MiB, "bytes_per_s": r} for i, r in enumerate(rates)]


def with_curves(trace: Trace, **curves: Any) -> dict[str, Any]:
    raw: dict[str, Any] = json.loads(trace.canonical_json())
    raw["hardware"]["bandwidth"].update(curves)
    return raw


def test_concurrent_curves_round_trip_and_default_to_absent(trace: Trace) -> None:
    assert not trace.hardware.bandwidth.has_duplex  # a trace built without them
    raw = with_curves(trace, duplex_h2d_pinned=curve(9e9, 11e9), duplex_d2h_pinned=curve(8e9, 10e9))
    t = Trace.model_validate(raw)
    assert t.hardware.bandwidth.has_duplex
    assert t.hardware.bandwidth.duplex_d2h_pinned == [
        BandwidthSample(size_bytes=MiB, bytes_per_s=8e9),
        BandwidthSample(size_bytes=2 * MiB, bytes_per_s=10e9),
    ]
    assert Trace.model_validate_json(t.canonical_json()) == t
    # without them the JSON has no such keys: an older trace serialises, and hashes, as it did before them
    # (and an explicit empty pair reads as absent)
    assert "duplex" not in trace.canonical_json().decode()
    empty = Trace.model_validate(with_curves(trace, duplex_h2d_pinned=[], duplex_d2h_pinned=[]))
    assert empty == trace and empty.content_hash() == trace.content_hash()


@pytest.mark.parametrize(
    ("curves", "field"),
    [
        ({"duplex_h2d_pinned": curve(-1.0), "duplex_d2h_pinned": curve(1e9)}, "duplex_h2d_pinned"),
        ({"duplex_h2d_pinned": curve(1e9), "duplex_d2h_pinned": curve(1e30)}, "duplex_d2h_pinned"),
        ({"duplex_h2d_pinned": curve(1e9)}, "duplex_d2h_pinned"),  # one without the other
        ({"duplex_d2h_pinned": curve(1e9, 2e9)[::-1], "duplex_h2d_pinned": curve(1e9)}, "duplex_d2h_pinned"),
    ],
    ids=["negative", "absurd", "unpaired", "unsorted"],
)
def test_bad_concurrent_curves_are_refused_naming_the_field(
    trace: Trace, api: TestClient, curves: dict[str, Any], field: str
) -> None:
    raw = with_curves(trace, **curves)
    with pytest.raises(ValidationError, match=field):
        BandwidthCurves.model_validate(raw["hardware"]["bandwidth"])
    r = api.post("/v1/traces", json=raw)
    assert r.status_code == 422, r.text
    assert any(field in (d.get("field", "") + d.get("message", d.get("msg", ""))) for d in r.json()["detail"])
    assert r.json()["detail"][0]["field"].startswith("body.hardware.bandwidth")
