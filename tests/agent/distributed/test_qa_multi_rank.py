"""Session-9 QA of the multi-rank path: what a DDP user runs that no earlier test covered (forked ranks, gloo).

Each test names the defect it found: the symptom before the fix, and what the fix does.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from qa_jobs import spawn

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

TOL = 1e-5


def _as_reference(codes: list[int | None], results: list[Any]) -> None:
    """Every rank finished, and its parameters equal the plain PyTorch reference on the CPU and on the CUDA path
    under the stream checker, which found no violation."""
    assert codes == [0, 0], codes
    for res in results:
        assert res["error"] is None, res.get("trace")
        assert res["param_rel_diff"] <= TOL and res["simulated_rel_diff"] <= TOL, res
        assert res["violations"] == ""


def _routed_trains_as_ddp(tmp_path: Path, placement: str) -> list[dict[str, Any]]:
    """The routed job (`qa_jobs.routed`) on 2 ranks: every rank's losses and parameters equal
    DistributedDataParallel(find_unused_parameters=True)'s within TOL; the ranks' results."""
    codes, results = spawn("routed", 2, tmp_path, 120, placement)
    assert codes == [0, 0], codes
    for res in results:
        assert res["error"] is None, res.get("trace")
        assert max(abs(a - b) / abs(b) for a, b in zip(res["losses"], res["ref_losses"], strict=True)) <= TOL
        assert res["param_rel_diff"] <= TOL, res["param_rel_diff"]
    return results


def test_experts_unused_on_one_rank_train_as_ddp_with_find_unused_parameters(tmp_path: Path) -> None:
    """Defect: an expert (its own module) that got no token on rank 1 but did on rank 0 left a persistent chunk
    out of rank 1's end-of-backward averages: the ranks' all-reduces paired different chunks (gloo aborted the
    process on a size mismatch; equal sizes would have averaged unrelated gradients silently), and an entry
    unused on one rank of a chunk used on both contributed its stale gradient of an earlier step. Now the ranks
    agree on the union of the gradients they hold (one small all-reduce) and average those, a missing one as
    zero: DistributedDataParallel(find_unused_parameters=True)'s result."""
    results = _routed_trains_as_ddp(tmp_path, "persistent")
    # the ranks' forwards ran different experts: every persistent chunk is averaged at the end of backward, none
    # as backward completes it (the ranks would complete them in different orders)
    assert all(res["overlapped_reductions"] == 0 for res in results)


@pytest.mark.parametrize("placement", ["persistent", "mixed"])
def test_persistent_chunks_averaged_during_backward_take_later_gradients_as_ddp(
    tmp_path: Path, placement: str
) -> None:
    """Each persistent chunk is averaged as backward completes it (overlapping the rest of backward on a GPU, as
    DDP's buckets do). A gradient that arrives after its chunk was averaged (a block run three times under
    re-entrant checkpointing, a parameter whose module never runs) is added in and the chunk averaged again at
    the end (exact): the parameters equal plain PyTorch averaging `.grad` after every backward, on the CPU and on
    the CUDA path under the stream-ordering checker (no violation, kernels on the offload stream)."""
    codes, results = spawn("late", 2, tmp_path, 120, placement)
    assert codes == [0, 0], codes
    persistent = 3 if placement == "persistent" else 2
    for res in results:
        assert res["error"] is None, res.get("trace")
        assert max(abs(a - b) / abs(b) for a, b in zip(res["losses"], res["ref_losses"], strict=True)) <= TOL
        assert res["param_rel_diff"] <= TOL and res["simulated_rel_diff"] <= TOL, res
        assert res["violations"] == "" and res["offload_kernels"] > 0
        # 4 backwards: every persistent chunk averaged during backward; the block's chunk once more at the end;
        # (mixed) the offloaded embedding's average
        for counts in (res["counts"], res["simulated_counts"]):
            assert counts["overlapped"] == 4 * persistent, counts
            assert counts["reductions"] == 4 * 4, counts


