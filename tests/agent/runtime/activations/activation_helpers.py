"""Shared helpers for the activation tests: plans with a mode strip, data, a training loop, comparisons."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from client.contract import ActivationMode, BlockPolicy, Chunk, Placement, Policy

TOL = 1e-5
VOCAB, SEQ, BATCH = 128, 16, 2


def policy_for(model: nn.Module, container: str, strip: str) -> Policy:
    """A policy with `strip` (K/C/S per repeated block) and keep for the prologue and epilogue."""
    blocks = [BlockPolicy(block=0, module="prologue[x]", mode=ActivationMode.keep)]
    for i, ch in enumerate(strip):
        blocks.append(
            BlockPolicy(block=i + 1, module=f"{container}.{i}", mode=ActivationMode.from_letter(ch))
        )
    blocks.append(BlockPolicy(block=len(strip) + 1, module="epilogue[x]", mode=ActivationMode.keep))
    return Policy(chunk_size_bytes=1, chunks=[], n_buffers=0, blocks=blocks)


def data(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (BATCH, SEQ), generator=g) for _ in range(n)]


def run(model: nn.Module, batches: list[torch.Tensor]) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    """Train with AdamW; losses per step and the gradients of every step (dropout on: seeded once)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch.manual_seed(1234)
    losses, grads = [], []
    for x in batches:
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})
        opt.step()
        opt.zero_grad()
    return losses, grads


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def assert_same_training(
    got: tuple[list[float], list[dict[str, torch.Tensor]]],
    ref: tuple[list[float], list[dict[str, torch.Tensor]]],
) -> None:
    for step, (a, b) in enumerate(zip(got[0], ref[0], strict=True)):
        assert abs(a - b) <= TOL * abs(b), f"step {step}: loss {a} vs {b}"
    for step, (ga, gb) in enumerate(zip(got[1], ref[1], strict=True)):
        assert ga.keys() == gb.keys()
        for name in gb:
            assert rel(ga[name], gb[name]) <= TOL, (
                f"step {step}: gradient of {name} differs by {rel(ga[name], gb[name])}"
            )


def block_aligned_policy(
    model: nn.Module, container: str, strip: str, offload: Callable[[int], bool], n_buffers: int
) -> Policy:
    """One chunk per block (prologue and epilogue parameters in their own chunks), as the solver lays out
    chunks (it never splits a block), with `strip`'s modes; `offload(chunk index)` picks placements."""
    groups: dict[str, list[tuple[str, int]]] = {}
    for name, p in model.named_parameters():
        key = (
            name[: name.index(".", len(container) + 1)]
            if name.startswith(container + ".")
            else ("prologue" if not groups or list(groups)[-1] == "prologue" else "epilogue")
        )
        groups.setdefault(key, []).append((name, p.numel() * p.element_size()))
    size = max(sum(b for _, b in g) for g in groups.values())
    chunks = [
        Chunk(
            index=i,
            placement=Placement.offloaded if offload(i) else Placement.persistent,
            parameters=[n for n, _ in g],
            blocks=[],
            used_bytes=sum(b for _, b in g),
        )
        for i, g in enumerate(groups.values())
    ]
    has_off = any(c.placement == Placement.offloaded for c in chunks)
    return Policy(
        chunk_size_bytes=size,
        chunks=chunks,
        n_buffers=n_buffers if has_off else 0,
        blocks=policy_for(model, container, strip).blocks,
    )
