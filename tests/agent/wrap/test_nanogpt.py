"""nanoGPT as its users run it (session 24 probe): a model that is not Hugging Face's, through `agent.wrap`.

karpathy/nanoGPT's `model.py` (abridged to what memplan meets: its own LayerNorm with optional bias, SDPA with
dropout, `transformer.wte.weight = lm_head.weight` tying the embedding to the head rather than the head to the
embedding, a forward taking `(idx, targets)` and returning `(logits, loss)`, `configure_optimizers`' two weight
decay groups) and `train.py`'s loop as written: the learning rate set each iteration by assigning
`param_group['lr']` on the optimizer it built (the original object, not `wrapped.optimizer`), gradient
accumulation with the loss divided, the next batch fetched between forward and backward, a disabled GradScaler's
`scale`/`unscale_`/`step`/`update`, clipping at 1.0, `zero_grad(set_to_none=True)`, then `generate` after
training. Every chunk offloaded, its four blocks kept, checkpointed, swapped and kept (dropout on: the recompute
must draw the forward's masks). Losses and parameters equal plain PyTorch's.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import agent
from agent.testing.plans import offloaded_plan

pytestmark = pytest.mark.slow


@dataclass
class GPTConfig:
    block_size: int = 64
    vocab_size: int = 512
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 64
    dropout: float = 0.1
    bias: bool = True


class LayerNorm(nn.Module):
    def __init__(self, ndim: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head, self.n_embd, self.dropout = config.n_head, config.n_embd, config.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=None, dropout_p=self.dropout if self.training else 0, is_causal=True
        )
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            {
                "wte": nn.Embedding(config.vocab_size, config.n_embd),
                "wpe": nn.Embedding(config.block_size, config.n_embd),
                "drop": nn.Dropout(config.dropout),
                "h": nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                "ln_f": LayerNorm(config.n_embd, bias=config.bias),
            }
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # nanoGPT's tying: the embedding takes the head's
        self.apply(self._init_weights)
        for pn, p in self.named_parameters():
            if pn.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> tuple[torch.Tensor, Any]:
        t = idx.size(1)
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        if targets is not None:
            logits = self.lm_head(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
            return logits, loss
        return self.lm_head(x[:, [-1], :]), None

    def configure_optimizers(self, weight_decay: float, learning_rate: float) -> torch.optim.Optimizer:
        params = {pn: p for pn, p in self.named_parameters() if p.requires_grad}
        groups = [
            {"params": [p for p in params.values() if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params.values() if p.dim() < 2], "weight_decay": 0.0},
        ]
        return torch.optim.AdamW(groups, lr=learning_rate, betas=(0.9, 0.95))

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        for _ in range(max_new_tokens):
            logits, _ = self(idx[:, -self.config.block_size :])
            probs = F.softmax(logits[:, -1, :], dim=-1)
            idx = torch.cat((idx, torch.multinomial(probs, num_samples=1)), dim=1)
        return idx


ITERS, ACCUM = 5, 2


def get_lr(it: int, warmup: int = 2, decay: int = 8, lr: float = 6e-4, min_lr: float = 6e-5) -> float:
    if it < warmup:
        return lr * (it + 1) / (warmup + 1)
    if it > decay:
        return min_lr
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * (it - warmup) / (decay - warmup))) * (lr - min_lr)


def get_batch(i: int, B: int = 4, T: int = 64, V: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    data = torch.randint(0, V, (B * T + 1,), generator=torch.Generator().manual_seed(i))
    x = torch.stack([data[j * T : (j + 1) * T] for j in range(B)])
    y = torch.stack([data[j * T + 1 : (j + 1) * T + 1] for j in range(B)])
    return x, y


def train(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[float]:
    """nanoGPT's train.py loop (one process, fp32 on the CPU: its GradScaler is disabled)."""
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    losses = []
    torch.manual_seed(1337)
    X, Y = get_batch(0)
    for it in range(ITERS):
        for param_group in optimizer.param_groups:
            param_group["lr"] = get_lr(it)
        for micro_step in range(ACCUM):
            _, loss = model(X, Y)
            loss = loss / ACCUM
            X, Y = get_batch(it * ACCUM + micro_step + 1)  # async prefetch in nanoGPT: before backward
            scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item() * ACCUM)
    return losses


def second(output: tuple[torch.Tensor, torch.Tensor], batch: Any) -> torch.Tensor:
    return output[1]


def test_nanogpt_trains_with_its_own_loop_like_plain_pytorch() -> None:
    torch.manual_seed(1337)
    model = GPT(GPTConfig())
    reference = copy.deepcopy(model)
    expected = train(reference, reference.configure_optimizers(0.1, 6e-4))

    optimizer = model.configure_optimizers(0.1, 6e-4)
    batch = get_batch(0)
    plan = offloaded_plan(model, batch, "KCSK", loss_fn=second)
    wrapped = agent.wrap(model, optimizer, sample_batch=batch, loss_fn=second, plan=plan, feedback_steps=None)
    assert model.transformer.wte.weight is model.lm_head.weight  # the tie is kept
    got = train(wrapped.model, optimizer)  # nanoGPT's names: the optimizer it built stays in use
    trained = agent.unwrap(wrapped)

    assert got == pytest.approx(expected, rel=1e-5)
    for (name, p), q in zip(trained.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    assert optimizer.param_groups[0]["lr"] == pytest.approx(get_lr(ITERS - 1))
    trained.eval()
    assert trained.generate(torch.zeros((1, 1), dtype=torch.long), 4).shape == (1, 5)