@pytest.mark.parametrize("placement", ["offloaded", "sharded"])
def test_a_block_run_three_times_under_reentrant_checkpointing_in_an_offloaded_chunk_trains_as_ddp(
    tmp_path: Path, placement: str
) -> None:
    """The same looped block alone in an offloaded chunk: its chunk completes (and is averaged and stepped) at the
    first pass's gradients; the next pass's recomputation must see the parameters before that step (until
    session 26 it used the stepped ones, single-process too: 2-3% off), and the later passes' gradients are
    averaged in (replicated) or reduce-scattered in (sharded across the ranks). On the CPU and under the stream
    checker (which found the undo's restore racing a prefetch's upload of the stepped values)."""
    _as_reference(*spawn("late", 2, tmp_path, 120, placement))


@pytest.mark.parametrize("mode", ["order", "aux", "cleared"])
def test_persistent_chunks_averaged_in_backward_pair_up_whatever_order_or_use_each_rank_has(
    tmp_path: Path, mode: str
) -> None:
    """Review findings of session 25, each failing before its fix: ranks whose backwards complete the same chunks
    in different orders ("order": averages are issued in one chunk order on every rank), an output in the loss on
    one rank only ("aux": every rank issues the whole order, the rest at the end of backward), and `.grad` set to
    None by hand ("cleared": that gradient leaves the chunk, as at the step). Parameters equal plain PyTorch
    averaging `.grad` (a missing one as zero), on the CPU and under the stream checker."""
    codes, results = spawn("paths", 2, tmp_path, 120, mode)
    _as_reference(codes, results)
    for res in results:
        assert all(n > 0 for n in res["overlapped"]), res["overlapped"]


@pytest.mark.parametrize(
    "placement",
    [
        "offloaded",
        "sharded",
        "mixed",
        "offloaded:accumulate",
        "sharded:accumulate",
        "offloaded:loop",
        "sharded:loop",
        "mixed:loop",
    ],
)
@pytest.mark.parametrize("mode", ["order", "aux"])
def test_offloaded_chunks_reductions_pair_up_whatever_order_or_use_each_rank_has(
    tmp_path: Path, mode: str, placement: str
) -> None:
    """The same paths with offloaded chunks (replicated on every rank, sharded across them, or by turns with
    persistent ones): each rank's backward completes `a` and `b` in another order ("order": before, their
    averages paired one rank's chunk with the other's, silently), or `aux`'s chunk on rank 0 only ("aux": before,
    rank 0 issued one collective more, and gloo aborted). ":accumulate": two synchronising backwards per step (the
    review's finding: a sharded chunk reduce-scattered at its turn sent its increment while a rank joining with
    nothing sent the averaged total; 4-8% off). ":loop": `a` and `b` run twice under re-entrant checkpointing, so
    their chunks get gradients after their turn; a rank that held a chunk for its turn took them into that
    average, so the later average waits for the end of backward on every rank (review: an extra all-reduce on one
    rank aborted gloo); a sharded chunk's gradients after its turn were reduce-scattered at once (session 27: "order"
    0.12 off silently, "aux" aborted gloo), and now wait in `user_grad` until every rank adds their average at the
    end of backward. Parameters equal plain PyTorch averaging `.grad`, a missing one as zero, on the CPU and under
    the stream checker."""
    _as_reference(*spawn("paths", 2, tmp_path, 120, f"{mode}:{placement}"))


