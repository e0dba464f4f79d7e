"""Jobs the sharded-chunk tests run on every rank (issue 20; forked, gloo on CPU).

Each job trains the same model with plain `DistributedDataParallel` (the reference) and with `agent.wrap`
under a plan whose offloaded chunks are sharded (`Chunk.sharded`, `Policy.world_size`), on this rank's own
batches, and writes what it measured to `<out>/rank<r>.json`. The loop, data and comparisons are
`ddp_jobs`'s.
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from ddp_jobs import VOCAB, adamw, batches, build_model, checksum, free_port, rel_diff, train
from ddp_jobs import Case as LoopCase
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import agent
from agent.runtime import RuntimeOptions, manual_plan
from client.contract import Placement, Plan


@dataclass
class ShardCase:
    kind: str = "hf-llama"  # "hf-llama" (library defaults), a model_zoo kind, or "mlp" (TokenMLP)
    offload: str = "all"  # "all", or "alternate" (persistent and sharded offloaded chunks)
    steps: int = 4
    clip: float | None = None
    micro: int = 1
    no_sync: bool = False
    save: str | None = None  # every rank gathers the full state dicts; rank 0 writes them here
    load: str | None = None  # both variants start from this checkpoint (memplan's, saved at any world size)
    bf16: bool = False  # memplan computes in bf16 with an fp32 master (DDP stays fp32)
    unwrap: bool = False  # end with agent.unwrap: the trained model and optimizer state back in plain PyTorch


class TokenMLP(nn.Module):
    """A small MLP language model (sizes chosen so no chunk divides evenly into 4-element shards)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 20)
        self.up = nn.Linear(20, 37)
        self.down = nn.Linear(37, 20)
        self.head = nn.Linear(20, VOCAB)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> Any:
        h = self.embed(input_ids)
        h = h + self.down(torch.nn.functional.gelu(self.up(h)))
        logits = self.head(h)
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return type("Out", (), {"loss": loss})()


