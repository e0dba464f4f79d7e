"""Modelled traces carry concurrent-copy curves from the catalogue (issue 19 item 10c): full-duplex links keep
each direction's sustained rate both ways at once, unless an entry gives its own concurrent rates."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from client.contract import CatalogEntry
from planner_service.whatif.catalog import shipped, to_hardware


def test_a_modelled_trace_copies_both_ways_at_each_directions_own_rate() -> None:
    for e in shipped().entries:
        bw = to_hardware(e).bandwidth
        assert bw.has_duplex, e.key
        assert bw.duplex_h2d_pinned == bw.h2d_pinned and bw.duplex_d2h_pinned == bw.d2h_pinned, e.key


def test_an_entrys_concurrent_rates_make_its_concurrent_curves() -> None:
    e = next(x for x in shipped().entries if x.key == "h100-pcie")
    link = e.host_link.model_copy(
        update={
            "duplex_h2d_bytes_per_s": 0.5 * e.host_link.h2d_bytes_per_s,
            "duplex_d2h_bytes_per_s": 0.75 * e.host_link.d2h_bytes_per_s,
        }
    )
    bw = to_hardware(
        CatalogEntry.model_validate(e.model_copy(update={"host_link": link}).model_dump())
    ).bandwidth
    big = -1  # the largest copy: latency negligible, the rate itself
    assert bw.duplex_h2d_pinned[big].bytes_per_s == pytest.approx(
        0.5 * bw.h2d_pinned[big].bytes_per_s, rel=1e-3
    )
    assert bw.duplex_d2h_pinned[big].bytes_per_s == pytest.approx(
        0.75 * bw.d2h_pinned[big].bytes_per_s, rel=1e-3
    )


def test_a_concurrent_rate_above_the_links_peak_is_refused_naming_it() -> None:
    raw = next(x for x in shipped().entries if x.key == "h100-pcie").model_dump()
    raw["host_link"]["duplex_d2h_bytes_per_s"] = 2 * raw["host_link"]["peak_bytes_per_s"]
    with pytest.raises(ValidationError, match="duplex_d2h_bytes_per_s"):
        CatalogEntry.model_validate(raw)