@pytest.mark.parametrize("placement", ["offloaded", "sharded"])
def test_a_step_without_undo_backup_taken_with_fewer_entries_is_the_same_error_on_every_rank(
    tmp_path: Path, placement: str
) -> None:
    """Defect (known since session 26, fixed in 27): `aux` and `head` in one offloaded chunk, `aux`'s output in
    the loss on rank 0 only, `RuntimeOptions(undo_host_steps=False)`. Rank 1 stepped the replicated chunk during
    backward with `head`'s gradient only; the agreement at backward's end showed rank 0 had `aux`'s too, and rank 1
    alone raised (it cannot undo the step) while rank 0 went on into its next collective (gloo: "Connection closed
    by peer"; NCCL would hang). Now the agreement carries "stepped without a backup" and every rank raises the same
    error, naming the chunk and the two options that avoid it."""
    codes, results = spawn("paths", 2, tmp_path, 120, f"aux:{placement}:noundo")
    assert codes == [0, 0], codes
    errors = {res["error"] for res in results}
    assert len(errors) == 1, errors  # the same verdict on every rank
    error = errors.pop()
    assert error is not None and error.startswith("RuntimeError: chunk runtime:"), error
    assert (
        "offloaded chunk 4" in error and "undo_host_steps=False" in error and "overlap_host_step" in error
    ), error


def test_a_tied_llama_under_reentrant_gradient_checkpointing_averages_each_chunk_in_backward_as_ddp(
    tmp_path: Path,
) -> None:
    """The user's path: a Hugging Face llama with tied embeddings under `gradient_checkpointing_enable(
    gradient_checkpointing_kwargs={"use_reentrant": True})`, every chunk persistent, 2 ranks: each layer's
    gradients arrive inside its inner backward, where its chunk is averaged; the tied embedding's chunk once, when
    its one gradient (both uses summed) arrives. Parameters equal plain PyTorch's averaged `.grad`."""
    codes, results = spawn("late", 2, tmp_path, 120, "llama")
    assert codes == [0, 0], codes
    for res in results:
        assert res["error"] is None, res.get("trace")
        assert max(abs(a - b) / abs(b) for a, b in zip(res["losses"], res["ref_losses"], strict=True)) <= TOL
        assert res["param_rel_diff"] <= TOL and res["simulated_rel_diff"] <= TOL, res
        assert res["violations"] == ""
        for counts in (res["counts"], res["simulated_counts"]):
            # every chunk averaged as each of the 4 backwards completed it, none again at the end
            assert counts["overlapped"] == counts["reductions"] == 4 * counts["chunks"], counts


@pytest.mark.parametrize(
    "placement",
    ["offloaded-layers", "sharded-layers", "offloaded-layers+accumulate", "sharded-layers+accumulate"],
)
def test_experts_unused_on_one_rank_in_offloaded_chunks_train_as_ddp_with_find_unused_parameters(
    tmp_path: Path, placement: str
) -> None:
    """Defect (session 11, silent): every chunk offloaded (replicated, or sharded on the host), a layer's router
    and experts in one chunk, so every rank uses every chunk but an expert without tokens on rank 1 gets no
    gradient there. Each rank stepped only the entries it got gradients for: rank 1 skipped the expert rank 0
    stepped with the averaged gradient, and the ranks' parameters drifted apart (relative difference to DDP
    0.21 after 3 steps; 0.17 with gradient accumulation, where an expert used in a no_sync micro-step on one
    rank only was dropped the same way). Now the same-use check at backward's start also compares, per entry,
    which ranks hold a gradient to contribute; an entry held on some ranks only is counted on every rank (a
    missing gradient as zero), as DistributedDataParallel(find_unused_parameters=True) does."""
    results = _routed_trains_as_ddp(tmp_path, placement)
    assert results[0]["deferred_backwards"] == 0, results[0]  # every rank used every chunk


