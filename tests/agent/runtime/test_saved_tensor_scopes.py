"""The chunk runtime's saved-tensor hooks run only where a saved tensor can live in a device buffer."""

from __future__ import annotations

import torch
from runtime_helpers import batches, clone, max_rel_diff, param_rel_diff, plan_for, tiny_model
from torch import nn

from agent.runtime import manual_plan, timing
from agent.wrapping import wrap

STEPS = 6
TOL = 1e-6


def adamw(m: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True)


class Counting:
    """Counts the tensors autograd saves (identity saved-tensor hooks around one call)."""

    def __init__(self) -> None:
        self.n = 0

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        self.n += 1
        return t


def test_only_modules_owning_offloaded_parameters_pass_their_saved_tensors_through_the_runtime() -> None:
    """Before: the whole forward was hooked once any chunk was offloaded, so every saved tensor of every
    block (persistent chunks' too) paid two calls from autograd into Python."""
    base = tiny_model("llama")
    x = batches(1)[0]
    plain = clone(base)
    count = Counting()
    with torch.autograd.graph.saved_tensors_hooks(count.pack, lambda t: t):
        loss = plain(input_ids=x, labels=x).loss
    loss.backward()

    model = clone(base)
    w = wrap(
        model, adamw(model), plan=plan_for(model, [0], n_buffers=1), feedback_steps=None
    )  # embedding only
    manager = w.runtime
    assert manager is not None
    packed = Counting()

    def count_packs(name: str, seconds: float, depth: int) -> None:  # the runtime's timing hook
        if name == timing.PACK:
            packed.n += 1

    manager.timing.add_listener(count_packs)
    for i in range(2):
        packed.n = 0
        w.model(input_ids=x, labels=x).loss.backward()
        w.optimizer.step()
        w.optimizer.zero_grad()
        if i == 0:  # the first forward checks the whole forward (its hook calls pack_saved for every tensor)
            assert manager.saved is not None and manager.saved.saved_outside is False
    assert 0 < packed.n < count.n // 10, (packed.n, count.n)


class OutsideUse(nn.Module):
    """A model that uses a parameter outside its own module (`h @ first.weight`), the case that needs the
    whole forward hooked: with one buffer, `second`'s upload overwrites `first`'s chunk before backward."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.emb = nn.Embedding(width, width)
        self.first = nn.Linear(width, width, bias=False)
        self.second = nn.Linear(width, width, bias=False)
        self.head = nn.Linear(width, width, bias=False)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(self.emb(x))
        h = torch.tanh(
            h @ self.first.weight.t()
        )  # saves a view of first.weight (in the buffer), outside `first`
        logits = self.head(self.second(h))
        return nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), x.reshape(-1))


def test_a_parameter_saved_outside_its_module_makes_the_runtime_hook_the_whole_forward() -> None:
    base = OutsideUse()
    data = [torch.randint(0, 16, (2, 8), generator=torch.Generator().manual_seed(i)) for i in range(STEPS)]

    def loop(model: nn.Module, opt: torch.optim.Optimizer) -> list[float]:
        out = []
        for x in data:
            loss = model(x)
            loss.backward()
            opt.step()
            opt.zero_grad()
            out.append(loss.item())
        return out

    ref_model = clone(base)
    ref = loop(ref_model, adamw(ref_model))
    model = clone(base)
    plan = manual_plan(model, chunk_size_bytes=16 * 16 * 4, offload="all", n_buffers=1)
    assert len(plan.policy.chunks) == 4  # type: ignore[union-attr]
    w = wrap(model, adamw(model), plan=plan, feedback_steps=None)
    got = loop(w.model, w.optimizer)
    assert w.runtime is not None and w.runtime.saved is not None and w.runtime.saved.saved_outside is True
    assert max_rel_diff(got, ref) <= TOL
    w.synchronize()
    assert param_rel_diff(model, ref_model)[0] <= TOL
    assert ref[-1] < ref[0]
