"""Fixtures of the history UI tests: the real app with the UI router, and plans solved by its real worker."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from html.parser import HTMLParser
from typing import Any

import pytest
from fastapi import FastAPI

from client.contract import AllocationCategory, AllocationEvent, AllocationTrace, Phase, Trace

DEVICE_LIMIT = 16 * 2**30


def with_ui(app: FastAPI) -> FastAPI:
    """Include the UI router unless the app already serves it (once app.py includes it itself)."""
    from planner_service import ui

    if not any(getattr(r, "path", None) == "/ui/plans" for r in app.routes):
        app.include_router(ui.router)
    return app


def iteration_allocations(trace: Trace) -> AllocationTrace:
    """An allocation trace shaped like a training step of `trace`'s model, from its own figures.

    Parameters live across iterations; each block's saved activations are allocated in its forward and
    freed in its backward, with a transient workspace around each; gradients appear in backward and
    are freed by the optimizer step.
    """
    events: list[AllocationEvent] = []
    t = 0

    def add(
        size: int, start: int, stop: int | None, category: AllocationCategory, block: int | None, phase: Phase
    ) -> None:
        if size > 0:
            events.append(
                AllocationEvent(
                    id=len(events),
                    size_bytes=size,
                    alloc_index=start,
                    free_index=stop,
                    category=category,
                    block=block,
                    phase=phase,
                )
            )

    for b in trace.model.blocks:
        add(b.parameter_bytes, 0, None, AllocationCategory.param, b.index, Phase.forward)
    n = len(trace.model.blocks)
    meas = trace.measurements.blocks
    fwd_start = [0] * n
    for b in range(n):  # forward: activation kept until backward, workspace freed right away
        fwd_start[b] = t
        add(meas[b].forward_transient_peak_bytes, t, t + 1, AllocationCategory.temp, b, Phase.forward)
        t += 1
    bwd_at = {}
    for b in reversed(range(n)):
        bwd_at[b] = t
        add(meas[b].backward_transient_peak_bytes, t, t + 1, AllocationCategory.temp, b, Phase.backward)
        t += 1
    grads_done = t
    for b in range(n):
        add(
            meas[b].activation_bytes,
            fwd_start[b],
            bwd_at[b] + 1,
            AllocationCategory.activation,
            b,
            Phase.forward,
        )
        add(
            trace.model.blocks[b].parameter_bytes,
            bwd_at[b],
            grads_done + 1,
            AllocationCategory.grad,
            b,
            Phase.backward,
        )
    add(4096, grads_done, grads_done + 1, AllocationCategory.optimizer, None, Phase.optimizer)
    horizon = grads_done + 2
    events.sort(key=lambda e: (e.alloc_index, e.id))
    events = [e.model_copy(update={"id": i}) for i, e in enumerate(events)]
    return AllocationTrace(source="dispatch_tracker", horizon=horizon, events=events)


@pytest.fixture
def ui(settings) -> Iterator[Any]:  # type: ignore[no-untyped-def]
    """A TestClient of the real app (worker included) serving the UI."""
    from fastapi.testclient import TestClient

    from planner_service.app import create_app

    with TestClient(with_ui(create_app(settings))) as client:
        yield client


@pytest.fixture
def solved() -> Callable[..., dict[str, Any]]:
    """`solved(client, trace, limit=..., feedback=None)` uploads, waits for the worker, posts feedback: the plan."""

    def run(
        client: Any,
        trace: Trace,
        *,
        limit: int = DEVICE_LIMIT,
        solver: str = "cpsat",
        feedback: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        up = client.post(
            "/v1/traces", content=trace.canonical_json(), headers={"content-type": "application/json"}
        )
        assert up.status_code in (200, 201), up.text
        req = client.post(
            "/v1/plans",
            json={
                "trace_id": up.json()["id"],
                "solver": solver,
                "constraints": {"device_memory_bytes": limit},
            },
        )
        assert req.status_code in (200, 202), req.text
        done = client.get(f"/v1/plans/{req.json()['id']}", params={"wait": 60}).json()
        assert done["status"] in ("done", "infeasible", "failed"), done
        if feedback is not None:
            fb = client.post(f"/v1/plans/{done['id']}/feedback", json=feedback)
            assert fb.status_code == 201, fb.text
        return dict(done)

    return run


class Element:
    """One element of a parsed page: tag, attributes, and all the text inside it."""

    def __init__(self, tag: str, attrs: dict[str, str]) -> None:
        self.tag, self.attrs, self.text = tag, attrs, ""

    @property
    def classes(self) -> set[str]:
        return set(self.attrs.get("class", "").split())


class Dom(HTMLParser):
    """A flat list of a page's elements, with stdlib `html.parser` (what the server sent, before any script)."""

    VOID = {"meta", "link", "br", "hr", "img", "input", "col", "source", "area", "base", "wbr"}

    def __init__(self, html: str) -> None:
        super().__init__(convert_charrefs=True)
        self.elements: list[Element] = []
        self._open: list[Element] = []
        self.feed(html)
        self.close()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        el = Element(tag, {k: v or "" for k, v in attrs})
        self.elements.append(el)
        if tag not in self.VOID:
            self._open.append(el)

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.elements.append(Element(tag, {k: v or "" for k, v in attrs}))

    def handle_endtag(self, tag: str) -> None:
        for i in range(len(self._open) - 1, -1, -1):
            if self._open[i].tag == tag:
                del self._open[i:]
                break

    def handle_data(self, data: str) -> None:
        for el in self._open:
            el.text += data

    def all(self, tag: str | None = None, cls: str | None = None) -> list[Element]:
        return [
            e for e in self.elements if (tag is None or e.tag == tag) and (cls is None or cls in e.classes)
        ]

    def one(self, tag: str | None = None, cls: str | None = None) -> Element:
        found = self.all(tag, cls)
        assert len(found) == 1, f"expected one <{tag} class={cls}>, found {len(found)}"
        return found[0]
