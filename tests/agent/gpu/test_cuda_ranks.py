"""On a real GPU: two ranks of one job share it and train through `agent.wrap` as DistributedDataParallel does.

CUDA-only (skipped without a GPU; `tests/conftest.py` allows that skip in CI). A machine with one GPU cannot host
two NCCL ranks (NCCL refuses two ranks on one device), so the group is gloo and both ranks train on `cuda:0`:
the runtime's multi-rank device paths run for real (chunks uploaded to and gathered on the GPU, gradients
reduced from it, the host worker's streams and events), with the collectives going through host copies
(`RankGroup`'s `_on_backend_device`). NCCL itself, one GPU per rank, still needs a machine with several GPUs.
The jobs are the CPU suite's (`tests/agent/distributed/ddp_jobs.py`), with `device="cuda:0"`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
from ddp_jobs import Case, rel, spawn  # noqa: E402

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA-only: trains on a real GPU"),
    pytest.mark.distributed,
]

TOL = 1e-5


def check(results: list[dict[str, Any]], name: str) -> None:
    loss = max(rel(r["losses"], r["ref_losses"]) for r in results)
    params = max(r["param_rel_diff"][0] for r in results)
    norms = max(rel(r["norms"], r["ref_norms"]) for r in results)
    print(
        "GPU-FIGURE "
        + json.dumps(
            {
                "test": name,
                "ranks": len(results),
                "loss_max_rel_diff": loss,
                "param_max_rel_diff": params,
                "norm_max_rel_diff": norms,
                "offloaded_chunks": results[0]["offloaded_chunks"],
                "persistent_chunks": results[0]["persistent_chunks"],
                "overlapped_reductions": results[0]["overlapped_reductions"],
            }
        ),
        flush=True,
    )
    assert loss <= TOL and params <= TOL and norms <= TOL, (loss, params, norms)
    assert all(r["grad_reductions"] > 0 for r in results)
    assert len({round(r["checksum"], 6) for r in results}) == 1  # every rank holds the same model


def test_two_ranks_on_one_gpu_train_a_mixed_plan_with_clipping_as_ddp(tmp_path: Path) -> None:
    case = Case(kind="llama", offload="alternate", steps=3, clip=0.05, device="cuda:0")
    results = spawn(case, 2, tmp_path)
    assert results[0]["persistent_chunks"] > 0 and results[0]["offloaded_chunks"] > 0
    check(results, "ranks-llama-alternate")
    # the default on CUDA: each persistent chunk averaged in backward, on the offload stream (session 25)
    assert all(r["in_backward"] and r["overlapped_reductions"] > 0 for r in results)


def test_two_ranks_on_one_gpu_plan_a_hugging_face_model_at_library_defaults(tmp_path: Path) -> None:
    # no plan given: both ranks profile on the GPU, rank 0 solves in-process, rank 1 receives the same plan
    case = Case(kind="hf-llama", steps=3, clip=1.0, solve=True, device="cuda:0")
    results = spawn(case, 2, tmp_path)
    assert results[0]["plan"] == results[1]["plan"]
    check(results, "ranks-hf-llama-planned")
