"""The chunk runtime's CUDA code paths (side streams, events, pinned buffers, host steps, swap) run on CPU
under the stream-ordering checker (`checker.simulated_cuda`, a test double: no GPU runs here).

Scenarios are the equivalence tests' models (tests/agent/runtime) and the activation-swap tests' (tests/
activations), trained a few steps through `agent.wrap` / `apply_activation_policy` exactly as users call
them. Issue 19's defects 2 and 5 were found by these tests on the runtime before their fixes (they raised
StreamOrderError with both stack traces); they pass now.
"""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch

from agent.runtime import RuntimeOptions
from agent.runtime.activations import apply_activation_policy
from agent.testing.model_zoo import build
from agent.wrapping import unwrap, wrap
from tests.agent.runtime.activations.activation_helpers import VOCAB, data, policy_for, run
from tests.agent.runtime.cuda_semantics.checker import simulated_cuda
from tests.agent.runtime.runtime_helpers import Trainer, alternate, batches, plan_for, tiny_model, train

pytestmark = pytest.mark.cuda_semantics

STEPS = 3


def adamw(m: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.1, fused=True)


def train_wrapped(
    kind: str, offload: str, *, n_chunks: int = 8, n_buffers: int = 2, options: RuntimeOptions | None = None
) -> list[float]:
    model = tiny_model(kind)
    dtype = options.compute_dtype if options is not None else None
    rule = alternate if offload == "alternate" else offload
    plan = plan_for(model, rule, n_chunks=n_chunks, n_buffers=n_buffers, compute_dtype=dtype)
    w = wrap(model, adamw(model), plan=plan, options=options)
    losses = train(Trainer(w.model, w.optimizer), batches(STEPS))
    w.synchronize()
    unwrap(w)
    return losses


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@pytest.mark.parametrize("offload", ["none", "all", "alternate"])
def test_the_equivalence_scenarios_keep_every_access_ordered(kind: str, offload: str) -> None:
    with simulated_cuda("caching") as sim:
        losses = train_wrapped(kind, offload)
    assert len(losses) == STEPS and all(x == x for x in losses)
    if offload != "none":  # the CUDA paths ran: uploads and gradient offloads on their own streams
        assert sim.kernels_on("upload stream") > 0 and sim.kernels_on("offload stream") > 0
    sim.check()


@pytest.mark.parametrize(
    ("kind", "options"),
    [
        ("gpt2", RuntimeOptions(compute_dtype=torch.bfloat16)),  # fp32 masters on the host, staged gradients
        ("llama", RuntimeOptions(overlap_host_step=False)),  # host steps at optimizer.step()
    ],
    ids=["bf16-mixed", "deferred-host-step"],
)
def test_mixed_precision_and_deferred_host_steps_keep_every_access_ordered(
    kind: str, options: RuntimeOptions
) -> None:
    with simulated_cuda("caching") as sim:
        train_wrapped(kind, "all", options=options)
    assert sim.kernels_on("upload stream") > 0 and sim.kernels_on("offload stream") > 0
    sim.check()


def test_gradients_into_a_prefetched_embedding_only_chunk_wait_for_its_upload() -> None:
    # issue 19 defect 2: a gradient written into a prefetched chunk's gradient area on the compute stream
    # before its upload (which zeroes the area on the upload stream) was waited for (GPT-2's tied wte, alone in
    # a chunk); the checker found it on the runtime before the fix (a StreamOrderError with both stacks)
    with simulated_cuda("caching") as sim:
        train_wrapped("gpt2", "all", n_chunks=16, n_buffers=2)  # wte alone in chunk 0, prefetched in backward
    sim.check()


def swap_run(kind: str, strip: str, allocator: str) -> None:
    model, _ = build(kind, layers=len(strip), hidden=64, vocab=VOCAB, seq=32, seed=0)
    container = "transformer.h" if kind == "gpt2" else "model.layers"
    with simulated_cuda(allocator) as sim:  # type: ignore[arg-type]
        mgr = apply_activation_policy(model, policy_for(model, container, strip), torch.device("cpu"))
        run(model, data(2))
        assert mgr.store is not None and mgr.store.counters.swapped_out_bytes > 0
        assert sim.kernels_on("swap-out stream") > 0 and sim.kernels_on("swap-in stream") > 0
        mgr.remove()
        gc.collect()
    sim.check()


