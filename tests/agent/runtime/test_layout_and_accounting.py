"""Plans are checked against the model; parameters live in chunk buffers; bytes held are accounted."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from runtime_helpers import Trainer, batches, chunk_bytes_for, clone, plan_for, tiny_model, train

from agent.runtime import PlanMismatchError, RuntimeOptions, UnsupportedOptimizerError, manual_plan
from agent.runtime.device import element_size
from agent.wrapping import wrap
from client.contract import Chunk, Placement, Plan, Policy


def adamw(m: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True)


def edited(plan: Plan, chunk: int, **changes: object) -> Plan:
    assert plan.policy is not None
    chunks = list(plan.policy.chunks)
    chunks[chunk] = chunks[chunk].model_copy(update=changes)
    return plan.model_copy(update={"policy": plan.policy.model_copy(update={"chunks": chunks})})


def test_plan_naming_an_unknown_parameter_is_refused_with_its_name() -> None:
    model = tiny_model("llama")
    plan = plan_for(model, "all")
    names = list(plan.policy.chunks[1].parameters)  # type: ignore[union-attr]
    names[-1] = "model.layers.0.mlp.not_there.weight"
    with pytest.raises(
        PlanMismatchError,
        match=rf"policy\.chunks\[1\]\.parameters\[{len(names) - 1}\]: 'model\.layers\.0\.mlp\.not_there",
    ):
        wrap(model, adamw(model), plan=edited(plan, 1, parameters=names))


def test_plan_with_a_sharded_persistent_chunk_is_refused_in_one_process_before_the_model_is_touched() -> None:
    """A persistent chunk marked sharded is applied on the device (issue 20, `device_shards.py`) only at the world
    size its shards were cut for: in one process it is refused by naming the field, not applied as replicated."""
    model = tiny_model("llama")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    plan = plan_for(model, "none")
    assert plan.policy is not None
    policy = plan.policy.model_copy(update={"world_size": 2})
    sharded = plan.model_copy(update={"policy": policy})
    with pytest.raises(
        PlanMismatchError,
        match=r"policy\.world_size: is 2, and policy\.chunks\[1\] is sharded.* runs 1 process",
    ):
        wrap(model, adamw(model), plan=edited(sharded, 1, sharded=True))
    assert not getattr(model, "_memplan_wrapped", False)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_plan_with_sharded_offloaded_chunks_for_two_ranks_is_refused_in_one_process() -> None:
    """Sharded offloaded chunks are applied (one shard per rank) only at the world size they were cut for."""
    model = tiny_model("llama")
    plan = plan_for(model, "all")
    assert plan.policy is not None
    sharded = plan.model_copy(update={"policy": plan.policy.model_copy(update={"world_size": 2})})
    with pytest.raises(
        PlanMismatchError,
        match=r"policy\.world_size: is 2, and policy\.chunks\[1\] is sharded.* runs 1 process",
    ):
        wrap(model, adamw(model), plan=edited(sharded, 1, sharded=True))
    assert not getattr(model, "_memplan_wrapped", False)


def test_plan_missing_a_parameter_is_refused_with_its_name() -> None:
    model = tiny_model("llama")
    plan = plan_for(model, "none")
    last = plan.policy.chunks[-1]  # type: ignore[union-attr]
    dropped = last.parameters[-1]
    nbytes = dict(model.named_parameters())[dropped].numel() * 4
    bad = edited(
        plan,
        len(plan.policy.chunks) - 1,
        parameters=last.parameters[:-1],  # type: ignore[union-attr]
        used_bytes=last.used_bytes - nbytes,
    )
    with pytest.raises(PlanMismatchError, match=f"are in no chunk, e.g. '{dropped}'"):
        wrap(model, adamw(model), plan=bad)


def test_tied_parameter_listed_under_both_names_is_refused() -> None:
    model = tiny_model("gpt2")
    plan = plan_for(model, "none")
    first = plan.policy.chunks[0]  # type: ignore[union-attr]
    with pytest.raises(PlanMismatchError, match="'lm_head.weight' is the parameter already placed"):
        wrap(
            model,
            adamw(model),
            plan=edited(
                plan,
                0,
                parameters=[*first.parameters, "lm_head.weight"],
                used_bytes=first.used_bytes + 128 * 64 * 4,
            ),
        )


def test_plan_solved_for_another_precision_is_refused() -> None:
    model = tiny_model("gpt2")
    plan = plan_for(model, "none")  # byte counts of fp32
    with pytest.raises(PlanMismatchError, match=r"policy\.chunks\[0\]\.used_bytes: .*another precision"):
        wrap(model, adamw(model), plan=plan, options=RuntimeOptions(compute_dtype=torch.bfloat16))


def test_parameter_overflowing_its_chunk_is_refused() -> None:
    model = tiny_model("gpt2")
    plan = plan_for(model, "none")
    c0, c1 = plan.policy.chunks[0], plan.policy.chunks[1]  # type: ignore[union-attr]
    moved = c1.parameters[0]
    nbytes = dict(model.named_parameters())[moved].numel() * 4
    bad = edited(
        edited(plan, 0, parameters=[*c0.parameters, moved], used_bytes=c0.used_bytes + nbytes),
        1,
        parameters=c1.parameters[1:],
        used_bytes=c1.used_bytes - nbytes,
    )
    if c0.used_bytes + nbytes <= plan.policy.chunk_size_bytes:  # type: ignore[union-attr]
        pytest.skip("the first chunk has room for the moved parameter")
    with pytest.raises(PlanMismatchError, match=f"'{moved}' .* overflows the chunk"):
        wrap(model, adamw(model), plan=bad)


def test_one_buffer_trains_when_no_module_needs_two_offloaded_chunks() -> None:
    base = tiny_model("llama")
    data = batches(4)
    ref_model = clone(base)
    ref = train(Trainer(ref_model, adamw(ref_model)), data)
    model = clone(base)
    w = wrap(
        model,
        adamw(model),
        plan=manual_plan(model, chunk_size_bytes=chunk_bytes_for(model, 4), offload="all", n_buffers=1),
    )
    assert train(Trainer(w.model, w.optimizer), data) == ref


def test_one_buffer_for_a_module_split_across_two_offloaded_chunks_is_refused() -> None:
    model = tiny_model("gpt2")
    names = [n for n, _ in model.named_parameters()]
    sizes = {n: p.numel() * 4 for n, p in model.named_parameters()}
    cut = names.index("transformer.h.0.attn.c_attn.weight") + 1  # weight | bias in the next chunk
    groups = [names[:cut], names[cut:]]
    size = max(sum(sizes[n] for n in g) for g in groups)
    plan = manual_plan(model, chunk_size_bytes=size * 2, offload="all", n_buffers=1)
    chunks = [
        Chunk(
            index=i,
            placement=Placement.offloaded,
            parameters=g,
            blocks=[],
            used_bytes=sum(sizes[n] for n in g),
        )
        for i, g in enumerate(groups)
    ]
    plan = plan.model_copy(
        update={"policy": Policy(chunk_size_bytes=size, chunks=chunks, n_buffers=1, blocks=[])}
    )
    with pytest.raises(
        PlanMismatchError,
        match=r"policy.n_buffers: module transformer.h.0.attn.c_attn \(Conv1D\) needs 2 offloaded",
    ):
        wrap(model, adamw(model), plan=plan)
    assert not any(m._forward_pre_hooks for m in model.modules())  # refused before the model was touched


def test_optimizer_over_other_parameters_is_refused_before_the_model_is_touched() -> None:
    model = tiny_model("gpt2")
    other = tiny_model("gpt2")
    with pytest.raises(ValueError, match=r"optimizer\.param_groups\[0\]\.params\[0\]: is not a parameter"):
        wrap(model, adamw(other), plan=plan_for(model, "none"))
    assert not model._forward_pre_hooks and all(p.grad is None for p in model.parameters())
    wrap(model, adamw(model), plan=plan_for(model, "none"))  # still wrappable


def test_unsupported_optimizer_is_refused_by_name() -> None:
    model = tiny_model("gpt2")
    with pytest.raises(UnsupportedOptimizerError, match="LBFGS is not supported"):
        wrap(model, torch.optim.LBFGS(model.parameters()), plan=plan_for(model, "none"))


def test_wrap_without_a_plan_or_a_sample_batch_says_what_it_needs() -> None:
    model = tiny_model("gpt2")
    with pytest.raises(ValueError, match="sample_batch: needed to profile"):
        wrap(model, adamw(model))
    assert not getattr(model, "_memplan_wrapped", False)


def test_persistent_parameters_and_gradients_are_views_into_their_chunk() -> None:
    model = tiny_model("llama")
    plan = plan_for(model, "none")
    w = wrap(model, adamw(model), plan=plan)
    x = batches(1)[0]
    w.model(input_ids=x, labels=x).loss.backward()
    named = dict(model.named_parameters())
    for chunk in plan.policy.chunks:  # type: ignore[union-attr]
        params = [named[n] for n in chunk.parameters]
        assert len({p.untyped_storage().data_ptr() for p in params}) == 1
        assert len({p.grad.untyped_storage().data_ptr() for p in params}) == 1  # type: ignore[union-attr]
        offsets = [p.storage_offset() for p in params]
        assert offsets == sorted(offsets) and offsets[0] == 0  # packed in the plan's order


def test_persistent_gradients_are_none_after_zero_grad_and_land_in_their_chunk_after_backward() -> None:
    """zero_grad() leaves no gradient, as plain PyTorch does; backward's fresh gradients are copied into the
    chunk (before: the chunk's gradient area was zeroed and backward added into it, a memset and an add pass
    over every gradient each iteration). zero_grad(set_to_none=False) keeps zeroed views."""
    model = tiny_model("llama")
    # no step monitor: this test stops after a backward, where the monitor's memory meter may still be on
    w = wrap(model, adamw(model), plan=plan_for(model, "none"), feedback_steps=None)
    assert w.runtime is not None
    x = batches(1)[0]
    for _ in range(2):
        w.model(input_ids=x, labels=x).loss.backward()
        w.optimizer.step()
        w.optimizer.zero_grad()
        assert all(p.grad is None for p in model.parameters())
    w.model(input_ids=x, labels=x).loss.backward()
    for st in w.runtime.states:
        assert st.grad is not None
        for e in st.spec.entries:
            g = e.param.grad
            assert g is not None and g.data_ptr() == st.grad[e.offset :].data_ptr()
            assert g.abs().sum() > 0
    w.optimizer.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())


def test_offloaded_parameters_rest_on_the_host_copy_between_iterations() -> None:
    model = tiny_model("gpt2")
    plan = plan_for(model, "all")
    w = wrap(model, adamw(model), plan=plan)
    train(Trainer(w.model, w.optimizer), batches(2))
    w.synchronize()
    state = w.model.state_dict()  # evicts: parameters point at their host copies
    hosts = {st.host_params.untyped_storage().data_ptr() for st in w.runtime.states}  # type: ignore[union-attr]
    for p in model.parameters():
        assert p.untyped_storage().data_ptr() in hosts
    for name, p in model.named_parameters():
        torch.testing.assert_close(state[name], p.detach(), rtol=0, atol=0)


def test_device_and_host_bytes_follow_the_placements() -> None:
    model = tiny_model("llama")
    n_params = sum(p.numel() for p in model.parameters())
    esize = element_size(torch.float32)

    m1 = clone(model)
    w = wrap(m1, adamw(m1), plan=plan_for(m1, "none"))
    train(Trainer(w.model, w.optimizer), batches(1))
    rep = w.report().memory
    moments = n_params * 2 * esize  # Adam's two fp32 moments; plus one 4-byte 'step' per flat run
    steps_max = 4 * len(list(model.parameters()))
    assert rep.device.keys() == {"parameters", "gradients", "optimizer_state"}
    assert rep.device["parameters"] == rep.device["gradients"] == n_params * esize
    assert moments < rep.device["optimizer_state"] <= moments + steps_max
    assert rep.host == {}

    m2 = clone(model)
    plan = plan_for(m2, "all", n_buffers=2)
    w2 = wrap(m2, adamw(m2), plan=plan)
    train(Trainer(w2.model, w2.optimizer), batches(1))
    rep2 = w2.report().memory
    chunk_bytes = chunk_bytes_for(m2, 8)
    assert rep2.device == {"buffers": 2 * 2 * chunk_bytes}  # parameter + gradient area per buffer
    assert rep2.host["parameters"] == n_params * esize
    assert rep2.host["gradients"] == n_params * esize
    assert moments < rep2.host["optimizer_state"] <= moments + steps_max
    assert rep2.device_bytes < rep.device_bytes


def test_chunks_resident_after_forward_are_not_uploaded_again_for_backward() -> None:
    model = tiny_model("gpt2")
    w = wrap(model, adamw(model), plan=plan_for(model, "all", n_buffers=2))
    n_chunks = len(w.plan.policy.chunks)  # type: ignore[union-attr]
    x = batches(1)[0]
    train(Trainer(w.model, w.optimizer), [x])  # first iteration records the access order
    before = dataclasses.replace(w.runtime.counters)
    loss = w.model(input_ids=x, labels=x).loss
    mid = dataclasses.replace(w.runtime.counters)
    loss.backward()
    after = dataclasses.replace(w.runtime.counters)
    forward_uploads = mid.uploads - before.uploads
    backward_uploads = after.uploads - mid.uploads
    # GPT-2 ties lm_head to the embedding in chunk 0: forward uses chunk 0 twice, backward too
    assert forward_uploads == n_chunks + 1
    assert backward_uploads == n_chunks + 1 - 2  # the two chunks resident after forward are reused
    assert (
        after.prefetches - before.prefetches >= forward_uploads + backward_uploads - 2
    )  # nearly all ahead of use
    assert after.resident_hits > before.resident_hits


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_mixed_precision_keeps_fp32_masters_and_agrees_across_placements(dtype: torch.dtype) -> None:
    base = tiny_model("llama")
    data = batches(6)
    results = []
    for offload in ("none", "all"):
        model = clone(base)
        plan = manual_plan(
            model,
            chunk_size_bytes=chunk_bytes_for(model, 8) // 2,
            offload=offload,
            n_buffers=2,
            compute_dtype=dtype,
        )
        w = wrap(model, adamw(model), plan=plan, options=RuntimeOptions(compute_dtype=dtype))
        losses = train(Trainer(w.model, w.optimizer), data)
        w.synchronize()
        assert all(p.dtype == dtype for p in w.model.parameters())
        sd = w.optimizer.state_dict()
        masters = [s["master_param"] for s in sd["state"].values()]
        assert masters and all(m.dtype == torch.float32 for m in masters)
        results.append((losses, [m.clone() for m in masters]))
    assert results[0][0] == results[1][0]
    for a, b in zip(results[0][1], results[1][1], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert results[0][0][-1] < results[0][0][0]


def test_unwrap_after_mixed_precision_restores_fp32_parameters_from_the_masters() -> None:
    from agent.wrapping import unwrap

    model = tiny_model("gpt2")
    plan = manual_plan(
        model,
        chunk_size_bytes=chunk_bytes_for(model, 8) // 2,
        offload="all",
        n_buffers=2,
        compute_dtype=torch.bfloat16,
    )
    w = wrap(model, adamw(model), plan=plan, options=RuntimeOptions(compute_dtype=torch.bfloat16))
    train(Trainer(w.model, w.optimizer), batches(2))
    masters = [s["master_param"].clone() for s in w.optimizer.state_dict()["state"].values()]
    unwrap(w)
    params = list(model.parameters())
    assert all(p.dtype == torch.float32 for p in params)
    for p, m in zip(params, masters, strict=True):
        torch.testing.assert_close(p.detach(), m, rtol=0, atol=0)


@pytest.mark.parametrize("overlap", [True, False])
def test_host_steps_are_queued_during_backward_only_when_overlapping(overlap: bool) -> None:
    model = tiny_model("llama")
    w = wrap(
        model, adamw(model), plan=plan_for(model, "all"), options=RuntimeOptions(overlap_host_step=overlap)
    )
    x = batches(1)[0]
    stepped_when_embedding_grad_arrived: list[int] = []

    def probe(grad: torch.Tensor) -> None:  # fires late in backward: only the embedding is left
        stepped_when_embedding_grad_arrived.append(sum(st.stepped for st in w.runtime.states))

    out = w.model.model.embed_tokens(x)
    out.register_hook(probe)
    w.model(inputs_embeds=out, labels=x).loss.backward()
    n_chunks = len(w.runtime.states)
    if overlap:
        # every chunk but the embedding's was stepped on the host while backward was still running
        assert stepped_when_embedding_grad_arrived == [n_chunks - 1]
    else:
        assert stepped_when_embedding_grad_arrived == [0]
        assert not any(st.stepped for st in w.runtime.states)
    w.optimizer.step()
    w.synchronize()
    assert w.report().counters.host_steps == n_chunks
