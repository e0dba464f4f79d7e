"""Jobs the multi-process tests run on every rank (forked by `torch.multiprocessing`, gloo on CPU).

Each job trains the same model two ways in one process: plain `DistributedDataParallel` (the reference)
and `agent.wrap` under the same process group, on this rank's own batches, and writes what it measured to
`<out>/rank<r>.json` for the test to compare.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import transformers  # noqa: F401  (loaded before the fork, like the agent below)
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import agent  # imported here, so forked ranks start with it (and transformers) loaded
from agent.runtime import RuntimeOptions, manual_plan
from agent.testing.model_zoo import build, build_with_library_defaults
from client.contract import Placement

VOCAB = 128
SEQ = 16
BATCH = 4


@dataclass
class Case:
    """One multi-process comparison: model, plan, loop options, and checkpoint files."""

    kind: str = "gpt2"  # a model_zoo kind, or "hf-<family>" (a Hugging Face family, library defaults)
    hidden: int = 32  # model_zoo kinds: the hidden size (larger: parameters outweigh activations)
    offload: str = "all"  # "all": every chunk offloaded; "alternate": persistent and offloaded chunks
    steps: int = 4
    clip: float | None = None
    micro: int = 1
    no_sync: bool = False  # accumulate inside no_sync() (DDP's and memplan's)
    save: str | None = None  # rank 0 writes the full state dicts (model, optimizer; both variants) here
    load: str | None = None  # both variants start from this checkpoint (saved at any world size)
    feedback: str | None = None  # wrap's monitor sends feedback after 4 steps to this local file
    solve: bool = False  # no plan given: every rank profiles, rank 0 solves in-process, the others receive it
    server: str | None = None  # with solve: rank 0 asks this planner service for the plan
    service_budget_s: float | None = None  # with server: wrap's budget for the whole service path
    device_memory: int | None = None  # with solve: the device memory to plan for (default: the device's)
    host_memory: int | None = None  # with solve: the node's host memory to plan for (default: the machine's)
    explicit_group: bool = False  # pass wrap(process_group=) a group of its own (every rank, another group)
    no_batch: bool = False  # neither plan nor sample batch: rank 0 cannot plan; each rank's error
    job: str = "ddp"  # "ddp": compare_with_ddp; "unused": unused_in_the_last_micro_step
    # batches of 12 and 16 tokens by turns, rank 0 starting with the shorter (its sample)
    ragged: bool = False
    # "cuda:0": every rank trains on that one GPU, the group on gloo (collectives through host copies): the
    # multi-rank runtime's device paths on a machine with one GPU (tests/agent/gpu); spawned, not forked
    device: str = "cpu"
    # RuntimeOptions.persistent_reductions_in_backward (None: the default, on CUDA only)
    in_backward: bool | None = None


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def join_ranks(procs: list[Any], limit_s: float) -> list[int | None]:
    """Wait for the started rank processes `limit_s` in all; their exit codes (None: still running at the
    deadline, then killed)."""
    deadline = time.monotonic() + limit_s
    codes: list[int | None] = []
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        codes.append(p.exitcode)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    return codes


def spawn(case: Case, world: int, out: Path) -> list[dict[str, Any]]:
    """Run `case` on `world` ranks; the per-rank results."""
    # fork: the children start with torch, transformers and the agent imported (spawn re-imports them in
    # every child: ~15 s per rank on the loaded 2-core CI box)
    mp.start_processes(
        _entry,
        args=(world, free_port(), asdict(case), str(out)),
        nprocs=world,
        join=True,
        start_method="spawn" if case.device.startswith("cuda") else "fork",  # no fork after CUDA starts
    )
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def _entry(rank: int, world: int, port: int, case: dict[str, Any], out: str) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    if case["device"].startswith("cuda"):
        torch.cuda.set_device(torch.device(case["device"]))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        c = Case(**case)
        result = (compare_with_ddp if c.job == "ddp" else unused_in_the_last_micro_step)(rank, world, c)
        (Path(out) / f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def build_model(kind: str, hidden: int = 32) -> nn.Module:
    # "hf-<family>": a Hugging Face family at the library's defaults ("hf-llama", "hf-gemma2", ...)
    if kind.startswith("hf-"):
        model, _ = build_with_library_defaults(kind[3:], layers=2, hidden=64, vocab=VOCAB, seq=32, seed=0)
    else:
        model, _ = build(kind, layers=2, hidden=hidden, vocab=VOCAB, seq=32, seed=0)
    return model


def adamw(m: nn.Module) -> torch.optim.Optimizer:
    decay = [p for p in m.parameters() if p.dim() >= 2]
    no_decay = [p for p in m.parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=3e-3,
        fused=True,
    )


def batches(n: int, rank: int, batch: int = BATCH) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randint(0, VOCAB, (batch, SEQ), generator=g) for _ in range(n)]


def train(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    data: list[torch.Tensor],
    case: Case,
    no_sync: Callable[[], contextlib.AbstractContextManager[None]],
    clip: Callable[[float], torch.Tensor],
    after_backward: Callable[[bool], None] | None = None,
) -> tuple[list[float], list[float]]:
    """The same loop for both variants; the losses and the gradient norms clipping saw. `after_backward` is
    called after every backward with whether it synchronised (ran outside no_sync)."""
    torch.manual_seed(1234)  # dropout masks identical across variants
    losses, norms = [], []
    for x in data:
        total = 0.0
        parts = x.chunk(case.micro)
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            local = case.no_sync and not last
            with no_sync() if local else contextlib.nullcontext():
                loss = model(input_ids=part, labels=part).loss / case.micro
                loss.backward()
            if after_backward is not None:
                after_backward(not local)
            total += loss.item()
        if case.clip is not None:
            norms.append(float(clip(case.clip)))
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, norms


def rel(a: list[float], b: list[float]) -> float:
    """The largest relative difference of `a` from `b`, element by element (0 for empty lists)."""
    return max((abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b, strict=True)), default=0.0)


def rel_diff(a: nn.Module, b: nn.Module) -> tuple[float, str]:
    """Largest ||a - b|| / ||b|| over the parameters, and its name."""
    worst, name = 0.0, ""
    bs = dict(b.named_parameters())
    for n, p in a.named_parameters():
        q = bs[n].detach().float().cpu()  # an offloaded parameter lives on the host between uses
        d = ((p.detach().float().cpu() - q).norm() / q.norm().clamp_min(1e-12)).item()
        if d > worst:
            worst, name = d, n
    return worst, name


def checksum(model: nn.Module) -> float:
    return float(sum(p.detach().double().sum().item() for p in model.parameters()))


def compare_with_ddp(rank: int, world: int, case: Case) -> dict[str, Any]:
    torch.manual_seed(0)
    device = torch.device(case.device)
    model = build_model(case.kind, case.hidden)
    if rank:  # ranks start apart: both variants must take rank 0's model (DDP broadcasts it at construction)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01 * rank)
    model.to(device)  # the user's model is on its device before wrap
    ref_model = copy.deepcopy(model)
    ref_opt = adamw(ref_model)
    opt = adamw(model)
    if case.load is not None:
        ckpt = torch.load(case.load, weights_only=True)
        for m, o in ((ref_model, ref_opt), (model, opt)):
            m.load_state_dict(ckpt["model"])
            o.load_state_dict(ckpt["optimizer"])
    if case.no_batch:
        try:
            agent.wrap(model, opt, feedback_steps=None)
        except Exception as exc:  # noqa: BLE001 - the test reads what each rank raised
            return {"error": f"{type(exc).__name__}: {exc}"}
        return {"error": None}
    ddp = DistributedDataParallel(ref_model)
    sizes = [p.numel() * p.element_size() for p in model.parameters()]
    chunk = -(-max(max(sizes), -(-sum(sizes) // 6)) // 64) * 64
    offload: Any = (
        "all" if case.offload == "all" else (lambda i, n: Placement(("persistent", "offloaded")[i % 2]))
    )
    data = [x.to(device) for x in batches(case.steps, rank)]
    if case.ragged:  # a padding collator's batches: each rank's first batch is its sample, and they differ
        data = [x[:, : SEQ - 4 * ((rank + i + 1) % 2)] for i, x in enumerate(data)]
    forwards = [0]  # forwards of this rank's model inside wrap: the profiler's (a plan from history: none)
    counting = model.register_forward_pre_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    explicit = dist.new_group(list(range(world))) if case.explicit_group else None
    wrapped = agent.wrap(
        model,
        opt,
        plan=None if case.solve else manual_plan(model, chunk_size_bytes=chunk, offload=offload, n_buffers=2),
        sample_batch={"input_ids": data[0], "labels": data[0]} if case.solve else None,
        feedback_steps=4 if case.feedback else None,
        feedback_path=Path(case.feedback) if case.feedback else None,
        process_group=explicit,
        server=case.server,
        service_budget_s=case.service_budget_s,
        device_memory=case.device_memory,
        host_memory=case.host_memory,
        options=RuntimeOptions(persistent_reductions_in_backward=case.in_backward),
    )
    counting.remove()
    ref_losses, ref_norms = train(
        ddp,
        ref_opt,
        data,
        case,
        ddp.no_sync,
        lambda m: torch.nn.utils.clip_grad_norm_(ddp.parameters(), m),
    )
    losses, norms = train(
        wrapped.model, wrapped.optimizer, data, case, wrapped.no_sync, wrapped.clip_grad_norm_
    )
    group = wrapped.runtime.group
    assert group is not None and group.world_size == world and group.rank == rank
    # the runtime's collectives never share a group with the user's: the one given, else one wrap made
    assert group.group is not None and group.group != dist.group.WORLD
    if case.explicit_group:
        assert group.group is explicit
    result: dict[str, Any] = {
        "ref_losses": ref_losses,
        "losses": losses,
        "ref_norms": ref_norms,
        "norms": norms,
        "param_rel_diff": rel_diff(wrapped.model, ref_model),
        "ref_rel_diff_to_rank0": 0.0,
        "checksum": checksum(wrapped.model),
        "grad_reductions": wrapped.runtime.counters.grad_reductions,
        "overlapped_reductions": wrapped.runtime.counters.overlapped_reductions,
        "in_backward": wrapped.runtime.gradients.persistent_in_backward,
        "offloaded_chunks": sum(st.offloaded for st in wrapped.runtime.states),
        "persistent_chunks": sum(not st.offloaded for st in wrapped.runtime.states),
        "forwards_in_wrap": forwards[0],
    }
    assert wrapped.source is not None
    result["plan"] = wrapped.plan.model_dump_json()
    result["plan_origin"] = wrapped.source.origin
    # the job's trace (the largest batch's; uploaded, from a service), sent with the plan
    trace = wrapped.source.trace
    result["trace_hardware"] = trace.hardware.model_dump_json() if trace is not None else None
    result["trace_batch"] = [trace.workload.batch_size, trace.workload.sequence_length] if trace else None
    guard = wrapped.batch_guard
    result["guard"] = [list(guard.planned), guard.warned] if guard is not None else None
    if wrapped.monitor is not None:
        m = wrapped.monitor.measured
        local = m.feedback()
        assert local is not None and m.sent is not None
        result["local_feedback"] = [local.iteration_s, local.peak_device_bytes, local.peak_host_bytes]
        result["sent_feedback"] = [m.sent.iteration_s, m.sent.peak_device_bytes, m.sent.peak_host_bytes]
        result["local_phases"] = local.phases.model_dump() if local.phases else None
        result["sent_phases"] = m.sent.phases.model_dump() if m.sent.phases else None
        result["sent_to"] = m.sent_to
    if case.save is not None and rank == 0:
        torch.save(
            {
                "model": wrapped.model.state_dict(),
                "optimizer": wrapped.optimizer.state_dict(),
                "ref_model": ref_model.state_dict(),
                "ref_optimizer": ref_opt.state_dict(),
            },
            case.save,
        )
    dist.barrier()
    return result


class TwoPaths(nn.Module):
    """Embedding, then `first` (only when `use_first`), then `second`: a model whose first layer can sit out
    a micro-step."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 32)
        self.first = nn.Linear(32, 32)
        self.second = nn.Linear(32, VOCAB)
        self.use_first = True

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> Any:
        h = self.embed(input_ids)
        if self.use_first:
            h = torch.tanh(self.first(h))
        logits = self.second(h)
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return type("Out", (), {"loss": loss})()


def unused_in_the_last_micro_step(rank: int, world: int, case: Case) -> dict[str, Any]:
    """Accumulate over two micro-steps, the first inside no_sync() using every layer, the last not using
    `first`: `first`'s gradient (from the first micro-step only, different on every rank) must still be
    averaged before the step, or the ranks' models part."""
    torch.manual_seed(0)
    model = TwoPaths()
    chunk = max(p.numel() * p.element_size() for p in model.parameters())
    chunk = -(-chunk // 64) * 64
    wrapped = agent.wrap(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        plan=manual_plan(model, chunk_size_bytes=chunk, offload="all", n_buffers=2),
        feedback_steps=None,
    )
    data = batches(2 * case.steps, rank)
    for i in range(case.steps):
        model.use_first = True
        with wrapped.no_sync():
            wrapped.model(data[2 * i], data[2 * i]).loss.backward()
        model.use_first = False
        wrapped.model(data[2 * i + 1], data[2 * i + 1]).loss.backward()
        wrapped.optimizer.step()
        wrapped.optimizer.zero_grad()
    first = [float(v) for v in model.first.weight.detach().flatten()[:8]]
    return {"checksum": checksum(model), "first": first, "chunks": len(wrapped.runtime.states)}
