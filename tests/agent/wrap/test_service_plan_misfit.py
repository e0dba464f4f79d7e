"""A planner service whose finished plan does not fit the model (a corrupt history, a service defect): `wrap`
solves in-process and says so, as for any other bad answer; training never stops because of the service.

Defect (session 9 QA): a well-formed, finished plan naming a parameter the model does not have (the real
service's answer, rewritten by a proxy) went straight to `apply_plan`, and `wrap` raised `PlanMismatchError`
(model untouched, but no training). Found with another model's real plan answered for this one.
"""

from __future__ import annotations

import copy
import json
import logging
import re

import httpx
import pytest
import torch
from test_service_path import MisbehavingProxy, service  # noqa: F401  (the module-scoped service fixture)

import agent
from agent.testing.model_zoo import build_with_library_defaults, sample_batch

pytestmark = pytest.mark.slow

PLAN_GET = re.compile(r"^/v1/plans/[^/?]+(\?.*)?$")


def test_a_finished_plan_that_does_not_fit_the_model_falls_back_to_solving_in_process(
    service: str,  # noqa: F811
    caplog: pytest.LogCaptureFixture,
) -> None:
    model, config = build_with_library_defaults("llama", layers=2, hidden=64, vocab=256, seq=64)
    plain = copy.deepcopy(model)
    rewritten: list[str] = []

    def rule(method: str, path: str) -> tuple[int, str] | None:
        if method != "GET" or not PLAN_GET.match(path):
            return None
        record = httpx.get(service + path).json()
        if record.get("plan") and record["plan"].get("policy"):
            record["plan"]["policy"]["chunks"][0]["parameters"][0] = "transformer.wte.weight"
            rewritten.append(path)
        return 200, json.dumps(record)

    with MisbehavingProxy(service, rule) as proxy, caplog.at_level(logging.WARNING, logger="agent"):
        wrapped = agent.wrap(
            model,
            torch.optim.AdamW(model.parameters()),
            sample_batch=sample_batch(config, 2, 16),
            device_memory="1GiB",
            server=proxy.url,
            feedback_steps=None,
            reuse=False,
        )
    assert rewritten  # the service answered a finished plan, rewritten on its way
    assert wrapped.source.origin == "fallback"
    assert "does not fit this model" in wrapped.source.message
    assert (
        "PlanMismatchError" in wrapped.source.message and "transformer.wte.weight" in wrapped.source.message
    )
    assert any("does not fit this model" in r.getMessage() for r in caplog.records)
    batch = sample_batch(config, 2, 16)
    assert torch.allclose(wrapped.model(**batch).loss, plain(**batch).loss)