@pytest.mark.parametrize("placement", ["offloaded", "sharded", "offloaded+accumulate", "sharded+accumulate"])
def test_offloaded_chunks_unused_on_one_rank_train_as_ddp_with_find_unused_parameters(
    tmp_path: Path, placement: str
) -> None:
    """Defect: the same model with offloaded chunks, one expert per chunk: a chunk unused on one rank is averaged
    mid-backward on the other, so the ranks' collectives paired wrongly (gloo aborted both processes with
    "Received data size doesn't match expected size"; NCCL would hang). Session 9 made it a clear error on every
    rank; session 11 trains it: as the backward begins (before any of its collectives) the ranks compare which
    offloaded chunks their forwards used, and where they differ the backward's reductions wait for its end,
    where every rank reduces every chunk any rank holds a gradient of, in chunk order, a missing one as zero:
    DistributedDataParallel(find_unused_parameters=True)'s result, for replicated and host-sharded chunks,
    with and without gradient accumulation."""
    results = _routed_trains_as_ddp(tmp_path, placement)
    assert results[0]["deferred_backwards"] > 0, results[0]  # the case this test is about did occur


def test_device_sharded_chunks_unused_on_one_rank_are_a_clear_error_on_every_rank(tmp_path: Path) -> None:
    """Defect (two features of session 9 meeting): the same model with every chunk persistent and sharded on the
    device (ZeRO-3). Their all-gathers are issued from module hooks, so rank 1, which ran no module of an
    expert's chunk, paired its next all-gather with rank 0's gather of that chunk: gloo aborted the process
    ("Received data size doesn't match expected size"; equal sizes would have mixed chunks silently). Now the
    ranks agree on each gather (and on the end of each forward and backward) first, and every rank raises the
    same error naming the chunks, before any mismatched collective."""
    codes, results = spawn("routed", 2, tmp_path, 120, "device-sharded")
    assert codes == [0, 0], codes
    errors = {res["error"] for res in results}
    assert len(errors) == 1, errors  # the same verdict on every rank
    error = errors.pop()
    assert error is not None and error.startswith("UnusedParametersError"), error
    assert "device-sharded" in error and "gathered chunk" in error and "experts" in error, error


def test_an_evaluation_on_every_rank_leaves_training_with_device_sharded_chunks_unchanged(
    tmp_path: Path,
) -> None:
    """The supported way to evaluate a model with chunks sharded on the device (a forward gathers them from every
    rank, as under FSDP): every rank evaluates, under no_grad and in eval mode with grad; the ranks' passes agree,
    and the training losses equal those of the same job without the evaluation."""
    _, ref = spawn("evaluate", 2, tmp_path / "none", 120, "none")
    codes, results = spawn("evaluate", 2, tmp_path / "every", 120, "every-rank")
    assert codes == [0, 0], codes
    for got, want in zip(results, ref, strict=True):
        assert got["error"] is None and want["error"] is None, (got["error"], want["error"])
        assert ["persistent", True] in got["kinds"] and ["offloaded", True] in got["kinds"]
        assert len(got["evals"]) == 2 and got["evals"][0] == got["evals"][1]
        assert got["losses"] == want["losses"] and len(got["losses"]) == 3


@pytest.mark.parametrize("grad", ["no-grad", "grad"])
def test_a_forward_on_rank_0_alone_with_device_sharded_chunks_is_an_error_on_every_rank(
    tmp_path: Path, grad: str
) -> None:
    """Defect (session 14): rank 0 evaluating alone (`if rank == 0: evaluate(model)`) a model with chunks sharded
    on the device paired its forward's all-gathers with rank 1's next training forward, and the ranks' next
    collectives differed: gloo aborted rank 0's process (SIGABRT, "Received data size doesn't match expected
    size"; collectives of equal sizes would have mixed data or waited until gloo's 30-minute timeout). Now the ranks' agreements before each gather also
    compare the pass (direction, grad mode, backwards begun), and one more at backward's start precedes the
    same-use check: every rank raises `RankArrivalError` naming each rank's pass and the fix, at once."""
    codes, results = spawn("evaluate", 2, tmp_path, 120, f"rank0-{grad}")
    assert codes == [0, 0], codes  # None: a rank still waiting (the hang), killed
    for res in results:
        error = res["error"]
        assert error is not None and error.startswith("RankArrivalError"), error
        assert "the ranks are in different passes" in error and "Run every forward on every rank" in error
        said = (
            "rank 0 in a forward without grad after 1 backward"
            if grad == "no-grad"
            else "rank 1 in a backward"
        )
        assert said in error, error


