"""An offloaded chunk that backward uses again after its speculative host step (session 26).

A block run several times per forward under re-entrant activation checkpointing (a looped or weight-shared
transformer; ALBERT's shared layer) gets its gradients once per pass, each pass's inner backward on its own: its
chunk completes at the first pass's gradients, the runtime steps it speculatively on the host, and the next pass
recomputes the block. Until session 26 that recomputation used the stepped parameters (2% off plain PyTorch
after two optimizer steps); now the step is undone before the block runs again, and the chunk is no longer
stepped during backward (`ChunkState.reused`). On the CPU and on the CUDA path under the stream-order checker.
"""

from __future__ import annotations

import pytest
import torch
from runtime_helpers import param_rel_diff
from torch import nn
from torch.utils.checkpoint import checkpoint

from agent.runtime import RuntimeOptions, manual_plan
from agent.wrapping import Wrapped, wrap
from client.contract import Placement
from tests.agent.runtime.cuda_semantics.checker import simulated_cuda

HIDDEN = 16
VOCAB = 32


class Looped(nn.Module):
    """One block run three times per forward under re-entrant checkpointing, between an embedding and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.block = nn.Linear(HIDDEN, HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def _pass(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.block(x))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for _ in range(3):
            x = checkpoint(self._pass, x, use_reentrant=True)
        return nn.functional.cross_entropy(self.head(x).flatten(0, 1), ids.flatten())


def _train(wrapped: bool, placement: str) -> tuple[nn.Module, Wrapped | None]:
    """4 micro-steps, a step after every second (AdamW); `placement`: every chunk offloaded ("all") or the
    block's alone ("block": the embedding and the head persistent)."""
    torch.manual_seed(0)
    model = Looped()
    opt: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    data = [torch.randint(0, VOCAB, (2, 8), generator=g) for _ in range(4)]
    run: nn.Module = model
    w = None
    if wrapped:
        block = {"block.weight", "block.bias"}

        def where(i: int, n: int) -> Placement:
            return Placement.offloaded

        plan = manual_plan(model, chunk_size_bytes=2048, offload=where, n_buffers=2)
        assert plan.policy is not None
        if placement == "block":
            chunks = [
                c.model_copy(
                    update={
                        "placement": Placement.offloaded
                        if set(c.parameters) & block
                        else Placement.persistent
                    }
                )
                for c in plan.policy.chunks
            ]
            plan = plan.model_copy(update={"policy": plan.policy.model_copy(update={"chunks": chunks})})
        w = wrap(model, opt, plan=plan, feedback_steps=None, options=RuntimeOptions())
        run, opt = w.model, w.optimizer
    for i, x in enumerate(data):
        run(x).backward()
        if i % 2:
            opt.step()
            opt.zero_grad()
    return model, w


@pytest.mark.parametrize("placement", ["all", "block"])
def test_a_block_recomputed_after_its_chunks_speculative_step_sees_the_parameters_before_it(
    placement: str,
) -> None:
    ref, _ = _train(False, placement)
    model, w = _train(True, placement)
    assert w is not None
    diff, name = param_rel_diff(model, ref)
    assert diff <= 1e-5, (diff, name)
    # the block's chunk completed at its first pass, was stepped, undone when the next pass recomputed the block,
    # and is not stepped during backward since (the other offloaded chunks are)
    reused = {e.name for st in w.runtime.states if st.reused for e in st.spec.entries}
    assert reused == {"block.weight", "block.bias"}, reused
    assert w.runtime.counters.speculative_steps >= 1, w.runtime.counters
    with simulated_cuda("caching") as sim:
        simulated, _ = _train(True, placement)
    sim.check()
    diff, name = param_rel_diff(simulated, ref)
    assert diff <= 1e-5, (diff, name)
