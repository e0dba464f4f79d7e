"""Benchmark: the node-shared compute copy of sharded chunks against private copies (issue 20).

    .venv/bin/python benchmarks/shared_compute_copy.py                         # 2 gloo ranks on the CPU
    .venv/bin/python benchmarks/shared_compute_copy.py --hidden 512 --trials 3 --steps 6

N forked gloo ranks train a llama from config with every chunk offloaded and sharded (a hand-built plan,
`Policy.world_size` N) through `agent.wrap`, once with `RuntimeOptions(share_compute_copy=True)` (one copy per
node, a barrier after each step) and once with False (a copy per rank, all-gathered after each step), in
alternating trials (fresh processes each). Per variant and rank: the median iteration and the median
`optimizer.step()` (where the compute-copy all-gathers or the barrier run; a barrier before each timed part
lines the ranks up), `memory_report()` host bytes and node-shared bytes, and the collectives counted. Printed
and saved to benchmarks/results/shared_compute_copy.json. Take figures on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import agent
from agent.runtime import RuntimeOptions, manual_plan
from agent.testing.model_zoo import build
from benchmarks._results import Run, save
from client.contract import Placement, Plan

RESULTS = Path(__file__).resolve().parent / "results" / "shared_compute_copy.json"


def sharded_plan(model: torch.nn.Module, world: int, chunk_mib: float) -> Plan:
    plan = manual_plan(model, chunk_size_bytes=int(chunk_mib * 2**20), offload="all", n_buffers=2)
    assert plan.policy is not None
    chunks = [
        c.model_copy(update={"sharded": c.placement == Placement.offloaded}) for c in plan.policy.chunks
    ]
    return plan.model_copy(
        update={"policy": plan.policy.model_copy(update={"chunks": chunks, "world_size": world})}
    )


def _rank(rank: int, world: int, port: int, share: bool, args: dict[str, Any], out: str) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model, _ = build(
        "llama", layers=args["layers"], hidden=args["hidden"], vocab=args["vocab"], seq=args["seq"], seed=0
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    wrapped = agent.wrap(
        model,
        opt,
        plan=sharded_plan(model, world, args["chunk_mib"]),
        options=RuntimeOptions(share_compute_copy=share),
        feedback_steps=None,
    )
    g = torch.Generator().manual_seed(rank)
    iteration, step = [], []
    for _ in range(args["steps"] + 2):  # 2 warm-up steps
        x = torch.randint(0, args["vocab"], (args["batch"], args["seq"]), generator=g)
        dist.barrier()
        t0 = time.perf_counter()
        wrapped.model(input_ids=x, labels=x).loss.backward()
        dist.barrier()
        t1 = time.perf_counter()
        wrapped.optimizer.step()
        t2 = time.perf_counter()
        wrapped.optimizer.zero_grad()
        iteration.append(t2 - t0)  # forward, backward, the barrier and step
        step.append(t2 - t1)
    rt = wrapped.runtime
    rep = rt.memory_report()
    result = {
        "shared": rt.shared is not None,
        "iteration_s": statistics.median(iteration[2:]),
        "step_s": statistics.median(step[2:]),
        "host_bytes": rep.host_bytes,
        "node_shared_host_bytes": rep.node_shared_host_bytes,
        "pinned_host_bytes": rep.pinned_host_bytes,
        "param_gathers_per_step": rt.counters.param_gathers / len(step),
        "compute_barriers": rt.counters.compute_barriers,
        "parameters": sum(p.numel() for p in model.parameters()),
    }
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--vocab", type=int, default=128)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--chunk-mib", type=float, default=4.0)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--trials", type=int, default=2)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    run = Run("shared_compute_copy", args)
    rows: list[dict[str, Any]] = []
    for trial in range(args.trials):
        for share in (True, False):
            with tempfile.TemporaryDirectory() as out:
                mp.start_processes(
                    _rank,
                    args=(args.world_size, _free_port(), share, vars(args), out),
                    nprocs=args.world_size,
                    join=True,
                    start_method="fork",
                )
                ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(args.world_size)]
            rows.append({"trial": trial, "variant": "shared" if share else "private", "ranks": ranks})
            r0 = ranks[0]
            print(
                f"trial {trial} {rows[-1]['variant']:7s} ({r0['parameters']} parameters): iteration ms "
                f"{[round(r['iteration_s'] * 1e3, 1) for r in ranks]}, step() ms "
                f"{[round(r['step_s'] * 1e3, 1) for r in ranks]}, host MiB per rank "
                f"{[round(r['host_bytes'] / 2**20, 2) for r in ranks]}, node-shared MiB "
                f"{r0['node_shared_host_bytes'] / 2**20:.2f}, compute-copy all-gathers per step "
                f"{r0['param_gathers_per_step']:.0f}, barriers {r0['compute_barriers']}"
            )
    save(args.out, run.document(results=rows))


if __name__ == "__main__":
    main()
