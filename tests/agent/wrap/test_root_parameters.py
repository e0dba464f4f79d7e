"""Parameters of a module whose forward runs the other chunks' modules: the root's own (timm's ViT and minGPT
keep `pos_embed` on the root; a root-level temperature the forward may not even use).

Defect (session 32, found by an exploratory run): the runtime pinned such a module's chunk for its whole forward,
so with one device buffer no chunk inside could be uploaded: the solver's plan for a custom model with a
root-level `pos_embed` raised "all 1 device buffers hold chunks in use" at the first training forward, at every
limit that made the solver offload. Now, where pinning them would hold every buffer, they are read where resident
and otherwise as foreign reads (`agent/runtime/foreign_reads.py`), and their gradients are expected as before.
"""

from __future__ import annotations

import copy
from contextlib import nullcontext

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import agent
from agent.runtime import manual_plan
from tests.agent.runtime.cuda_semantics.checker import simulated_cuda

V, H, SEQ = 1024, 128, 32
TOL = 1e-5


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(H)
        self.fc1 = nn.Linear(H, 4 * H)
        self.fc2 = nn.Linear(4 * H, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class RootParameters(nn.Module):
    """Embedding, three residual blocks, an untied head; on the root a position embedding read before the blocks,
    a scale read after them, and a temperature the forward never reads."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, H)
        self.pos_embed = nn.Parameter(torch.randn(1, SEQ, H) * 0.02)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.out_scale = nn.Parameter(torch.ones(H))
        self.temperature = nn.Parameter(torch.tensor(1.0))  # unused by forward (a user's leftover)
        self.head = nn.Linear(H, V, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids) + self.pos_embed
        for block in self.blocks:
            x = block(x)
        return self.head(x * self.out_scale)


def lm_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1))


def train(
    model: nn.Module, optimizer: torch.optim.Optimizer, ids: torch.Tensor, steps: int = 3
) -> list[float]:
    losses = []
    for _ in range(steps):
        loss = lm_loss(model(ids), ids)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


@pytest.fixture
def job() -> tuple[RootParameters, torch.Tensor, list[float], RootParameters]:
    torch.manual_seed(0)
    model = RootParameters()
    ids = torch.randint(0, V, (2, SEQ))
    reference = copy.deepcopy(model)
    expected = train(reference, adamw(reference), ids)
    return model, ids, expected, reference


def check_same(model: nn.Module, losses: list[float], expected: list[float], reference: nn.Module) -> None:
    assert losses == pytest.approx(expected, rel=TOL)
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert ((p.detach() - q.detach()).norm() / q.detach().norm()).item() <= TOL, name


def test_the_solvers_plan_trains_a_model_with_root_parameters_like_plain_pytorch(job) -> None:
    model, ids, expected, reference = job
    probe = copy.deepcopy(model)
    peak = agent.profile(
        probe, ids, optimizer=adamw(probe), loss_fn=lm_loss, repeats=1, allocation_trace=False
    ).measurements.peak_device_bytes
    wrapped = agent.wrap(
        model,
        adamw(model),
        sample_batch=ids,
        loss_fn=lm_loss,
        device_memory=int(peak * 0.7),
        feedback_steps=None,
    )
    policy = wrapped.plan.policy
    assert policy is not None and any(c.placement.value == "offloaded" for c in policy.chunks), policy.chunks
    losses = train(wrapped.model, wrapped.optimizer, ids)
    agent.unwrap(wrapped)
    check_same(model, losses, expected, reference)


@pytest.mark.parametrize("simulated", [False, True], ids=["cpu", "simulated-cuda"])
def test_one_buffer_every_chunk_offloaded_with_root_parameters(job, simulated: bool) -> None:
    # the root's chunk (with the embedding) and every block's offloaded through one buffer: the root's parameters
    # are read as foreign reads (on simulated CUDA: uploaded for the op, the stream order checked)
    model, ids, expected, reference = job
    plan = manual_plan(model, chunk_size_bytes=2**20, offload="all", n_buffers=1)
    assert plan.policy is not None and len(plan.policy.chunks) >= 3
    with simulated_cuda("caching") if simulated else nullcontext() as sim:
        wrapped = agent.wrap(model, adamw(model), plan=plan, loss_fn=lm_loss, feedback_steps=None)
        losses = train(wrapped.model, wrapped.optimizer, ids)
        agent.unwrap(wrapped)
    if sim is not None:
        sim.check()
    check_same(model, losses, expected, reference)