def sharded_plan(model: nn.Module, world: int, offload: str, dtype: torch.dtype = torch.float32) -> Plan:
    """A hand-built plan for `world` ranks with every offloaded chunk sharded."""
    sizes = [p.numel() * dtype.itemsize for p in model.parameters()]
    chunk = -(-max(max(sizes), -(-sum(sizes) // 5)) // 64) * 64 + 48  # 48: chunks end off a shard boundary
    rule: Any = "all" if offload == "all" else (lambda i, n: Placement(("persistent", "offloaded")[i % 2]))
    plan = manual_plan(model, chunk_size_bytes=chunk, offload=rule, n_buffers=2, compute_dtype=dtype)
    assert plan.policy is not None
    chunks = [
        c.model_copy(update={"sharded": c.placement == Placement.offloaded}) for c in plan.policy.chunks
    ]
    policy = plan.policy.model_copy(update={"chunks": chunks, "world_size": world})
    return plan.model_copy(update={"policy": policy})


def spawn(case: ShardCase, world: int, out: Path) -> list[dict[str, Any]]:
    mp.start_processes(
        _entry,
        args=(world, free_port(), asdict(case), str(out)),
        nprocs=world,
        join=True,
        start_method="fork",
    )
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def _entry(rank: int, world: int, port: int, case: dict[str, Any], out: str) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = compare_sharded_with_ddp(rank, world, ShardCase(**case))
        (Path(out) / f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def state_rel_diff(a: dict[str, Any], b: dict[str, Any]) -> float:
    """Largest relative difference between two plain-PyTorch optimizer state dicts' tensors (same keys)."""
    assert a["state"].keys() == b["state"].keys(), (sorted(a["state"]), sorted(b["state"]))
    worst = 0.0
    for idx, sa in a["state"].items():
        sb = b["state"][idx]
        assert sa.keys() == sb.keys(), (idx, sa.keys(), sb.keys())
        for k, va in sa.items():
            vb = sb[k]
            assert va.shape == vb.shape, (idx, k, va.shape, vb.shape)
            d = ((va.double() - vb.double()).norm() / vb.double().norm().clamp_min(1e-12)).item()
            worst = max(worst, d)
    return worst


def compare_sharded_with_ddp(rank: int, world: int, case: ShardCase) -> dict[str, Any]:
    torch.manual_seed(0)
    model = TokenMLP() if case.kind == "mlp" else build_model(case.kind)
    if rank:  # ranks start apart: both variants take rank 0's model
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01 * rank)
    ref_model = copy.deepcopy(model)
    ref_opt = adamw(ref_model)
    opt = adamw(model)
    if case.load is not None:
        ckpt = torch.load(case.load, weights_only=True)
        for m, o in ((ref_model, ref_opt), (model, opt)):
            m.load_state_dict(ckpt["model"])
            o.load_state_dict(ckpt["optimizer"])  # plain PyTorch, and memplan's wrap keeps it
    ddp = DistributedDataParallel(ref_model)
    data = batches(case.steps, rank)
    dtype = torch.bfloat16 if case.bf16 else torch.float32
    wrapped = agent.wrap(
        model,
        opt,
        plan=sharded_plan(model, world, case.offload, dtype),
        options=RuntimeOptions(compute_dtype=dtype),
        feedback_steps=None,
    )
    loop = LoopCase(steps=case.steps, clip=case.clip, micro=case.micro, no_sync=case.no_sync)
    ref_losses, ref_norms = train(
        ddp, ref_opt, data, loop, ddp.no_sync, lambda m: torch.nn.utils.clip_grad_norm_(ddp.parameters(), m)
    )
    params = list(wrapped.model.parameters())
    losses, norms = train(
        wrapped.model,
        wrapped.optimizer,
        data,
        loop,
        wrapped.no_sync,
        lambda m: torch.nn.utils.clip_grad_norm_(params, m),  # torch's own, on the wrapped model's .grad
    )
    runtime = wrapped.runtime
    states = runtime.states
    sharded = [st for st in states if st.shard is not None]
    report = runtime.memory_report()
    # what a replicated offloaded chunk would hold of the same categories (fp32: master is the compute copy)
    opt_bytes = sum(
        v.nbytes for st in sharded for s in runtime.steppers[st.index].inner.state.values() for v in s.values()
        if isinstance(v, torch.Tensor) and v.dim() == 1
    )  # fmt: skip
    result: dict[str, Any] = {
        "ref_losses": ref_losses,
        "losses": losses,
        "ref_norms": ref_norms,
        "norms": norms,
        "param_rel_diff": rel_diff(wrapped.model, ref_model),
        "checksum": checksum(wrapped.model),
        "sharded_chunks": len(sharded),
        "persistent_chunks": sum(not st.offloaded for st in states),
        "grad_reductions": runtime.counters.grad_reductions,
        "param_gathers": runtime.counters.param_gathers,
        "collective_s": [
            runtime.counters.grad_reduction_s,
            runtime.counters.grad_fill_s,
            runtime.counters.param_gather_s,
        ],
        "host_step_redos": runtime.counters.host_step_redos,
        "chunk_numel": [st.numel for st in sharded],
        "shard_numel": [st.shard.size for st in sharded],  # type: ignore[union-attr]
        "shard_buffers": [
            [st.host_grad.numel(), st.stage.numel(), st.master.numel(), st.host_params.numel()]  # type: ignore[union-attr]
            for st in sharded
        ],
        "sharded_opt_state_bytes": opt_bytes,
        "host_report": report.host,
    }
    if case.save is not None or case.load is not None:
        state = wrapped.optimizer.state_dict()  # a collective: every rank
        result["opt_state_rel_diff"] = state_rel_diff(state, ref_opt.state_dict())
        plain = adamw(copy.deepcopy(ref_model))
        plain.load_state_dict(state)  # plain PyTorch takes it
        if case.save is not None and rank == 0:
            torch.save({"model": wrapped.model.state_dict(), "optimizer": state}, case.save)
    if case.unwrap:
        plain_model = agent.unwrap(wrapped)  # a collective with sharded chunks: every rank
        result["unwrapped_rel_diff"] = rel_diff(plain_model, ref_model)
        result["unwrapped_dtype"] = str(next(plain_model.parameters()).dtype)
        result["unwrapped_opt_rel_diff"] = state_rel_diff(opt.state_dict(), ref_opt.state_dict())
    dist.barrier()
    return result
