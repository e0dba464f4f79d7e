"""Jobs the sharded-chunk tests run on every rank (issue 20; forked, gloo on CPU).

Each job trains the same model with plain `DistributedDataParallel` (the reference) and with `agent.wrap`
under a plan whose offloaded chunks are sharded (`Chunk.sharded`, `Policy.world_size`), on this rank's own
batches, and writes what it measured to `<out>/rank<r>.json`. The loop, data and comparisons are
`ddp_jobs`'s.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import logging
import os
import resource
import signal
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from ddp_jobs import VOCAB, TwoPaths, adamw, batches, build_model, checksum, free_port, rel_diff, train
from ddp_jobs import Case as LoopCase
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import agent
from agent.runtime import RuntimeOptions, manual_plan
from client.contract import Chunk, Placement, Plan, parameter_slot_bytes
from tests.agent.runtime.cuda_semantics.checker import StreamOrderError, simulated_cuda


@dataclass
class ShardCase:
    kind: str = "hf-llama"  # "hf-<family>" (library defaults), a model_zoo kind, or "mlp" (TokenMLP)
    offload: str = "all"  # "all", "none" (every chunk persistent), or "alternate" (persistent and offloaded)
    device_shard: bool = False  # persistent chunks sharded too (ZeRO-3 on the device, `device_shards.py`)
    frozen: bool = (
        False  # "mlp": `up.bias` and `head.weight` frozen (chunks with parameters that get no gradient)
    )
    steps: int = 4
    clip: float | None = None
    micro: int = 1
    batch: int = 4  # rows per step (split into `micro` micro-batches)
    no_sync: bool = False
    save: str | None = None  # every rank gathers the full state dicts; rank 0 writes them here
    load: str | None = None  # both variants start from this checkpoint (memplan's, saved at any world size)
    bf16: bool = False  # memplan computes in bf16 with an fp32 master (DDP stays fp32)
    unwrap: bool = False  # end with agent.unwrap: the trained model and optimizer state back in plain PyTorch
    share: bool = True  # RuntimeOptions.share_compute_copy (the node-shared compute copy)
    shm_dirs: list[str] | None = None  # per rank: RuntimeOptions.shared_memory_dir (default /dev/shm)
    fsize_limit: int | None = None  # rank 0 wraps under this RLIMIT_FSIZE (its posix_fallocate then fails)
    replicated: bool = False  # every second offloaded chunk stays replicated (not sharded)
    tight: bool = False  # small chunks out of execution order: chunks flushed in parts in one backward
    ragged: bool = False  # each rank's batches have their own sequence length, changing from step to step
    job: str = (
        "ddp"  # "ddp": compare_sharded_with_ddp; "edges": accumulation_edge_cases; "streams": cuda_paths
    )


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


# TokenMLP's parameters in chunks of modules far apart in backward (head's bias with the embedding, down's weight
# with up's bias, up's weight with down's bias): with two buffers, the chunk of head's bias and the embedding is
# evicted with head's gradient pending while down and up run, and flushed again once the embedding's arrives
TIGHT_CHUNKS = [
    ["head.bias", "embed.weight"],
    ["down.weight", "up.bias"],
    ["head.weight"],
    ["up.weight", "down.bias"],
]


def sharded_plan(
    model: nn.Module,
    world: int,
    offload: str,
    dtype: torch.dtype = torch.float32,
    *,
    replicated: bool = False,
    tight: bool = False,
    device_shard: bool = False,
) -> Plan:
    """A hand-built plan for `world` ranks with every offloaded chunk sharded (`replicated`: every second one;
    `device_shard`: every persistent chunk too)."""
    sizes = [p.numel() * dtype.itemsize for p in model.parameters()]
    chunk = -(-max(max(sizes), -(-sum(sizes) // 5)) // 64) * 64 + 48  # 48: chunks end off a shard boundary
    rule: Any = (
        offload
        if offload in ("all", "none")
        else (lambda i, n: Placement(("persistent", "offloaded")[i % 2]))
    )
    plan = manual_plan(model, chunk_size_bytes=chunk, offload=rule, n_buffers=2, compute_dtype=dtype)
    assert plan.policy is not None
    if tight:  # every chunk offloaded, parameters grouped out of execution order (TokenMLP's names)
        plan = regrouped(plan, model, TIGHT_CHUNKS, [Placement.offloaded] * len(TIGHT_CHUNKS), dtype)
        assert plan.policy is not None
    offloaded = [c.index for c in plan.policy.chunks if c.placement == Placement.offloaded]
    chunks = [
        c.model_copy(
            update={
                "sharded": (device_shard and c.placement == Placement.persistent)
                or (
                    c.placement == Placement.offloaded
                    and not (replicated and offloaded.index(c.index) % 2 == 1)
                )
            }
        )
        for c in plan.policy.chunks
    ]
    policy = plan.policy.model_copy(update={"chunks": chunks, "world_size": world})
    return plan.model_copy(update={"policy": policy})


def regrouped(
    plan: Plan, model: nn.Module, groups: list[list[str]], placements: list[Placement], dtype: torch.dtype
) -> Plan:
    """`plan` with its chunks replaced by `groups` of `model`'s parameter names, placed as `placements` say."""
    assert plan.policy is not None
    params = dict(model.named_parameters())
    slots = [sum(parameter_slot_bytes(params[n].numel(), dtype.itemsize) for n in g) for g in groups]
    chunks = [
        Chunk(index=i, placement=where, parameters=g, blocks=[], used_bytes=b)
        for i, (g, where, b) in enumerate(zip(groups, placements, slots, strict=True))
    ]
    policy = plan.policy.model_copy(update={"chunks": chunks, "chunk_size_bytes": max(slots) + 48})
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
        c = ShardCase(**case)
        job = {"ddp": compare_sharded_with_ddp, "edges": accumulation_edge_cases, "streams": cuda_paths}[
            c.job
        ]
        result = job(rank, world, c)
        (Path(out) / f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def digest(model: nn.Module) -> str:
    """The parameters' bytes, hashed: equal digests are models equal to the bit."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()


def run_then_kill(victim: int, world: int, directory: str, out: Path) -> list[int | None]:
    """`world` forked ranks wrap a TokenMLP with sharded chunks (node-shared in `directory`) and train a step;
    then rank `victim` is killed (SIGKILL), and another rank, once it is gone, writes what `directory` holds and
    whether its parameters (the node-shared copy) still read back to `<out>/after_kill.json`. The exit codes."""
    port = free_port()
    ctx = mp.get_context("fork")
    procs = [
        ctx.Process(target=_kill_entry, args=(r, world, port, victim, directory, str(out)))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    return [p.exitcode for p in procs]


def _kill_entry(rank: int, world: int, port: int, victim: int, directory: str, out: str) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = TokenMLP()
    opt = adamw(model)
    options = RuntimeOptions(shared_memory_dir=directory)
    wrapped = agent.wrap(
        model, opt, plan=sharded_plan(model, world, "all"), options=options, feedback_steps=None
    )
    x = batches(1, rank)[0]
    wrapped.model(input_ids=x, labels=x).loss.backward()
    wrapped.optimizer.step()
    pids = [None] * world
    dist.all_gather_object(pids, os.getpid())
    dist.barrier()
    if rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    if rank == (victim + 1) % world:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and _alive(pids[victim]):
            time.sleep(0.05)
        result = {
            "victim_gone": not _alive(pids[victim]),
            "shared": wrapped.runtime.shared is not None,
            "left": sorted(os.listdir(directory)),
            "params_finite": all(bool(p.detach().isfinite().all()) for p in wrapped.model.parameters()),
        }
        (Path(out) / "after_kill.json").write_text(json.dumps(result))
    os._exit(0)  # a peer is dead: no collective (destroy_process_group) can finish


def _alive(pid: int | None) -> bool:
    """The process runs (a zombie waiting for its parent to reap it counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):  # gone before the open, or reaped between open and read
        return False
    return state != "Z"


class _Records(logging.Handler):
    """The messages of the warnings logged to it."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _sharing(runtime: Any, case: ShardCase) -> dict[str, Any]:
    """Right after wrap: whether the compute copies are node-shared, the inode of the mapping this process has
    of the segment (from /proc/self/maps: the file is deleted, the mapping stays), what the CUDA registration
    would cover, whether every sharded chunk's compute copy lies inside it, and what is left in the directory."""
    shared = runtime.shared
    out: dict[str, Any] = {"shared": shared is not None, "shm_left": None, "maps": []}
    directory = case.shm_dirs[dist.get_rank()] if case.shm_dirs else None
    if directory is not None and os.path.isdir(directory):
        out["shm_left"] = sorted(os.listdir(directory))
    if shared is None:
        return out
    ptr, nbytes = shared.registration()
    inside = all(
        ptr <= st.host_params.data_ptr() and st.host_params.data_ptr() + st.host_params.nbytes <= ptr + nbytes
        for st in runtime.states
        if st.shard is not None and st.offloaded
    )
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        if lo <= ptr < hi:  # the mapping holding the segment: (start, end, inode, path)
            out["maps"] = [lo - ptr, hi - ptr, int(fields[4]), fields[5] if len(fields) > 5 else ""]
    out.update(registration=[nbytes, shared.nbytes], chunks_inside=inside)
    return out


# counters read after every backward (their increase in it)
PER_BACKWARD = ("reduce_scatters", "grad_gathers", "grad_reductions", "param_gathers", "grad_flushes")


def flat_grads(model: nn.Module) -> torch.Tensor:
    """Every parameter's `.grad` (zeros for None) as one fp32 vector, in `model.parameters()` order."""
    return torch.cat(
        [
            (p.grad if p.grad is not None else torch.zeros_like(p)).detach().float().flatten()
            for p in model.parameters()
        ]
    )


def grad_rel_diffs(
    grads: list[torch.Tensor], ref: list[torch.Tensor], synced: list[bool]
) -> dict[str, float]:
    """The largest ||grad - DDP's|| / ||DDP's|| after no_sync backwards ("local") and after the others."""
    out = {"local": 0.0, "synced": 0.0}
    for g, r, s in zip(grads, ref, synced, strict=True):
        d = ((g.double() - r.double()).norm() / r.double().norm().clamp_min(1e-12)).item()
        key = "synced" if s else "local"
        out[key] = max(out[key], d)
    return out


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
    if case.frozen:  # TokenMLP: head.weight alone in a (persistent) chunk, up.bias beside trained parameters
        model.up.bias.requires_grad_(False)  # type: ignore[union-attr]
        model.head.weight.requires_grad_(False)  # type: ignore[union-attr]
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
    data = batches(case.steps, rank, case.batch)
    if case.ragged:  # what a padding collator gives: every rank's longest example differs, step by step
        data = [x[:, : x.shape[1] - 3 * ((rank + i) % 3)] for i, x in enumerate(data)]
    dtype = torch.bfloat16 if case.bf16 else torch.float32
    shm = {"shared_memory_dir": case.shm_dirs[rank]} if case.shm_dirs else {}
    warned = _Records()
    logging.getLogger("agent.runtime.node_shared").addHandler(warned)
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    if (
        case.fsize_limit is not None and rank == 0
    ):  # a real failure: the kernel refuses the reservation (EFBIG)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (case.fsize_limit, limit[1]))
    try:
        wrapped = agent.wrap(
            model,
            opt,
            plan=sharded_plan(
                model,
                world,
                case.offload,
                dtype,
                replicated=case.replicated,
                tight=case.tight,
                device_shard=case.device_shard,
            ),
            options=RuntimeOptions(compute_dtype=dtype, share_compute_copy=case.share, **shm),
            feedback_steps=None,
        )
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
    sharing = _sharing(wrapped.runtime, case)
    loop = LoopCase(steps=case.steps, clip=case.clip, micro=case.micro, no_sync=case.no_sync)
    ref_grads: list[torch.Tensor] = []
    ref_losses, ref_norms = train(
        ddp,
        ref_opt,
        data,
        loop,
        ddp.no_sync,
        lambda m: torch.nn.utils.clip_grad_norm_(ddp.parameters(), m),
        lambda synced: ref_grads.append(flat_grads(ref_model)),
    )
    params = list(wrapped.model.parameters())
    runtime = wrapped.runtime
    grads: list[torch.Tensor] = []
    backwards: list[dict[str, Any]] = []
    seen = {k: 0 for k in PER_BACKWARD}

    def after_backward(synced: bool) -> None:
        grads.append(flat_grads(wrapped.model))  # `.grad` as the user sees it: DDP's after this backward
        now = {k: getattr(runtime.counters, k) for k in PER_BACKWARD}
        backwards.append({"synced": synced, **{k: now[k] - seen[k] for k in PER_BACKWARD}})
        seen.update(now)

    losses, norms = train(
        wrapped.model,
        wrapped.optimizer,
        data,
        loop,
        wrapped.no_sync,
        lambda m: torch.nn.utils.clip_grad_norm_(params, m),  # torch's own, on the wrapped model's .grad
        after_backward,
    )
    states = runtime.states
    sharded = [st for st in states if st.shard is not None and st.offloaded]
    device_sharded = [st for st in states if st.shard is not None and not st.offloaded]
    report = runtime.memory_report()
    # what a replicated offloaded chunk would hold of the same categories (fp32: master is the compute copy)
    opt_bytes = sum(
        v.nbytes for st in sharded for s in runtime.steppers[st.index].inner.state.values() for v in s.values()
        if isinstance(v, torch.Tensor) and v.dim() == 1
    )  # fmt: skip
    peak_gathered = runtime.device_shards.max_gathered_bytes if runtime.device_shards else 0  # training only
    # released after step(): a device-sharded chunk's parameters are NaN placeholders (zero strides; a write fails)
    released = [e.param for st in device_sharded for e in st.spec.entries]
    released_nan = all(p.stride() == (0,) * p.dim() and bool(p.isnan().all()) for p in released)
    try:
        with torch.no_grad():
            max(released, key=lambda p: p.numel(), default=torch.ones(2).expand(2)).add_(1.0)
        released_write_fails = False
    except RuntimeError:  # more than one element refers to one memory location
        released_write_fails = True
    whole = runtime.summon_full_params()  # device-sharded chunks: the whole parameters (every rank)
    whole.__enter__()
    result: dict[str, Any] = {
        "lengths": [x.shape[1] for x in data],
        "ref_losses": ref_losses,
        "losses": losses,
        "ref_norms": ref_norms,
        "norms": norms,
        "param_rel_diff": rel_diff(wrapped.model, ref_model),
        "checksum": checksum(wrapped.model),
        "digest": digest(wrapped.model),
        "sharded_chunks": len(sharded),
        "device_sharded_chunks": len(device_sharded),
        "released_reads_nan": released_nan,
        "released_write_fails": released_write_fails,
        "device_shard_gathers": runtime.counters.device_shard_gathers,
        "device_shard_prefetches": runtime.counters.device_shard_prefetches,
        # the most bytes of whole copies held at once, against all of them
        "max_gathered_bytes": peak_gathered,
        "whole_bytes": sum(st.params.numel() * st.params.element_size() for st in device_sharded),  # type: ignore[union-attr]
        "device_report": report.device,
        # per device-sharded chunk: (whole elements N*s, own shard, master shard, gradient area)
        "device_shard_buffers": [
            [st.shard.total, st.own.numel(), st.master.numel(), 0 if st.grad is None else st.grad.numel()]  # type: ignore[union-attr]
            for st in device_sharded
        ],
        "replicated_offloaded_chunks": sum(st.offloaded and st.shard is None for st in states),
        "backwards": backwards,
        "grad_rel_diff": grad_rel_diffs(grads, ref_grads, [b["synced"] for b in backwards]),
        "persistent_chunks": sum(not st.offloaded for st in states),
        "grad_reductions": runtime.counters.grad_reductions,
        "param_gathers": runtime.counters.param_gathers,
        "compute_barriers": runtime.counters.compute_barriers,
        "warnings": warned.messages,
        **sharing,
        "node_shared_bytes": report.node_shared_host_bytes,
        "pinned_host_bytes": report.pinned_host_bytes,
        "collective_s": [
            runtime.counters.grad_reduction_s,
            runtime.counters.grad_fill_s,
            runtime.counters.param_gather_s,
            runtime.counters.compute_barrier_s,
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
    whole.__exit__(None, None, None)
    if case.save is not None or case.load is not None:
        state = wrapped.optimizer.state_dict()  # a collective: every rank
        result["opt_state_rel_diff"] = state_rel_diff(state, ref_opt.state_dict())
        plain = adamw(copy.deepcopy(ref_model))
        plain.load_state_dict(state)  # plain PyTorch takes it
        model_state = wrapped.model.state_dict()  # a collective with device-sharded chunks: every rank
        if case.save is not None and rank == 0:
            torch.save({"model": model_state, "optimizer": state}, case.save)
    if case.unwrap:
        plain_model = agent.unwrap(wrapped)  # a collective with sharded chunks: every rank
        result["unwrapped_rel_diff"] = rel_diff(plain_model, ref_model)
        result["unwrapped_dtype"] = str(next(plain_model.parameters()).dtype)
        result["unwrapped_opt_rel_diff"] = state_rel_diff(opt.state_dict(), ref_opt.state_dict())
    dist.barrier()
    return result


def accumulation_edge_cases(rank: int, world: int, case: ShardCase) -> dict[str, Any]:
    """no_sync() around the edges, every offloaded chunk sharded, against plain PyTorch averaging `.grad` by hand
    where DDP would (an all-reduce of every `.grad` after each synchronising backward: DDP's arithmetic, and
    defined where DDP's own needs find_unused_parameters): a no_sync backward dropped by zero_grad, a chunk
    used only in the no_sync micro-step, no_sync after a synchronising backward without zero_grad,
    zero_grad(set_to_none=False) first, and optimizer.step() refused after a no_sync backward."""
    torch.manual_seed(0)
    model = TwoPaths()
    ref = copy.deepcopy(model)
    ref_opt, opt = adamw(ref), adamw(model)
    wrapped = agent.wrap(model, opt, plan=sharded_plan(model, world, "all"), feedback_steps=None)
    runtime = wrapped.runtime
    data = iter(batches(16, rank))
    worst = {"local": 0.0, "synced": 0.0}
    no_sync_collectives = 0
    refused = ""

    def backward(*, synced: bool, use_first: bool = True) -> None:
        nonlocal no_sync_collectives
        x = next(data)
        before = runtime.counters.reduce_scatters + runtime.counters.grad_gathers
        model.use_first = ref.use_first = use_first
        ref(x, x).loss.backward()
        with contextlib.nullcontext() if synced else wrapped.no_sync():
            wrapped.model(x, x).loss.backward()
        if synced:
            for p in ref.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad)
                    p.grad.div_(world)
        else:
            no_sync_collectives += runtime.counters.reduce_scatters + runtime.counters.grad_gathers - before
        g, r = flat_grads(wrapped.model), flat_grads(ref)
        key = "synced" if synced else "local"
        worst[key] = max(worst[key], ((g - r).norm() / r.norm().clamp_min(1e-12)).item())

    def step(*, clip: float | None = None) -> None:
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(list(wrapped.model.parameters()), clip)
            torch.nn.utils.clip_grad_norm_(list(ref.parameters()), clip)
        wrapped.optimizer.step()
        ref_opt.step()
        wrapped.optimizer.zero_grad()
        ref_opt.zero_grad()

    # a no_sync backward dropped by zero_grad: nothing of it reaches a later step
    backward(synced=False)
    wrapped.optimizer.zero_grad()
    ref_opt.zero_grad()
    # `first` gets gradients in the no_sync micro-step only: reduce-scattered from its local sum at the end
    backward(synced=False)
    before = (runtime.counters.reduce_scatters, runtime.counters.grad_flushes)
    backward(synced=True, use_first=False)
    straggler = (runtime.counters.reduce_scatters - before[0], runtime.counters.grad_flushes - before[1])
    step()
    # no_sync after a synchronising backward without zero_grad: `.grad` is the average plus the local sum
    backward(synced=True)
    backward(synced=False)
    backward(synced=True)
    step()
    # zero_grad(set_to_none=False) first, then accumulation and clipping
    wrapped.optimizer.zero_grad(set_to_none=False)
    ref_opt.zero_grad(set_to_none=False)
    backward(synced=False)
    backward(synced=True)
    step(clip=0.05)
    # optimizer.step() after a no_sync backward alone is refused; a synchronising backward then steps
    backward(synced=False)
    try:
        wrapped.optimizer.step()
    except RuntimeError as exc:
        refused = str(exc)
    backward(synced=True)
    step()
    result = {
        "grad_rel_diff": worst,
        "param_rel_diff": rel_diff(wrapped.model, ref),
        "checksum": checksum(wrapped.model),
        "no_sync_collectives": no_sync_collectives,
        "straggler_backward": {"reduce_scatters": straggler[0], "grad_flushes": straggler[1]},
        "sharded_chunks": sum(st.shard is not None for st in runtime.states),
        "refused": refused,
    }
    dist.barrier()
    return result


def cuda_paths(rank: int, world: int, case: ShardCase) -> dict[str, Any]:
    """The runtime's CUDA code paths for sharded chunks (reduce-scatters and no_sync's piecewise copies through the
    pinned stage, issued by the host worker) run on CPU under the stream-ordering checker (a test double: no GPU
    runs here), training `case` in fp32 and in bf16 with fp32 masters as the CPU path does; per dtype, each run's
    parameters' checksum and what the checker found."""

    def run(dtype: torch.dtype) -> float:
        torch.manual_seed(0)
        model = TokenMLP()
        plan = sharded_plan(
            model, world, case.offload, dtype, tight=case.tight, device_shard=case.device_shard
        )
        wrapped = agent.wrap(
            model, adamw(model), plan=plan, options=RuntimeOptions(compute_dtype=dtype), feedback_steps=None
        )
        loop = LoopCase(steps=case.steps, micro=case.micro, no_sync=case.no_sync)
        data = batches(case.steps, rank)
        train(wrapped.model, wrapped.optimizer, data, loop, wrapped.no_sync, lambda m: torch.tensor(0.0))
        wrapped.synchronize()
        with wrapped.runtime.summon_full_params():  # device-sharded chunks: the whole parameters
            return checksum(wrapped.model)

    out: dict[str, Any] = {}
    for dtype in (torch.float32, torch.bfloat16):
        cpu = run(dtype)
        with simulated_cuda("caching") as sim:
            simulated = run(dtype)
        try:
            sim.check()
            found = ""
        except StreamOrderError as exc:
            found = str(exc)
        out[str(dtype)] = {
            "cpu": cpu,
            "simulated": simulated,
            "violations": found,
            "offload_kernels": sim.kernels_on("offload stream"),
        }
    dist.barrier()
    return out
