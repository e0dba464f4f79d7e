"""A parameter of an offloaded chunk read outside its own module's forward (session 27).

Custom language models often tie the output projection to the embedding by reading the embedding's weight in
the root's forward: `F.linear(h, self.embed.weight)`, or `h @ self.embed.weight.t()`. The embedding's module ran
at the start of the forward; by the end its offloaded chunk was evicted, and its parameters pointed at the host
copy. On a CPU device that reads the right values; on a GPU the op mixes a host tensor with device ones and
raises ("Expected all tensors to be on the same device"). Since session 27 the runtime, on CUDA, watches the
ops of a forward for parameters of offloaded chunks no running module holds (`ForeignReads`) and makes the chunk
resident for the op (kept until the root forward ends where the op's result views the buffer).

The GPU failure cannot happen on a CPU, so the check is what would fail there: on the CUDA path under the
stream-order checker, a probe sees every op's arguments after the runtime's handling and records any parameter
of an offloaded chunk still bound to its host copy. Before session 27 the tied read was recorded (and the losses
were right, by the CPU's accident); now no read is, the losses and parameters equal plain PyTorch, and the
stream checker finds no violation (the read waits for the chunk's upload).
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import pytest
import torch
from runtime_helpers import param_rel_diff
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from agent.runtime import manual_plan
from agent.wrapping import Wrapped, wrap
from tests.agent.runtime.cuda_semantics.checker import simulated_cuda

VOCAB = 64
HIDDEN = 32
TOL = 1e-5


class TiedByRoot(nn.Module):
    """An embedding, four residual layers, a norm; the root reads the embedding's weight for the output."""

    def __init__(self, transposed: bool) -> None:
        super().__init__()
        self.transposed = transposed
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(nn.Linear(HIDDEN, HIDDEN) for _ in range(4))
        self.norm = nn.LayerNorm(HIDDEN)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for layer in self.layers:
            h = h + torch.tanh(layer(h))
        h = self.norm(h)
        # the two ways research code writes a tied output: the weight itself, or a view of it
        logits = h @ self.embed.weight.t() if self.transposed else nn.functional.linear(h, self.embed.weight)
        return nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten())


class HostReads(TorchDispatchMode):
    """Records each op (below autograd: what runs as a kernel) that reads the host copy of an offloaded chunk;
    copies (uploads, write-backs) and views (no data read) excepted. On a GPU such an op mixes a host tensor with
    device ones."""

    def __init__(self) -> None:
        super().__init__()
        self.wrapped: Wrapped | None = None
        self.found: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self.wrapped is not None and func not in _COPIES and not _is_view(func):
            for t in tree_flatten((args, kwargs))[0]:
                if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                    for st in self.wrapped.runtime.states:
                        host = st.host_params
                        if st.offloaded and host is not None and _inside(t, host):
                            self.found.append(f"{func} read the host copy of chunk {st.index}")
        return func(*args, **kwargs)


_COPIES = {torch.ops.aten.copy_.default, torch.ops.aten._to_copy.default, torch.ops.aten.clone.default}


def _is_view(func: Any) -> bool:
    schema = func._schema
    return (
        bool(schema.returns)
        and all(r.alias_info is not None for r in schema.returns)
        and not any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)
    )


def _inside(t: torch.Tensor, host: torch.Tensor) -> bool:
    start = host.untyped_storage().data_ptr()
    return (
        t.untyped_storage().nbytes() > 0 and start <= t.data_ptr() < start + host.untyped_storage().nbytes()
    )


def _train(model: nn.Module, opt: torch.optim.Optimizer, probe: HostReads | None = None) -> list[float]:
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(3):
        ids = torch.randint(0, VOCAB, (2, 8), generator=g)
        with probe if probe is not None else contextlib.nullcontext():
            loss = model(ids)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("transposed", [False, True], ids=["linear", "matmul-of-a-view"])
def test_a_tied_weight_read_by_the_root_is_resident_on_the_cuda_path(transposed: bool) -> None:
    torch.manual_seed(0)
    ref = TiedByRoot(transposed)
    model = copy.deepcopy(ref)
    ref_losses = _train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2))
    probe = HostReads()
    with simulated_cuda("caching") as sim:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        # one chunk per parameter group of about the embedding's size; two buffers, so the embedding's chunk is
        # evicted by the layers' before the root reads it
        plan = manual_plan(model, chunk_size_bytes=VOCAB * HIDDEN * 4, offload="all", n_buffers=2)
        wrapped = wrap(model, opt, plan=plan, feedback_steps=None)
        probe.wrapped = wrapped
        losses = _train(wrapped.model, wrapped.optimizer, probe)
    sim.check()
    assert probe.found == [], probe.found[:4]
    assert wrapped.runtime.counters.foreign_reads >= 3, wrapped.runtime.counters  # once per forward at least
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses, strict=True)) <= TOL
    assert param_rel_diff(model, ref)[0] <= TOL
