"""Jobs the sharded-checkpoint tests run on every rank (issue 20; forked, gloo on CPU).

`save_job`: DDP (the reference) and memplan with sharded offloaded chunks train `SAVE_AT` steps on the rank's
own batches; memplan saves a sharded checkpoint (`agent.checkpoint.save_sharded`), DDP trains on uninterrupted
and records the losses the continuation must reproduce. `load_job`: memplan at another world size loads the
checkpoint and continues on the same data, each rank taking its share of the saving ranks' batches. Results go to
`<out>/rank<r>.json`.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from ddp_jobs import BATCH, adamw, batches, build_model, free_port, train
from ddp_jobs import Case as LoopCase
from sharded_jobs import TokenMLP, sharded_plan, state_rel_diff
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import agent
import agent.checkpoint
from agent.runtime import RuntimeOptions
from agent.runtime.optimizer import MASTER_KEY

SAVE_AT = 2  # steps before the checkpoint
AFTER = 2  # steps after it
SAVE_WORLD = 2  # ranks of the saving job: the data of the continuation is theirs


@dataclass
class CkptCase:
    directory: str
    kind: str = "hf-llama"  # a ddp_jobs.build_model kind, or "mlp" (sharded_jobs.TokenMLP)
    bf16: bool = False  # memplan computes in bf16 with fp32 masters
    offload: str = "all"  # sharded_jobs.sharded_plan's: "alternate" adds persistent (replicated) chunks
    tied: bool = False  # "mlp": the output head shares the embedding's weight (two state-dict names)
    device_shard: bool = False  # the persistent chunks sharded on the device too (ZeRO-3, `device_shards.py`)


def make_model(kind: str, *, tied: bool = False) -> nn.Module:
    torch.manual_seed(0)
    if kind != "mlp":
        return build_model(kind)
    model = TokenMLP()
    if tied:
        model.head.weight = model.embed.weight
    return model


def continuation(step: int, rank: int, world: int) -> torch.Tensor:
    """Batch `step` after the checkpoint of rank `rank` in a job of `world` ranks: the saving ranks' batches
    split evenly (world 1: all of them, one batch), so the mean loss over the ranks is the saving job's."""
    whole = torch.cat([batches(SAVE_AT + AFTER, r)[SAVE_AT + step] for r in range(SAVE_WORLD)])
    rows = SAVE_WORLD * BATCH // world
    return whole[rank * rows : (rank + 1) * rows]


def spawn(job: str, case: CkptCase, world: int, out: Path) -> list[dict[str, Any]]:
    mp.start_processes(
        _entry,
        args=(world, free_port(), job, asdict(case), str(out)),
        nprocs=world,
        join=True,
        start_method="fork",
    )
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def _entry(rank: int, world: int, port: int, job: str, case: dict[str, Any], out: str) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        jobs: dict[str, Callable[[int, int, CkptCase], dict[str, Any]]] = {"save": save_job, "load": load_job}
        result = jobs[job](rank, world, CkptCase(**case))
        (Path(out) / f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def save_job(rank: int, world: int, case: CkptCase) -> dict[str, Any]:
    assert world == SAVE_WORLD
    model = make_model(case.kind, tied=case.tied)
    if rank:  # ranks start apart: both variants take rank 0's model
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01 * rank)
    ref_model = copy.deepcopy(model)
    ref_opt = adamw(ref_model)
    ddp = DistributedDataParallel(ref_model)
    dtype = torch.bfloat16 if case.bf16 else torch.float32
    wrapped = agent.wrap(
        model,
        adamw(model),
        plan=sharded_plan(model, world, case.offload, dtype, device_shard=case.device_shard),
        options=RuntimeOptions(compute_dtype=dtype),
        feedback_steps=None,
    )
    data = batches(SAVE_AT + AFTER, rank)
    loop = LoopCase(steps=SAVE_AT)
    no_clip: Callable[[float], torch.Tensor] = lambda m: torch.zeros(())  # noqa: E731
    ref_before, _ = train(ddp, ref_opt, data[:SAVE_AT], loop, ddp.no_sync, no_clip)
    losses, _ = train(wrapped.model, wrapped.optimizer, data[:SAVE_AT], loop, wrapped.no_sync, no_clip)
    agent.checkpoint.save_sharded(wrapped, case.directory)
    written = sorted(p.name for p in Path(case.directory).iterdir())  # every file exists when save returns
    result: dict[str, Any] = {"losses": losses, "ref_before": ref_before, "written": written}
    gathered = wrapped.optimizer.state_dict()  # the full path: a collective on every rank
    if rank == 0:
        model_sd, optim_sd = agent.checkpoint.load_full(case.directory)
        masters = {i: st.pop(MASTER_KEY) for i, st in gathered["state"].items() if MASTER_KEY in st}
        result["full_vs_gathered_optimizer"] = state_rel_diff(optim_sd, gathered)
        names = [n for n, _ in model.named_parameters()]
        order = {id(p): n for n, p in model.named_parameters()}
        user = [order[id(p)] for g in wrapped.optimizer.param_groups for p in g["params"]]
        # the saved model values are the fp32 masters (mixed precision), not the bf16 compute copy
        result["model_dtypes"] = sorted({str(model_sd[n].dtype) for n in names})
        result["model_vs_masters"] = [float((model_sd[user[i]] - m).abs().max()) for i, m in masters.items()]
        # fp32 values a bf16 compute copy could not hold
        result["model_off_bf16"] = sum(
            int((model_sd[n].bfloat16().float() != model_sd[n]).sum()) for n in names
        )
        result["replicated_pieces"] = len(
            torch.load(Path(case.directory) / "meta.pt", weights_only=True)["replicated"]
        )
        torch.save(
            {"model": ref_model.state_dict(), "optimizer": ref_opt.state_dict()},
            Path(case.directory).parent / "ddp_at_save.pt",
        )
    dist.barrier()
    ref_after, _ = train(ddp, ref_opt, data[SAVE_AT:], LoopCase(steps=AFTER), ddp.no_sync, no_clip)
    result["ref_after"] = ref_after
    return result


def load_job(rank: int, world: int, case: CkptCase) -> dict[str, Any]:
    model = make_model(case.kind, tied=case.tied)
    dtype = torch.bfloat16 if case.bf16 else torch.float32
    wrapped = agent.wrap(
        model,
        adamw(model),
        plan=sharded_plan(model, world, case.offload, dtype, device_shard=case.device_shard),
        options=RuntimeOptions(compute_dtype=dtype),
        feedback_steps=None,
    )
    agent.checkpoint.load_sharded(wrapped, case.directory)
    result: dict[str, Any] = {"sharded_chunks": sum(st.shard is not None for st in wrapped.runtime.states)}
    if case.bf16:  # every rank's fp32 master shards, gathered, against the saved fp32 values
        gathered = wrapped.optimizer.state_dict()  # a collective
        saved, _ = agent.checkpoint.load_full(case.directory)
        order = {id(p): n for n, p in model.named_parameters()}
        user = [order[id(p)] for g in wrapped.optimizer.param_groups for p in g["params"]]
        result["masters_vs_saved"] = [
            float((st[MASTER_KEY] - saved[user[i]]).abs().max()) for i, st in gathered["state"].items()
        ]
    data = [continuation(s, rank, world) for s in range(AFTER)]
    no_clip: Callable[[float], torch.Tensor] = lambda m: torch.zeros(())  # noqa: E731
    result["losses"], _ = train(
        wrapped.model, wrapped.optimizer, data, LoopCase(steps=AFTER), wrapped.no_sync, no_clip
    )
    dist.barrier()
    return result