@pytest.mark.parametrize(("kind", "strip"), [("gpt2", "SSSS"), ("llama", "SCSK")])
def test_activation_swap_is_ordered_under_the_caching_allocator(kind: str, strip: str) -> None:
    swap_run(kind, strip, "caching")


def test_activation_swap_is_ordered_under_the_planned_allocator() -> None:
    # issue 19 defect 5: swap relied on record_stream to keep a swapped storage from reuse until its D2H copy
    # ended; under the planned allocator record_stream does nothing, so the storage freed on the compute stream
    # could be handed out while the copy still read it (the checker found it before the fix)
    swap_run("gpt2", "SSSS", "planned")


@pytest.mark.parametrize(("kind", "strip"), [("gpt2", "SKKK"), ("llama", "KSKS")])
def test_a_swapped_blocks_storages_go_by_the_end_of_the_next_blocks_forward(kind: str, strip: str) -> None:
    """Session 17 (one H200): a swapped block's device storages were let go only at the next swap block's first
    pack, or in backward's first prefetch, so the last swapped block's activations stayed through the rest of
    forward and into backward: plans with a swapped block peaked 4-15% over their prediction. The simulated
    copies never finish on their own (`query()` is False: the slowest device), so this is the latest the runtime
    lets them go, and the planner counts them through the next block's forward; the checker still sees every free
    ordered after its copy."""
    model, _ = build(kind, layers=len(strip), hidden=64, vocab=VOCAB, seq=32, seed=0)
    container = "transformer.h" if kind == "gpt2" else "model.layers"
    with simulated_cuda("caching") as sim:
        mgr = apply_activation_policy(model, policy_for(model, container, strip), torch.device("cpu"))
        store = mgr.store
        assert store is not None
        held_after: dict[int, list[int]] = {}

        def check(index: int) -> Any:
            def hook(module: torch.nn.Module, args: Any, output: Any) -> None:  # after the runtime's own hook
                held_after[index] = sorted({e.block for e in store._copying})

            return hook

        targets = {t.index: t.module for t in mgr.targets}
        handles = [module.register_forward_hook(check(i)) for i, module in targets.items()]
        x = data(1)[0]
        loss = model(input_ids=x, labels=x).loss
        swapped = [t.index for t in mgr.targets if t.mode.value == "swap"]
        for index, held in held_after.items():
            assert all(b >= index for b in held), (index, held)  # nothing of a block before this one
        assert any(held_after[i] == [i] for i in swapped)  # the block's own copies are in flight at its end
        assert store._copying == []  # the root forward's end let the last swapped block's storages go
        loss.backward()
        for h in handles:
            h.remove()
        assert store.counters.swapped_out_bytes > 0
        mgr.remove()
        gc.collect()
    sim.check()


def test_the_feedback_monitor_times_phases_with_events_read_after_each_steps_synchronize() -> None:
    """The monitor's phases (`MeasuredPhases`) on the CUDA path: events on the compute stream around the forward
    and `optimizer.step()`, read only after the synchronize that ends each timed step (a read before it is a
    StreamOrderError), no synchronisation of its own."""
    model = tiny_model("llama")
    with simulated_cuda("caching") as sim:
        w = wrap(model, adamw(model), plan=plan_for(model, "all", n_chunks=8, n_buffers=2), feedback_steps=5)
        assert w.monitor is not None and w.monitor._clock.cuda
        syncs = []
        original = sim.synchronize

        def count(*args: Any) -> None:
            syncs.append(1)
            original(*args)

        torch.cuda.synchronize = count  # restored when simulated_cuda exits
        train(Trainer(w.model, w.optimizer), batches(5))
        fb = w.monitor.measured.sent
        timed = len(syncs)
        w.synchronize()
        unwrap(w)
        streams = {sim.stream_name(e) for e in sim.timing_events}
    assert fb is not None and fb.phases is not None and fb.steps_measured == 2
    # every chunk offloaded: each uploaded for forward (and again for backward: 2 buffers), the same every step
    uploads = fb.phases.uploads_per_iteration
    assert uploads is not None and uploads >= 8 and uploads == int(uploads)
    assert "compute (default stream)" in streams
    assert timed == 5, f"the monitor synchronised {timed} times over 5 steps (one per step, as before phases)"
    sim.check()
