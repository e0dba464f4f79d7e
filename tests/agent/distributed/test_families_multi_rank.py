"""Every Hugging Face family `agent.testing.model_zoo` knows, at the library's defaults (KV cache on, the
family's attention, tied embeddings where it ties them, MoE routing), trains on two ranks as plain
DistributedDataParallel does under a plan holding every multi-rank chunk kind at once: persistent chunks
sharded on the device (ZeRO-3), offloaded chunks sharded on the host and offloaded chunks replicated; with
gradient accumulation inside `no_sync()`, clipping on every step, and `agent.unwrap` at the end.

The other multi-rank tests each use one model (llama, GPT-2, a small MLP); this matrix is the architectures
no issue names, on the paths issue 20 added (forked ranks, gloo on CPU; ~2 s per family).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from ddp_jobs import rel
from sharded_jobs import ShardCase, spawn

from agent.testing.model_zoo import DEFAULTS_FAMILIES

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

TOL = 1e-5


@pytest.mark.parametrize("family", DEFAULTS_FAMILIES)
def test_a_library_default_family_trains_as_ddp_on_two_ranks_with_every_chunk_kind(
    family: str, tmp_path: Path
) -> None:
    case = ShardCase(
        kind=f"hf-{family}",
        offload="alternate",  # persistent and offloaded chunks by turns
        device_shard=True,  # the persistent ones sharded on the device
        replicated=True,  # every second offloaded chunk replicated, the others sharded on the host
        steps=3,
        micro=2,
        no_sync=True,
        clip=0.05,  # small: clipping scales every step (the overlapped host steps are redone)
        unwrap=True,
    )
    check_every_chunk_kind(spawn(case, 2, tmp_path))


def test_ranks_whose_sequence_lengths_differ_from_each_other_and_from_step_to_step_train_as_ddp(
    tmp_path: Path,
) -> None:
    # a padding collator pads each rank's batch to its own longest example: the ranks' activations differ
    # in shape while their chunks' collectives must still pair up (lengths 16, 13 and 10 by turns)
    case = ShardCase(
        kind="hf-llama",
        offload="alternate",
        device_shard=True,
        replicated=True,
        steps=4,
        micro=2,
        no_sync=True,
        clip=0.05,
        unwrap=True,
        ragged=True,
    )
    results = spawn(case, 2, tmp_path)
    assert [res["lengths"] for res in results] == [[16, 13, 10, 16], [13, 10, 16, 13]]
    check_every_chunk_kind(results)


def check_every_chunk_kind(results: list[dict[str, Any]]) -> None:
    """Both ranks held every multi-rank chunk kind and trained as DDP (losses, clipped norms, parameters,
    `.grad` inside and outside no_sync, the unwrapped model), with redone host steps, on different data."""
    for r, res in enumerate(results):
        kinds = (res["device_sharded_chunks"], res["sharded_chunks"], res["replicated_offloaded_chunks"])
        assert all(k > 0 for k in kinds), (r, kinds)
        assert rel(res["losses"], res["ref_losses"]) <= TOL, (r, res["losses"], res["ref_losses"])
        assert rel(res["norms"], res["ref_norms"]) <= TOL and res["norms"], (
            r,
            res["norms"],
            res["ref_norms"],
        )
        assert res["param_rel_diff"][0] <= TOL, (r, res["param_rel_diff"])
        assert res["grad_rel_diff"]["synced"] <= TOL and res["grad_rel_diff"]["local"] <= TOL, (
            r,
            res["grad_rel_diff"],
        )
        assert res["unwrapped_rel_diff"][0] <= TOL, (r, res["unwrapped_rel_diff"])
        assert res["host_step_redos"] > 0  # clipping changed the gradients the overlapped steps used
    # every rank holds the same model, and the ranks trained on different data (losses differ)
    assert len({round(res["checksum"], 6) for res in results}) == 1
    assert len({res["ref_losses"][0] for res in results}) == 2