def test_generate_on_every_rank_with_device_sharded_chunks_keeps_the_ranks_together(tmp_path: Path) -> None:
    """Hugging Face `generate` on every rank, the ranks' sequences of different lengths: the wrapped model's
    `generate` defaults to `synced_gpus=True` (as transformers' does for DeepSpeed ZeRO-3 and FSDP models: the
    finished rank keeps running the decoding forwards with the others) and every rank's tokens are those the
    unwrapped plain model generates (its `generate` the class's again). Passing `synced_gpus=False` the finished
    rank goes on to train while the other still decodes: both ranks raise `RankArrivalError` naming
    `synced_gpus=True` (before session 14: a gloo abort)."""
    codes, results = spawn("generate", 2, tmp_path / "default", 120, "default")
    assert codes == [0, 0], codes
    for rank, res in enumerate(results):
        assert res["error"] is None, res["error"]
        assert res["marked"] and res["mark_removed"]
        assert len(res["tokens"]) == 4 + 2 + 2 * rank and res["tokens"] == res["plain_tokens"]
    codes, results = spawn("generate", 2, tmp_path / "unsynced", 120, "unsynced")
    assert codes == [0, 0], codes
    for res in results:
        error = res["error"]
        assert error is not None and error.startswith("RankArrivalError"), error
        assert "rank 0 in a forward with grad after 1 backward; rank 1 in a forward without grad" in error
        assert "synced_gpus=True" in error


@pytest.mark.parametrize("call", ["state_dict", "unwrap", "save_sharded"])
def test_a_collective_called_on_rank_1_alone_is_an_error_on_that_rank(tmp_path: Path, call: str) -> None:
    """Defect (documented as a limit): `optimizer.state_dict()`, `agent.unwrap` or
    `agent.checkpoint.save_sharded` (not checked on any rank before) with sharded chunks on a non-zero rank alone (`if rank == 1: ...`) waited in the collective until gloo's 30-minute timeout, while
    rank 0 trained on. Now rank 1 waits for rank 0's arrival mark and raises `RankArrivalError` once rank 0
    is seen at a later backward (rank 0 publishes its count in the store); rank 0's next collective
    then fails as rank 1 exits."""
    codes, results = spawn("alone", 2, tmp_path, 120, call)
    assert codes[1] == 0, codes  # None: rank 1 still waiting (the hang), killed
    error = results[1]["error"]
    assert error is not None and error.startswith("RankArrivalError"), error
    assert "rank 1 called it, rank 0 went on without calling it" in error


def test_gradients_assigned_by_hand_are_refused_on_every_rank_naming_backward(tmp_path: Path) -> None:
    """Session 23: a gradient from `torch.autograd.grad` assigned as `p.grad` reaches no hook, so it is never
    averaged across the ranks and a sharded chunk cannot step it: every rank raises at `optimizer.step()` (in one
    process such gradients are stepped: `tests/agent/wrap/test_assigned_gradients.py`)."""
    codes, results = spawn("assigned", 2, tmp_path, 60)
    assert codes == [0, 0], codes
    for res in results:
        error = res["error"]
        assert error is not None and error.startswith("AssignedGradientError"), error
        assert "Compute gradients with loss.backward()" in error


