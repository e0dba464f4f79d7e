"""A DDP user's own loop on two ranks with sharded chunks (the new-user QA pass; `user_loop_jobs.py`).

`test_a_ddp_users_habits_train_as_ddp`: forward without backward, evaluation and `generate` on rank 0 only,
a no_grad forward inside gradient accumulation, an uneven last batch, tied weights and a frozen block, then
`agent.unwrap` and plain DDP: every loss and parameter as DDP's within 1e-5 relative; nothing left in the
node-shared copy's directory. (Passed before this pass: it guards what the pass found working.)
`test_ddp_around_the_wrapped_model_and_a_rank_0_state_dict_are_errors_not_a_hang`: `DistributedDataParallel(
wrapped.model)` trained silently wrong before (DDP's reducer on top of memplan's own averaging: parameters 0.33
relative off DDP's after 4 steps); now DDP's constructor raises. Before the arrival check, rank 0 waited in
the state dict's all-gather for a rank that never came (until gloo's 30-minute timeout, with a message about
a collective, not about the call); now it raises within `RuntimeOptions.rank_arrival_timeout_s`, naming the
cause and both fixes.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest
from ddp_jobs import rel
from user_loop_jobs import ARRIVAL_TIMEOUT_S, spawn

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

TOL = 1e-5


def test_a_ddp_users_habits_train_as_ddp(tmp_path: Path) -> None:
    with tempfile.TemporaryDirectory(dir="/dev/shm", prefix="memplan-test-") as shm:
        assert spawn("habits", 2, tmp_path, 240, Path(shm)) == [0, 0]
        assert os.listdir(shm) == []  # the ranks exited: nothing left
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for res in results:
        assert res["sharded"] > 0 and res["tied"] and res["shared"]
        assert res["shm_left"] == []  # unlinked once every rank mapped it
        assert rel(res["losses"], res["ref_losses"]) <= TOL, (res["losses"], res["ref_losses"])
        assert res["trained_rel_diff"][0] <= TOL, res["trained_rel_diff"]
        for ref, plain in res["after_unwrap"]:
            assert abs(plain - ref) <= TOL * abs(ref), (plain, ref)
        assert res["after_rel_diff"][0] <= TOL, res["after_rel_diff"]
        assert res["frozen_unchanged"]
    evals, generated = results[0]["evals"], results[0]["generated"]
    assert len(evals) == 5 and all(abs(a - b) <= TOL * abs(a) for a, b in evals), evals
    assert len(generated) == 2 and generated[0] == generated[1]
    assert results[1]["evals"] == []


def test_ddp_around_the_wrapped_model_and_a_rank_0_state_dict_are_errors_not_a_hang(tmp_path: Path) -> None:
    codes = spawn("misuses", 2, tmp_path, 120)
    assert codes == [0, 0], codes  # None: a rank still waiting (the hang), killed
    rank0 = json.loads((tmp_path / "rank0.json").read_text())
    for r in range(
        2
    ):  # DDP around the wrapped model: refused at construction on every rank, before any collective
        error = json.loads((tmp_path / f"rank{r}.json").read_text())["ddp_error"]
        assert error is not None and error.startswith("WrappedModelDDPError"), error
        assert "averages gradients" in error and "wrapped.model" in error
    assert rank0["every_rank_states"] > 0
    error = rank0["error"]
    assert error.startswith("RankArrivalError") and "optimizer.state_dict()" in error, error
    assert "rank 1 did not" in error and "every rank" in error and "save_sharded" in error
    assert ARRIVAL_TIMEOUT_S <= rank0["error_seconds"] <= ARRIVAL_TIMEOUT_S + 10
    # the same for agent.unwrap on rank 0 alone (it gathers the optimizer state too)
    error = rank0["unwrap_error"]
    assert error.startswith("RankArrivalError") and "agent.unwrap(wrapped)" in error, error
    assert ARRIVAL_TIMEOUT_S <= rank0["unwrap_error_seconds"] <= ARRIVAL_TIMEOUT_S + 10
