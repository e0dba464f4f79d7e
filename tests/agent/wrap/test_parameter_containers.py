"""Parameters held by submodules that cannot run (session 26 probe).

`nn.ParameterList`, `nn.ParameterDict` and a bare `nn.Module` holding parameters have no forward of their own:
the module that owns them reads their parameters in its forward (per-layer scales in a ParameterList, a
`self.aux.scale`). Their own forward hooks never fire, so with those parameters in an offloaded chunk nothing
made the chunk resident: the parent read the host copy (correct by accident on a CPU, a device mismatch on a
GPU), or a buffer a prefetch was still writing (the stream checker's finding). Now the parent's hooks make them
resident (`agent.runtime.layout.hooked_parameters`), as for `nn.MultiheadAttention`'s `out_proj`.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

import agent
from agent.runtime import manual_plan
from agent.runtime.layout import hooked_parameters
from tests.agent.runtime.cuda_semantics.checker import simulated_cuda

TOL = 1e-5


class Scaled(nn.Module):
    """Linear layers scaled by parameters of a ParameterList, a ParameterDict and a bare container."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.layers = nn.ModuleList(nn.Linear(32, 32) for _ in range(3))
        self.scales = nn.ParameterList(nn.Parameter(torch.ones(32)) for _ in range(3))
        self.shifts = nn.ParameterDict({"a": nn.Parameter(torch.zeros(32))})
        self.aux = nn.Module()
        self.aux.gain = nn.Parameter(torch.ones(32))
        self.head = nn.Linear(32, 64)
        self.resident: list[bool] = []  # per forward: were the container parameters in a device buffer

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        self.resident.append(all(_in_buffer(p) for p in (*self.scales, self.shifts["a"], self.aux.gain)))
        x = self.emb(ids) * self.aux.gain + self.shifts["a"]
        for layer, scale in zip(self.layers, self.scales, strict=True):
            x = x + torch.tanh(layer(x)) * scale
        return nn.functional.cross_entropy(self.head(x).flatten(0, 1), ids.flatten())


BUFFERS: list[torch.Tensor] = []  # the wrapped runtime's device buffers (set by the test)


def _in_buffer(p: torch.Tensor) -> bool:
    at = p.data_ptr()
    return any(b.data_ptr() <= at < b.data_ptr() + b.numel() * b.element_size() for b in BUFFERS)


def test_the_parents_hooks_make_parameters_of_submodules_that_cannot_run_resident() -> None:
    torch.manual_seed(0)
    model = Scaled()
    hooked = {id(p) for p in hooked_parameters(model)}
    assert {id(p) for p in (*model.scales, model.shifts["a"], model.aux.gain)} <= hooked
    assert not {id(p) for p in model.layers.parameters()} & hooked  # the layers run: their own hooks
    ids = torch.randint(0, 64, (2, 16))
    reference = copy.deepcopy(model)
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for _ in range(3):
        reference(ids).backward()
        opt.step()
        opt.zero_grad()

    for simulated in (False, True):
        m = copy.deepcopy(model)
        # small chunks: the containers' parameters in other chunks than the root's and the layers'
        plan = manual_plan(m, chunk_size_bytes=8512, offload="all", n_buffers=3)
        assert plan.policy is not None and len(plan.policy.chunks) >= 3
        with simulated_cuda("caching") if simulated else _nothing() as sim:
            w = agent.wrap(m, torch.optim.AdamW(m.parameters(), lr=1e-2), plan=plan, feedback_steps=None)
            assert w.runtime.residency is not None
            BUFFERS[:] = [s.params for s in w.runtime.residency.pool.slots]
            for _ in range(3):
                w.model(ids).backward()
                w.optimizer.step()
                w.optimizer.zero_grad()
        if sim is not None:
            sim.check()
        assert m.resident and all(m.resident), m.resident
        for (name, p), q in zip(m.named_parameters(), reference.parameters(), strict=True):
            assert ((p.detach() - q.detach()).norm() / q.detach().norm()).item() <= TOL, name


class _nothing:  # noqa: N801 - a context manager standing in for `simulated_cuda`
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None