def test_a_wrap_after_unwrap_reuses_the_runtimes_group_and_a_live_one_gets_its_own(tmp_path: Path) -> None:
    """Session 24: every `wrap` made a new process group (`dist.new_group()`) and none was let go: a process
    that wrapped and unwrapped again and again kept them all (gloo: 3 threads and a connection per peer each;
    NCCL: a communicator's device buffers). Now `unwrap` lends the runtime's own group to the next wrap; a wrap
    alive beside another never shares it (their host workers would issue collectives on it at once)."""
    codes, results = spawn("rewrap", 2, tmp_path, 120)
    assert codes == [0, 0], codes
    for res in results:
        assert res["error"] is None, res.get("trace")
        first, second, third, beside, fourth, beside_again = res["groups"]
        assert first == second == third != beside  # lent again; the one beside it is new
        assert {fourth, beside_again} == {first, beside}  # both lent: no third group
        threads = res["threads"]
        assert threads[1] == threads[0] and threads[3] == threads[2] > threads[1], threads
        assert res["ranks_agree"] and all(math.isfinite(v) for v in res["losses"])


@pytest.mark.parametrize(
    ("what", "said"),
    [
        (
            "frozen",
            "rank 0: parameter 'head.weight' [32, 16] float32; rank 1: parameter (frozen) 'head.weight'",
        ),
        ("partial", "device_memory: given on some ranks only (rank 0: not given, rank 1: 1073741824)"),
    ],
)
def test_ranks_wrapping_different_jobs_get_one_clear_error(tmp_path: Path, what: str, said: str) -> None:
    """Defect: a rank 1 model unlike rank 0's failed later on one rank only (found with a wider llama on rank 1:
    rank 0 raised a `PlanMismatchError` asking whether the plan was solved for another precision, rank 1 a gloo
    connection reset). Now `wrap` compares the ranks' parameters, buffers and limits first, on every rank."""
    codes, results = spawn("unlike", 2, tmp_path, 60, what)
    assert codes == [0, 0], codes
    for res in results:
        assert res["error"] is not None and res["error"].startswith("JobMismatchError"), res
        assert said in res["error"], res["error"]


def test_the_job_is_planned_for_the_smallest_device_memory_any_rank_gave(tmp_path: Path) -> None:
    """Defect: `device_memory` smaller on rank 1 than on rank 0 was ignored: rank 0 planned the whole job for its
    own limit, so rank 1 would run a plan larger than its device."""
    codes, results = spawn("unlike", 2, tmp_path, 120, "smaller")
    assert codes == [0, 0], codes
    for res in results:
        assert res["error"] is None, res
        assert res["planned_device_bytes"] == 1 << 30


def test_a_rank_that_fails_before_its_profile_starts_fails_every_rank_instead_of_hanging(
    tmp_path: Path,
) -> None:
    """Defect (session 33): rank 1 calling `wrap` without `sample_batch` (rank 0 with one) hung both ranks until
    gloo's 30-minute timeout: rank 1 raised before its profile started, so it never met the barriers before rank
    0's plain iterations, and went on to the exchange of outcomes that rank 0, waiting at a barrier, never
    reached. Now the group's profiling holds the meetings of a profile that ended early, however it ended, and
    every rank raises `RankProfilingError` naming rank 1's error."""
    codes, results = spawn("unlike", 2, tmp_path, 120, "nobatch")
    assert codes == [0, 0], codes  # None: killed at the limit (the hang)
    for res in results:
        assert res["error"].startswith("RankProfilingError"), res
        assert "rank 1:" in res["error"] and "sample_batch" in res["error"], res["error"]


def test_the_accelerate_recipe_under_several_processes_trains_as_accelerate_with_ddp(tmp_path: Path) -> None:
    """Defect: README's Accelerate recipe (`accelerator.prepare(wrapped.model, wrapped.optimizer, ...)`) under
    `accelerate launch`/torchrun raised `WrappedModelDDPError` (Accelerate puts the model in DDP) with a message
    that did not say what to do with Accelerate. The message and README now name
    `agent.integrations.hf.keep_accelerate_from_ddp(accelerator, wrapped)` (what `wrap_trainer` does), with which
    the loop logs Accelerate's DDP losses, accumulation and clipping included."""
    codes, results = spawn("accelerate", 2, tmp_path, 120, "direct")
    assert codes == [0, 0], codes
    for res in results:
        assert res["error"].startswith("WrappedModelDDPError") and "keep_accelerate_from_ddp" in res["error"]
    codes, results = spawn("accelerate", 2, tmp_path, 120, "kept")
    assert codes == [0, 0], codes
    for res in results:
        assert res["error"] is None, res
        assert max(abs(a - b) / abs(b) for a, b in zip(res["wrapped"], res["plain"], strict=True)) <= TOL


