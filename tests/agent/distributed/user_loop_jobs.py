"""Jobs of the new-user QA pass of the multi-rank path: what a DDP user's own loop does (forked, gloo on CPU).

`habits`: a Hugging Face gpt2 at the library's defaults (tied wte/lm_head, dropout) with its first block frozen,
every offloaded chunk sharded, trained by plain `DistributedDataParallel` (the reference) and by `agent.wrap`
through the things a DDP user does between steps: a forward without backward, an evaluation under no_grad
and `generate` on rank 0 only, a no_grad forward in the middle of gradient accumulation, an uneven last
batch (rank 1 gets fewer rows), then `agent.unwrap` on every rank and plain DDP training of the unwrapped
model. `misuses`: DDP habits that do not fit: `DistributedDataParallel(wrapped.model)`, and the checkpoint habit,
`optimizer.state_dict()` (and `agent.unwrap`) on rank 0 alone.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from ddp_jobs import VOCAB, adamw, batches, free_port, join_ranks
from sharded_jobs import sharded_plan
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import agent
from agent.runtime import RuntimeOptions
from agent.testing.model_zoo import build_with_library_defaults

ARRIVAL_TIMEOUT_S = 2.0


def spawn(job: str, world: int, out: Path, limit_s: float, shm: Path | None = None) -> list[int | None]:
    """Run `job` on `world` forked ranks (node-shared copies in `shm`, default /dev/shm); the exit codes (None:
    still running after `limit_s`, then killed)."""
    port = free_port()
    ctx = mp.get_context("fork")
    procs = [
        ctx.Process(target=_entry, args=(job, r, world, port, str(out), str(shm or "/dev/shm")))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    codes = join_ranks(procs, limit_s)
    return codes


def _entry(job: str, rank: int, world: int, port: int, out: str, shm: str) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    if job == "habits":
        result = habits(rank, world, shm)
        (Path(out) / f"rank{rank}.json").write_text(json.dumps(result))
        dist.destroy_process_group()
        return
    result = misuses(rank, world)
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(result))
    os._exit(0)  # the ranks parted on purpose: no collective (destroy_process_group) can finish


def _gpt2() -> nn.Module:
    model, _ = build_with_library_defaults("gpt2", layers=2, hidden=64, vocab=VOCAB, seq=32, seed=0)
    return model


def _rel_diff(a: nn.Module, b: nn.Module) -> tuple[float, str]:
    """Largest ||a - b|| / ||b|| over the parameters, and its name; without the key third of gpt2's attention
    bias (`c_attn.bias`): its gradient is zero in exact arithmetic (a key bias shifts every score of a query
    alike), so it holds rounding noise that AdamW scales up to full steps, differently for any other
    summation order (DDP's and memplan's accumulation alike), and is no measure of training."""
    worst, name = 0.0, ""
    bs = dict(b.named_parameters())
    for n, p in a.named_parameters():
        x, y = p.detach().double().clone(), bs[n].detach().double().clone()
        if n.endswith("c_attn.bias"):
            third = x.numel() // 3
            x[third : 2 * third] = y[third : 2 * third] = 0
        d = ((x - y).norm() / y.norm().clamp_min(1e-12)).item()
        if d > worst:
            worst, name = d, n
    return worst, name


def _step(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    x: torch.Tensor,
    no_sync: Callable[[], contextlib.AbstractContextManager[None]],
    *,
    nograd_in_between: bool = False,
) -> float:
    """One optimizer step over two micro-batches (the first inside `no_sync`), dropout seeded by the batch;
    `nograd_in_between`: a no_grad forward between them (an evaluation in the middle of accumulation)."""
    torch.manual_seed(int(x.sum()))
    first, second = x.chunk(2)
    with no_sync():
        loss = model(input_ids=first, labels=first).loss / 2
        loss.backward()
    total = loss.item()
    if nograd_in_between:
        with torch.no_grad():
            model(input_ids=first, labels=first)
    loss = model(input_ids=second, labels=second).loss / 2
    loss.backward()
    opt.step()
    opt.zero_grad()
    return total + loss.item()


def habits(rank: int, world: int, shm: str) -> dict[str, Any]:
    model = _gpt2()
    for p in model.transformer.h[0].parameters():  # type: ignore[union-attr]
        p.requires_grad_(False)
    ref_model = copy.deepcopy(model)
    ddp = DistributedDataParallel(ref_model)
    ref_opt = adamw(ref_model)
    opt = adamw(model)
    wrapped = agent.wrap(
        model,
        opt,
        plan=sharded_plan(model, world, "all"),
        options=RuntimeOptions(shared_memory_dir=shm),
        feedback_steps=None,
    )
    shared = wrapped.runtime.shared is not None
    data = batches(5, rank)
    data[-1] = data[-1][: 2 if rank else 4]  # the uneven last batch
    ref_losses: list[float] = []
    losses: list[float] = []
    evals: list[list[float]] = []
    generated: list[list[int]] = []
    for i, x in enumerate(data):
        if i == 1:  # a forward without backward (grad enabled), on every rank
            for m in (ddp.module, wrapped.model):
                torch.manual_seed(0)
                m(input_ids=x, labels=x)
        ref_losses.append(_step(ddp, ref_opt, x, ddp.no_sync, nograd_in_between=i == 2))
        losses.append(_step(wrapped.model, wrapped.optimizer, x, wrapped.no_sync, nograd_in_between=i == 2))
        if rank == 0:  # evaluation and generation on the main process only
            pair = []
            for m in (ddp.module, wrapped.model):
                m.eval()
                with torch.no_grad():
                    pair.append(float(m(input_ids=x, labels=x).loss))
                    if i == 0:
                        out = m.generate(x[:1, :4], max_new_tokens=4, do_sample=False)  # type: ignore[operator]
                        generated.append([int(t) for t in out.flatten()])
                m.train()
            evals.append(pair)
    trained = _rel_diff(wrapped.model, ref_model)
    frozen_before = list(_gpt2().transformer.h[0].parameters())  # type: ignore[union-attr]
    sharded = sum(st.shard is not None for st in wrapped.runtime.states)
    tied = wrapped.model.lm_head.weight is wrapped.model.transformer.wte.weight  # type: ignore[union-attr]
    plain = agent.unwrap(wrapped)  # every rank (a collective with sharded chunks)
    frozen_after = list(plain.transformer.h[0].parameters())  # type: ignore[union-attr]
    again = DistributedDataParallel(plain)
    after: list[list[float]] = []
    for x in batches(2, 10 + rank):
        after.append([_step(ddp, ref_opt, x, ddp.no_sync), _step(again, opt, x, again.no_sync)])
    return {
        "sharded": sharded,
        "shared": shared,
        "shm_left": sorted(os.listdir(shm)),
        "tied": tied,
        "ref_losses": ref_losses,
        "losses": losses,
        "evals": evals,
        "generated": generated,
        "trained_rel_diff": trained,
        "after_unwrap": after,
        "after_rel_diff": _rel_diff(plain, ref_model),
        "frozen_unchanged": all(torch.equal(a, b) for a, b in zip(frozen_after, frozen_before, strict=True)),
    }


def misuses(rank: int, world: int) -> dict[str, Any]:
    """`DistributedDataParallel(wrapped.model)` on every rank; train a step, then rank 0 alone gathers the optimizer state (the DDP habit) while rank 1 goes on to a
    barrier: rank 0 must get an error naming the cause within the arrival timeout, not hang."""
    model = _gpt2()
    opt = adamw(model)
    wrapped = agent.wrap(
        model,
        opt,
        plan=sharded_plan(model, world, "all"),
        options=RuntimeOptions(rank_arrival_timeout_s=ARRIVAL_TIMEOUT_S),
        feedback_steps=None,
    )
    try:  # the DDP habit of wrapping the model: memplan averages the gradients already
        DistributedDataParallel(wrapped.model)
        ddp_error = None
    except Exception as exc:  # noqa: BLE001 - the test reads the error
        ddp_error = f"{type(exc).__name__}: {exc}"
    x = batches(1, rank)[0]
    wrapped.model(input_ids=x, labels=x).loss.backward()
    wrapped.optimizer.step()
    # every rank: the check passes and the gather works
    everyone = wrapped.optimizer.state_dict()
    result: dict[str, Any] = {"every_rank_states": len(everyone["state"]), "ddp_error": ddp_error}
    if rank == 0:
        for name, call in (
            ("error", wrapped.optimizer.state_dict),
            ("unwrap_error", lambda: agent.unwrap(wrapped)),
        ):
            start = time.monotonic()
            try:
                call()
            except Exception as exc:  # noqa: BLE001 - the test reads the error
                result[name] = f"{type(exc).__name__}: {exc}"
            result[f"{name}_seconds"] = time.monotonic() - start
    else:
        with contextlib.suppress(Exception):  # rank 0 leaves this barrier by exiting
            dist.barrier()
    return result
