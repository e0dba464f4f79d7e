"""The predicted device timeline's labels fit the contract's name limit, whatever the block names are.

Defect (found on T5): block detection made the whole decoder the epilogue, whose name (every module it
holds) is cut at the contract's 512 characters; the timeline label "fwd <name>" was 516 characters, and
building the plan's Predictions failed with a ValidationError.
"""

from __future__ import annotations

from dataclasses import replace

from client.contract.common import MAX_NAME_CHARS
from planner_service.solver.cost_model import Decision, device_timeline
from planner_service.solver.instance import PolicyInstance
from tests.planner_service.solver.test_multi_rank_policy import KEEP, _hand, _inst


def test_a_block_name_at_the_limit_gives_labels_within_it() -> None:
    inst: PolicyInstance = _inst(_hand())
    long_names = tuple("x" * MAX_NAME_CHARS for _ in range(inst.n_blocks))
    inst = replace(inst, block_names=long_names)
    points = device_timeline(inst, Decision((False, False), 0, KEEP, (False, False)), 0)
    assert points and all(len(p.label) <= MAX_NAME_CHARS for p in points)
    assert points[0].label.startswith("fwd x") and points[0].label.endswith("...")
    assert any(p.label.startswith("bwd x") for p in points)