@pytest.mark.parametrize("placement", ["persistent", "offloaded", "sharded"])
def test_zero_grad_keeps_the_gradients_of_parameters_the_optimizer_does_not_hold_on_two_ranks(
    tmp_path: Path, placement: str
) -> None:
    """Review finding (session 27; single-process too, `tests/agent/runtime/test_zero_grad_subset.py`): an
    optimizer over the layers only, the embedding and head still trainable; `optimizer.zero_grad()` forgot their
    accumulating `.grad`, so the clip over `model.parameters()` saw 1.41 where DDP saw 1.95, and the parameters
    were 6.1e-3 off DDP after 3 steps. Now the clip norms and parameters equal DDP's on every rank, with the chunks
    persistent, offloaded or sharded on the host."""
    codes, results = spawn("subset", 2, tmp_path, 120, placement)
    assert codes == [0, 0], codes
    for res in results:
        assert res["error"] is None, res.get("trace")
        for want, got in res["norms"]:
            assert abs(got - want) <= TOL * want, res["norms"]
        assert res["param_rel_diff"] <= TOL, res["param_rel_diff"]


def test_an_in_place_write_to_a_node_shared_compute_copy_is_said(tmp_path: Path) -> None:
    """Review finding (session 27): with sharded chunks and the compute copy shared by a node's ranks (the
    default), `p.mul_(0.9)` after `step()` on every rank wrote the same shared memory twice (0.81; racing, the ranks
    then disagreed, 0.19-0.27 off DDP), silently. NOT CORRECTED: the runtime cannot undo a user's write; it now
    says so once per rank at the chunk's next upload, naming the parameter and the two ways out. A private copy
    (`share_compute_copy=False`, right) and a `load_state_dict` (the runtime's path, idempotent) say nothing."""
    codes, results = spawn("inplace", 2, tmp_path / "shared", 120, "shared")
    assert codes == [0, 0], codes
    for res in results:
        assert res["error"] is None, res.get("trace")
        assert len(res["warnings"]) == 1, res["warnings"]
        assert "share_compute_copy" in res["warnings"][0] and "load_state_dict" in res["warnings"][0]
    for quiet in ("private", "shared:noscale"):
        codes, results = spawn("inplace", 2, tmp_path / quiet.replace(":", "-"), 120, quiet)
        assert codes == [0, 0], codes
        assert [res["warnings"] for res in results] == [[], []], (quiet, results)


@pytest.mark.parametrize("arg", ["persistent", "offloaded", "offloaded:accumulate"])
def test_batchnorm_running_statistics_are_rank_0s_as_under_ddp(tmp_path: Path, arg: str) -> None:
    """Review finding (session 27): each rank kept its own BatchNorm running statistics (rank 1's running mean
    2.8e-2 off DDP after 3 steps, its eval loss 3.6607 against 3.6584), where DistributedDataParallel's default
    `broadcast_buffers=True` gives every rank rank 0's before each forward. Now the persistent buffers are
    broadcast from rank 0 at the end of each synchronising backward: the training losses, the buffers, an
    evaluation in eval mode through each wrapper and the parameters equal DDP's on every rank, also with gradient
    accumulation inside no_sync()."""
    codes, results = spawn("batchnorm", 2, tmp_path, 120, arg)
    assert codes == [0, 0], codes
    for res in results:
        assert res["error"] is None, res.get("trace")
        assert res["loss_diff"] <= TOL and res["eval_diff"] <= TOL, res
        assert res["buffer_diff"] <= 1e-6 and res["param_rel_diff"] <= TOL, res
