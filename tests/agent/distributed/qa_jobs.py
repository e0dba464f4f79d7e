"""Jobs of the session-9 QA pass of the multi-rank path (forked ranks, gloo on CPU): each job is a function
`job(rank, world, arg) -> dict` run on every rank; `spawn` returns each rank's exit code (None: still running
at the limit, then killed: a hang) and its result.

`routed`: a mixture-of-experts model with one `nn.Module` per expert (as many user and older Hugging Face MoE
models are built), where an expert that gets no token is not run, so which parameters get a gradient depends
on each rank's batch. Trained by `DistributedDataParallel(find_unused_parameters=True)` and by `agent.wrap`.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from ddp_jobs import free_port, join_ranks, rel_diff
from sharded_jobs import regrouped, sharded_plan
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint

import agent
from agent.applied import Wrapped
from agent.checkpoint import save_sharded
from agent.runtime import RuntimeOptions, manual_plan
from client.contract import Placement, Plan
from tests.agent.runtime.cuda_semantics.checker import StreamOrderError, simulated_cuda

HIDDEN = 16
T = TypeVar("T")
EXPERTS = 4
VOCAB = 32


def spawn(
    job: str, world: int, out: Path, limit_s: float, arg: str = ""
) -> tuple[list[int | None], list[Any]]:
    """Run `job` on `world` forked ranks writing into `out` (made if missing); the exit codes (None: killed at
    `limit_s`) and the results."""
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_entry, args=(job, r, world, port, str(out), arg)) for r in range(world)]
    for p in procs:
        p.start()
    codes = join_ranks(procs, limit_s)
    results = []
    for r in range(world):
        f = out / f"rank{r}.json"
        results.append(json.loads(f.read_text()) if f.exists() else None)
    return codes, results


def _entry(job: str, rank: int, world: int, port: int, out: str, arg: str) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    jobs: dict[str, Callable[[int, int, str], dict[str, Any]]] = {
        "routed": routed,
        "alone": alone,
        "unlike": unlike,
        "evaluate": evaluate,
        "generate": generate,
        "accelerate": accelerate_loop,
        "assigned": assigned,
        "rewrap": rewrap,
        "late": late,
        "paths": paths,
        "subset": subset,
        "inplace": inplace,
        "batchnorm": batchnorm,
    }
    try:
        result = jobs[job](rank, world, arg)
    except Exception as exc:  # noqa: BLE001 - the test reads what each rank raised
        result = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(result))
    os._exit(0)  # ranks that raised may have parted: no collective (destroy_process_group) is safe


class Routed(nn.Module):
    """Top-1 routing over `EXPERTS` experts, each its own module; an expert without tokens does not run."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(HIDDEN, EXPERTS)
        self.experts = nn.ModuleList(nn.Linear(HIDDEN, HIDDEN) for _ in range(EXPERTS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gates = self.router(x).softmax(-1)
        choice = gates.argmax(-1)
        out = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            hit = choice == i
            if hit.any():
                out = out.index_put((hit,), expert(x[hit]) * gates[hit][:, i : i + 1])
        return x + out


class RoutedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(Routed() for _ in range(2))
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        return {"loss": nn.functional.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())}


def _train(
    model: Callable[..., dict[str, torch.Tensor]],
    no_sync: Callable[[], contextlib.AbstractContextManager[Any]],
    optimizer: torch.optim.Optimizer,
    data: list[torch.Tensor],
    micro: int,
) -> list[float]:
    """Each batch's loss; a step after every `micro` batches, the backwards before it inside `no_sync()`."""
    losses = []
    for i, x in enumerate(data):
        with no_sync() if (i + 1) % micro else contextlib.nullcontext():
            loss = model(input_ids=x, labels=x)["loss"]
            loss.backward()
        if (i + 1) % micro == 0:
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def routed(rank: int, world: int, placement: str) -> dict[str, Any]:
    """Three steps on batches where rank 1 has one token (one expert per layer runs there) and rank 0 many;
    `placement`: "persistent" (every chunk), "device-sharded" (every chunk persistent and sharded on the device),
    "offloaded" and "sharded" (every chunk offloaded, replicated or sharded on the host; one expert per chunk, so a
    rank's forward skips the chunk of an expert without tokens), or "offloaded-layers" and "sharded-layers" (the
    same with a layer's router and experts in one chunk, so every rank uses every chunk and an expert without
    tokens leaves some of a used chunk's parameters without a gradient); with
    "+accumulate", two micro-steps per step, the first inside no_sync()."""
    placement, _, extra = placement.partition("+")
    accumulate = extra == "accumulate"
    torch.manual_seed(0)
    model = RoutedLM()
    ref = copy.deepcopy(model)
    ddp = DistributedDataParallel(ref, find_unused_parameters=True)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    chunk = HIDDEN * VOCAB * 4 + 256  # the embedding, the head; experts and routers share chunks
    layers = placement.endswith("-layers")
    if layers:  # a layer's router and experts (1,156 parameters) in one chunk
        chunk = 1200 * 4
    host = placement.startswith(("offloaded", "sharded"))
    rule = Placement.offloaded if host else Placement.persistent
    plan = manual_plan(model, chunk_size_bytes=chunk, offload=lambda i, n: rule, n_buffers=2)
    # "sharded": offloaded and sharded on the host (ZeRO-2 style); "device-sharded": persistent and sharded on
    # the device (ZeRO-3)
    if placement.startswith("sharded") or placement == "device-sharded":
        assert plan.policy is not None
        chunks = [c.model_copy(update={"sharded": True}) for c in plan.policy.chunks]
        policy = plan.policy.model_copy(update={"chunks": chunks, "world_size": world})
        plan = plan.model_copy(update={"policy": policy})
    # (persistent chunks averaged in backward where the ranks' forwards agree: on the CPU too, to see they don't)
    options = RuntimeOptions(persistent_reductions_in_backward=True)
    wrapped = agent.wrap(model, opt, plan=plan, feedback_steps=None, options=options)
    g = torch.Generator().manual_seed(rank)
    # `micro` micro-steps per step, all but the last inside no_sync() (gradient accumulation)
    micro = 2 if accumulate else 1
    data = [torch.randint(0, VOCAB, (1, 1) if rank else (4, 8), generator=g) for _ in range(3 * micro)]
    ref_losses = _train(ddp, ddp.no_sync, ref_opt, data, micro)
    losses = _train(wrapped.model, wrapped.no_sync, wrapped.optimizer, data, micro)
    return {
        "error": None,
        "losses": losses,
        "ref_losses": ref_losses,
        "param_rel_diff": rel_diff(model, ref)[0],
        "deferred_backwards": wrapped.runtime.counters.deferred_backwards,
        "overlapped_reductions": wrapped.runtime.counters.overlapped_reductions,
    }


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(nn.Linear(HIDDEN, HIDDEN) for _ in range(2))
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        x = self.embed(input_ids)
        for layer in self.layers:
            x = x + torch.relu(layer(x))
        return {"loss": nn.functional.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())}


def _wrap_sharded(model: nn.Module, world: int) -> Wrapped:
    """`model` wrapped with every offloaded chunk sharded across the ranks (AdamW, no monitor)."""
    return agent.wrap(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        plan=sharded_plan(model, world, "all"),
        feedback_steps=None,
    )


def _sharded_tiny(rank: int, world: int) -> tuple[Wrapped, torch.Tensor]:
    """`TinyLM` wrapped with every offloaded chunk sharded across the ranks, and this rank's batch."""
    torch.manual_seed(0)
    wrapped = _wrap_sharded(TinyLM(), world)
    return wrapped, torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(rank))


def alone(rank: int, world: int, call: str) -> dict[str, Any]:
    """Every offloaded chunk sharded; one step on every rank (rank 0 first evaluates with grad enabled alone),
    then rank 1 alone makes `call` (a collective: "state_dict" or "unwrap") while rank 0 trains on. Rank 1
    must raise, not wait for rank 0 forever."""
    wrapped, x = _sharded_tiny(rank, world)
    for step in range(2):
        if rank == 0 and step == 0:  # an evaluation without no_grad on rank 0 alone: no collective may wait
            wrapped.model(input_ids=x, labels=x)
        if rank == 1 and step == 1:
            try:
                if call == "state_dict":
                    wrapped.optimizer.state_dict()
                elif call == "unwrap":
                    agent.unwrap(wrapped)
                else:
                    save_sharded(wrapped, tempfile.mkdtemp(prefix="memplan-qa-"))
            except Exception as exc:  # noqa: BLE001 - the test reads what the rank raised
                return {"error": f"{type(exc).__name__}: {exc}"}
            return {"error": None}
        wrapped.model(input_ids=x, labels=x)["loss"].backward()
        wrapped.optimizer.step()
        wrapped.optimizer.zero_grad()
    return {"error": None}


def rewrap(rank: int, world: int, arg: str) -> dict[str, Any]:
    """Wrap, train a step and unwrap four times, with a second wrap alive beside the last two: the runtime's own
    group (`process_group.resolve`) of each wrap, and the process's native threads after each cycle (session 24:
    every wrap made a new group and none was ever let go)."""
    torch.manual_seed(0)
    model = TinyLM()
    x = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(rank))
    groups: list[int] = []
    threads: list[int] = []
    losses: list[float] = []

    def step(w: Wrapped) -> None:
        loss = w.model(input_ids=x, labels=x)["loss"]
        loss.backward()
        w.optimizer.step()
        w.optimizer.zero_grad()
        losses.append(loss.item())

    for cycle in range(4):
        wrapped = _wrap_sharded(model, world)
        assert wrapped.runtime.group is not None
        groups.append(id(wrapped.runtime.group.group))
        other = None
        if cycle >= 2:  # a second model wrapped while the first is alive: never the same group
            torch.manual_seed(1)
            other = _wrap_sharded(TinyLM(), world)
            assert other.runtime.group is not None
            groups.append(id(other.runtime.group.group))
            step(other)
        step(wrapped)
        if other is not None:
            agent.unwrap(other)
        model = agent.unwrap(wrapped)
        threads.append(len(os.listdir("/proc/self/task")))
    params = torch.cat([p.detach().flatten() for p in model.parameters()])
    gathered = [torch.empty_like(params) for _ in range(world)]
    dist.all_gather(gathered, params)
    return {
        "error": None,
        "groups": groups,
        "threads": threads,
        "losses": losses,
        "ranks_agree": all(torch.equal(g, gathered[0]) for g in gathered),
    }


def assigned(rank: int, world: int, arg: str) -> dict[str, Any]:
    """Every offloaded chunk sharded; gradients from `torch.autograd.grad` assigned by hand (`p.grad = g`) on
    every rank, then `optimizer.step()`: each rank must raise naming loss.backward() (session 23)."""
    wrapped, x = _sharded_tiny(rank, world)
    params = list(wrapped.model.parameters())
    loss = wrapped.model(input_ids=x, labels=x)["loss"]
    for p, g in zip(params, torch.autograd.grad(loss, params), strict=True):
        p.grad = g
    try:
        wrapped.optimizer.step()
    except Exception as exc:  # noqa: BLE001 - the test reads what the rank raised
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {"error": None}


def evaluate(rank: int, world: int, how: str) -> dict[str, Any]:
    """Chunks sharded on the device and offloaded chunks sharded in host memory; 3 training steps, an
    evaluation after the first: `how` = "every-rank" (every rank, under no_grad, then in eval mode with grad),
    "none" (no evaluation: the reference losses), "rank0-no-grad" or "rank0-grad" (rank 0 alone, the DDP habit
    `if rank == 0: evaluate(model)`, under no_grad or without it) while rank 1 trains on."""
    torch.manual_seed(0)
    model = TinyLM()
    wrapped = agent.wrap(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        plan=sharded_plan(model, world, "alternate", device_shard=True),
        feedback_steps=None,
    )
    x = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(rank))
    losses, evals = [], []
    error = None
    try:
        for step in range(3):
            if step == 1 and (how == "every-rank" or (rank == 0 and how.startswith("rank0"))):
                wrapped.model.eval()
                if how != "rank0-grad":
                    with torch.no_grad():
                        evals.append(wrapped.model(input_ids=x, labels=x)["loss"].item())
                if how != "rank0-no-grad":
                    evals.append(wrapped.model(input_ids=x, labels=x)["loss"].item())
                wrapped.model.train()
            loss = wrapped.model(input_ids=x, labels=x)["loss"]
            loss.backward()
            wrapped.optimizer.step()
            wrapped.optimizer.zero_grad()
            losses.append(loss.item())
    except Exception as exc:  # noqa: BLE001 - the test reads what each rank raised
        error = f"{type(exc).__name__}: {exc}"
    chunks = wrapped.plan.policy.chunks if wrapped.plan.policy is not None else []
    kinds = sorted({(c.placement.value, c.sharded) for c in chunks})
    return {"error": error, "losses": losses, "evals": evals, "kinds": kinds}


def generate(rank: int, world: int, how: str) -> dict[str, Any]:
    """A Hugging Face llama at the library's defaults with chunks sharded on the device (and offloaded chunks
    sharded in host memory), one training step, then `generate` on every rank with a length of its own (rank r:
    2 + 2r new tokens, no EOS: sequences that end at different steps) with `synced_gpus` True ("synced"), not
    given ("default": the wrapped model's `generate` defaults it to True, `SyncedGenerate`) or False
    ("unsynced", which trains a step after it); then unwraps and generates again with the plain model to compare.
    The tokens, what each rank raised, and whether the mark is gone after unwrap."""
    from ddp_jobs import build_model

    torch.manual_seed(0)
    model = build_model("hf-llama")
    model.generation_config.eos_token_id = None  # every rank generates exactly its max_new_tokens
    wrapped = agent.wrap(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        plan=sharded_plan(model, world, "alternate", device_shard=True),
        feedback_steps=None,
    )
    x = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(rank))

    def step() -> None:
        wrapped.model(input_ids=x, labels=x).loss.backward()
        wrapped.optimizer.step()
        wrapped.optimizer.zero_grad()

    step()
    new = 2 + 2 * rank
    synced = {"synced": True, "default": None, "unsynced": False}
    out: dict[str, Any] = {"error": None, "tokens": None, "plain_tokens": None}
    try:
        wrapped.model.eval()
        with torch.no_grad():
            tokens = wrapped.model.generate(  # type: ignore[operator]
                x[:1, :4], max_new_tokens=new, do_sample=False, synced_gpus=synced[how]
            )
        out["tokens"] = [int(t) for t in tokens.flatten()]
        wrapped.model.train()
        if how == "unsynced":
            step()  # rank 0 is still generating
    except Exception as exc:  # noqa: BLE001 - the test reads what each rank raised
        out["error"] = f"{type(exc).__name__}: {exc}"
        return out
    out["marked"] = "generate" in vars(wrapped.model)
    plain = agent.unwrap(wrapped)  # every rank: a collective
    out["mark_removed"] = "generate" not in vars(plain)
    plain.eval()
    with torch.no_grad():
        again = plain.generate(x[:1, :4], max_new_tokens=new, do_sample=False)  # type: ignore[operator]
    out["plain_tokens"] = [int(t) for t in again.flatten()]
    return out


def unlike(rank: int, world: int, what: str) -> dict[str, Any]:
    """Rank 1 wraps another job than rank 0: `what` = "frozen" (its head frozen), "partial" (device_memory given
    on rank 1 only), "smaller" (a smaller device_memory on rank 1, the plan solved in-process: the job's plan
    must be made for the smallest) or "nobatch" (no sample_batch on rank 1: it fails before its profile
    starts, while rank 0 profiles)."""
    torch.manual_seed(0)
    model = TinyLM()
    if what == "frozen" and rank == 1:
        model.head.requires_grad_(False)
    limits = {
        "frozen": (2 << 30, 2 << 30),
        "partial": (None, 1 << 30),
        "smaller": (2 << 30, 1 << 30),
        "nobatch": (2 << 30, 2 << 30),
    }[what]
    x = torch.randint(0, VOCAB, (2, 8))
    how: dict[str, Any] = (
        {"sample_batch": {"input_ids": x, "labels": x}, "blocks": list(model.layers)}
        if what in ("smaller", "nobatch")
        else {"plan": manual_plan(model, chunk_size_bytes=4096, offload="all", n_buffers=2)}
    )
    if what == "nobatch" and rank == 1:
        del how["sample_batch"]
    try:
        wrapped = agent.wrap(
            model,
            torch.optim.AdamW(model.parameters(), lr=1e-2),
            device_memory=limits[rank],
            feedback_steps=None,
            **how,
        )
    except Exception as exc:  # noqa: BLE001 - the test reads what each rank raised
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {"error": None, "planned_device_bytes": wrapped.plan.constraints.device_memory_bytes}


def accelerate_loop(rank: int, world: int, arg: str) -> dict[str, Any]:
    """README's Accelerate recipe under several processes: an `Accelerator` in the job's process group, plain
    (Accelerate puts the model in DDP) and wrapped (every chunk offloaded), two accumulation micro-steps with
    Accelerate's clipping; `arg` "direct": `accelerator.prepare(wrapped.model, ...)` as the single-process
    recipe says, else `keep_accelerate_from_ddp(accelerator, wrapped)` first."""
    from accelerate import (
        Accelerator,
    )  # local import: accelerate is a dev dependency, this job alone needs it
    from accelerate.state import (
        AcceleratorState,
    )  # local import: accelerate is a dev dependency, this job alone needs it

    from agent.integrations.hf import keep_accelerate_from_ddp

    # a forked rank inherits the parent's process-wide Accelerate state: a single-process one when an earlier
    # test in the same pytest process built an Accelerator (the Trainer tests do), which then ignores this
    # job's group (num_processes 1). Start from none, as a launched process does.
    AcceleratorState._reset_state(reset_partial_state=True)

    # what the launcher sets: Accelerate reads the job's shape from these (the group itself is initialised)
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world)
    )
    acc = Accelerator(cpu=True, gradient_accumulation_steps=2)
    assert acc.num_processes == world
    torch.manual_seed(0)
    base = TinyLM()
    data = torch.randint(0, VOCAB, (8, 8), generator=torch.Generator().manual_seed(rank))
    out: dict[str, Any] = {"error": None}
    for variant in ("plain", "wrapped"):
        model = copy.deepcopy(base)
        opt: Any = torch.optim.AdamW(model.parameters(), lr=1e-2)
        if variant == "wrapped":
            plan = manual_plan(model, chunk_size_bytes=4096, offload="all", n_buffers=2)
            wrapped = agent.wrap(model, opt, plan=plan, feedback_steps=None)
            if arg != "direct":
                keep_accelerate_from_ddp(acc, wrapped)
            model, opt = wrapped.model, wrapped.optimizer
        try:
            m, o = acc.prepare(model, opt)
        except Exception as exc:  # noqa: BLE001 - the test reads what each rank raised
            return {"error": f"{type(exc).__name__}: {exc}"}
        losses = []
        for b in data.chunk(4):
            with acc.accumulate(m):
                loss = m(input_ids=b, labels=b)["loss"]
                acc.backward(loss)
                if acc.sync_gradients:
                    acc.clip_grad_norm_(m.parameters(), 0.5)
                o.step()
                o.zero_grad()
            losses.append(loss.item())
        out[variant] = losses
        acc.free_memory()
    return out


def _under_checker(run: Callable[[], T]) -> tuple[T, str, int]:
    """`run()` under the stream-ordering checker (the runtime's CUDA paths, on the CPU): its result, the
    violations found ("" for none) and the kernels issued on the offload stream."""
    with simulated_cuda("caching") as sim:
        out = run()
    try:
        sim.check()
        found = ""
    except StreamOrderError as exc:
        found = str(exc)
    return out, found, sim.kernels_on("offload stream")


class Looped(nn.Module):
    """One block run three times per forward under re-entrant activation checkpointing (ALBERT's shared layer under
    Hugging Face's gradient checkpointing): each pass's inner backward accumulates the block's gradients again; and
    a scale held by a module that could run but never does (a LayerNorm's weight the root's forward reads, as a
    tied weight is read), whose gradient comes last. (A bare `nn.Module` holding it would not do since session 26:
    the root's hooks now cover a submodule that cannot run, so the scale's gradient is expected, not late.)"""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.block = nn.Linear(HIDDEN, HIDDEN)
        self.aux = nn.LayerNorm(HIDDEN)  # its bias never gets a gradient
        self.head = nn.Linear(HIDDEN, VOCAB)

    def _pass(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.block(x))

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        x = self.embed(input_ids) * self.aux.weight
        for _ in range(3):
            x = checkpoint(self._pass, x, use_reentrant=True)
        return {"loss": nn.functional.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())}


LOOPED_CHUNKS = [
    ["embed.weight"],
    ["block.weight", "block.bias", "aux.weight", "aux.bias"],
    ["head.weight", "head.bias"],
]
LOOPED_BLOCK_APART = [
    ["embed.weight", "aux.weight", "aux.bias"],
    ["block.weight", "block.bias"],
    ["head.weight", "head.bias"],
]


def _llama() -> nn.Module:
    """A Hugging Face llama at its library defaults but for tied embeddings (as Qwen2 and Gemma tie them) under
    gradient checkpointing with `use_reentrant=True`, as older releases and many user scripts run it: every
    layer's gradients arrive inside its own inner backward."""
    import transformers  # noqa: PLC0415 - only this job builds a Hugging Face model

    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=True,
    )
    model = transformers.LlamaForCausalLM(config)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    model.train()
    return model


def late(rank: int, world: int, placement: str) -> dict[str, Any]:
    """`Looped` with the block and the scale in one persistent chunk, which backward completes (and averages) at
    the block's first gradient, before the block's other passes and the scale add theirs; two steps of two
    synchronising micro-steps each. `placement`: "persistent" (every chunk; no host worker, the training thread
    issues the averages), "mixed" (the embedding offloaded), "offloaded" (the block alone in an offloaded chunk,
    the head offloaded too), "sharded" (the same, sharded across the ranks), or "llama" (`_llama`, every chunk persistent, in
    chunks of about a quarter of the model). The reference averages plain PyTorch's `.grad` after every backward,
    as DDP does (DDP itself refuses a parameter made ready twice in one backward, short of `static_graph=True`).
    Trained on the CPU and again under the stream-ordering checker (the CUDA path)."""
    where = {
        "persistent": [Placement.persistent] * 3,
        "mixed": [Placement.offloaded, Placement.persistent, Placement.persistent],
        # the block's and the head's chunks offloaded; the LayerNorm's weight the root reads (outside its module's
        # forward: not made resident, docs/architecture/runtime.md) in the embedding's persistent chunk
        "offloaded": [Placement.persistent, Placement.offloaded, Placement.offloaded],
        "sharded": [Placement.persistent, Placement.offloaded, Placement.offloaded],
    }.get(placement)
    groups = LOOPED_CHUNKS if placement not in ("offloaded", "sharded") else LOOPED_BLOCK_APART
    g = torch.Generator().manual_seed(rank)
    data = [torch.randint(0, VOCAB, (2, 8), generator=g) for _ in range(4)]

    def run(ref: bool) -> tuple[nn.Module, list[float], dict[str, int]]:
        torch.manual_seed(0)
        model = _llama() if where is None else Looped()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        counts: dict[str, int] = {}
        step: Callable[..., dict[str, torch.Tensor]] = model
        if not ref:
            if where is None:
                quarter = -(-sum(p.numel() * 4 for p in model.parameters()) // 4 // 64) * 64
                largest = max(p.numel() * 4 for p in model.parameters())
                plan = manual_plan(model, chunk_size_bytes=max(quarter, largest), offload="none", n_buffers=2)
            else:
                base = "none" if placement == "persistent" else "all"  # (buffers for the offloaded chunk)
                plan = manual_plan(model, chunk_size_bytes=4096, offload=base, n_buffers=2)
                plan = regrouped(plan, model, groups, where, torch.float32)
                if placement == "sharded":
                    plan = _sharded(plan, world)
            # on the CPU as on CUDA (the default averages a CPU device's persistent chunks after backward)
            options = RuntimeOptions(persistent_reductions_in_backward=True)
            wrapped = agent.wrap(model, opt, plan=plan, feedback_steps=None, options=options)
            step, opt = wrapped.model, wrapped.optimizer
        losses = []
        for i, x in enumerate(data):
            loss = step(input_ids=x, labels=x)["loss"]
            loss.backward()
            if ref:
                for p in model.parameters():
                    if p.grad is None:  # `Looped`'s LayerNorm bias: no gradient on any rank
                        continue
                    dist.all_reduce(p.grad)
                    p.grad.div_(world)
            if i % 2:
                opt.step()
                opt.zero_grad()
            losses.append(loss.item())
        if not ref:
            c = wrapped.runtime.counters
            counts = {
                "overlapped": c.overlapped_reductions,
                "reductions": c.grad_reductions,
                "chunks": len(wrapped.runtime.states),
            }
        return model, losses, counts

    ref, ref_losses, _ = run(ref=True)
    model, losses, counts = run(ref=False)
    (simulated, _, simulated_counts), found, offload_kernels = _under_checker(lambda: run(ref=False))
    return {
        "error": None,
        "losses": losses,
        "ref_losses": ref_losses,
        "param_rel_diff": rel_diff(model, ref)[0],
        "simulated_rel_diff": rel_diff(simulated, ref)[0],
        "counts": counts,
        "simulated_counts": simulated_counts,
        "violations": found,
        "offload_kernels": offload_kernels,
    }


class Paths(nn.Module):
    """Small modules each in a persistent chunk of its own, for the ways ranks' backwards can differ
    (`paths`)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.a = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.b = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.extra = nn.Linear(HIDDEN, HIDDEN)
        self.aux = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(
        self, x: torch.Tensor, swap: bool, extra: bool, loop: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.embed(x)
        if loop:  # `a` and `b` run twice under re-entrant checkpointing: their chunks get gradients twice
            for _ in range(2):
                h = checkpoint(lambda t: t + torch.tanh(self._ab(t, swap)), h, use_reentrant=True)
        else:
            h = self._ab(h, swap)
        if extra:
            h = h + self.extra(h)
        h = torch.tanh(h)
        return self.head(h), self.aux(h)

    def _ab(self, h: torch.Tensor, swap: bool) -> torch.Tensor:
        return self.a(self.b(h)) if swap else self.b(self.a(h))


PATHS_CHUNKS = [
    ["embed.weight"],
    ["a.weight"],
    ["b.weight"],
    ["extra.weight", "extra.bias"],
    ["aux.weight"],
    ["head.weight"],
]


PATHS_PLACEMENTS = {
    "persistent": [Placement.persistent] * 6,
    "offloaded": [Placement.offloaded] * 6,
    "sharded": [Placement.offloaded] * 6,
    "mixed": [Placement.persistent, Placement.offloaded] * 3,
}


def _sharded(plan: Plan, world: int) -> Plan:
    """`plan` for `world` ranks with its offloaded chunks sharded across them."""
    assert plan.policy is not None
    chunks = [
        c.model_copy(update={"sharded": c.placement == Placement.offloaded}) for c in plan.policy.chunks
    ]
    policy = plan.policy.model_copy(update={"chunks": chunks, "world_size": world})
    return plan.model_copy(update={"policy": policy})


def paths(rank: int, world: int, arg: str) -> dict[str, Any]:
    """`arg` is "mode", "mode:placement" or "mode:placement:variant"; variant "accumulate": a step after every
    second backward, both synchronising (the second accumulates into an averaged gradient); "loop": `a` and `b`
    run twice under re-entrant checkpointing (their chunks complete, then get gradients again); "noundo": `aux` and
    `head` share a chunk, under `RuntimeOptions(undo_host_steps=False)`. `placement` (`PATHS_PLACEMENTS`): every chunk "persistent" (the
    default; averaged in backward, on the CPU too), every chunk "offloaded" (replicated on every rank), every chunk
    offloaded and "sharded" across the ranks, or "mixed" (by turns). 4 steps; `mode`: "order" (rank 1 runs `a`
    and `b` in the opposite order, so its backward completes their chunks in the other order), "aux" (`aux` runs
    on every rank, its output joins the loss on rank 0 only: its chunk completes in backward there, never on rank
    1) or "cleared" (`extra` runs in the first step only, and the loop sets every `.grad` to None by hand after
    each step, as a torch.compile wrapper's `nn.Module.zero_grad` does). Found by review: "order" paired one
    rank's chunk with the other's (silently wrong), "aux" paired different collectives (gloo aborted),
    "cleared" stepped `extra` with a stale averaged gradient. The reference averages plain PyTorch's `.grad`
    after each backward (a missing one as zero where another rank has one, as DDP's
    `find_unused_parameters=True`). On the CPU and under the stream-ordering checker (the CUDA path)."""
    mode, placement, accumulate = (arg.split(":") + ["", ""])[:3]
    placement = placement or "persistent"
    where = PATHS_PLACEMENTS[placement]
    g = torch.Generator().manual_seed(rank)
    data = [torch.randint(0, VOCAB, (2, 8), generator=g) for _ in range(4)]

    def run(ref: bool) -> tuple[nn.Module, int]:
        torch.manual_seed(0)
        model = Paths()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        step: Callable[..., tuple[torch.Tensor, torch.Tensor]] = model
        if not ref:
            base = "none" if placement == "persistent" else "all"  # (buffers for the offloaded chunks)
            plan = manual_plan(model, chunk_size_bytes=4096, offload=base, n_buffers=2)
            chunks = PATHS_CHUNKS
            if (
                accumulate == "noundo"
            ):  # `aux` and `head` in one chunk: rank 1's backward gives it fewer entries
                chunks = [*PATHS_CHUNKS[:4], ["aux.weight", "head.weight"]]
            plan = regrouped(plan, model, chunks, where[: len(chunks)], torch.float32)
            if placement == "sharded":
                plan = _sharded(plan, world)
            options = RuntimeOptions(
                persistent_reductions_in_backward=True, undo_host_steps=accumulate != "noundo"
            )
            wrapped = agent.wrap(model, opt, plan=plan, feedback_steps=None, options=options)
            step, opt = wrapped.model, wrapped.optimizer
        for i, x in enumerate(data):
            out, aux = step(
                x,
                swap=mode == "order" and rank == 1,
                extra=mode != "cleared" or i == 0,
                loop=accumulate == "loop",
            )
            loss = nn.functional.cross_entropy(out.flatten(0, 1), x.flatten())
            if mode != "aux" or rank == 0:
                loss = loss + aux.pow(2).mean()
            loss.backward()
            if ref:
                for p in model.parameters():
                    held = torch.tensor([p.grad is not None], dtype=torch.int32)
                    dist.all_reduce(held, op=dist.ReduceOp.MAX)
                    if held.item():
                        p.grad = torch.zeros_like(p) if p.grad is None else p.grad
                        dist.all_reduce(p.grad)
                        p.grad.div_(world)
            if accumulate == "accumulate" and i % 2 == 0:
                continue  # two synchronising backwards per step, without no_sync
            opt.step()
            if mode == "cleared":
                for p in model.parameters():
                    p.grad = None
            else:
                opt.zero_grad()
        return model, 0 if ref else wrapped.runtime.counters.overlapped_reductions

    ref, _ = run(ref=True)
    model, overlapped = run(ref=False)
    (simulated, simulated_overlapped), found, _ = _under_checker(lambda: run(ref=False))
    return {
        "error": None,
        "param_rel_diff": rel_diff(model, ref)[0],
        "simulated_rel_diff": rel_diff(simulated, ref)[0],
        "overlapped": [overlapped, simulated_overlapped],
        "violations": found,
    }


def subset(rank: int, world: int, placement: str) -> dict[str, Any]:
    """An optimizer over the layers only (SGD with momentum), the embedding and head still trainable: plain
    PyTorch's `zero_grad` leaves their `.grad` accumulating, and the clip over every parameter counts them
    (review, session 27: memplan forgot them). 3 steps against DistributedDataParallel; `placement`: every chunk
    "persistent", "offloaded" (replicated) or "sharded" on the host; each chunk mixes a layer with the embedding
    or the head."""
    torch.manual_seed(0)
    model = TinyLM()
    ref = copy.deepcopy(model)
    ddp = DistributedDataParallel(ref)

    def layers(m: nn.Module) -> list[nn.Parameter]:
        return [p for n, p in m.named_parameters() if n.startswith("layers")]

    ref_opt = torch.optim.SGD(layers(ref), lr=0.1, momentum=0.9)
    # two chunks: the embedding and a layer, a layer and the head
    plan = manual_plan(model, chunk_size_bytes=3300, offload="none" if placement == "persistent" else "all")
    if placement == "sharded":
        plan = _sharded(plan, world)
    wrapped = agent.wrap(
        model, torch.optim.SGD(layers(model), lr=0.1, momentum=0.9), plan=plan, feedback_steps=None
    )
    g = torch.Generator().manual_seed(rank)
    norms: list[list[float]] = []
    for _ in range(3):
        ids = torch.randint(0, VOCAB, (4, 8), generator=g)
        pair = []
        for run, m, opt in ((ddp, ref, ref_opt), (wrapped.model, model, wrapped.optimizer)):
            run(input_ids=ids, labels=ids)["loss"].backward()
            pair.append(float(torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)))
            opt.step()
            opt.zero_grad()
        norms.append(pair)
    return {"error": None, "norms": norms, "param_rel_diff": rel_diff(model, ref)[0]}


def inplace(rank: int, world: int, copy_kind: str) -> dict[str, Any]:
    """Every chunk offloaded and sharded on the host, the compute copy node-shared (`copy_kind` "shared", the
    default) or private: a `load_state_dict` of the model (every rank), then after each of 2 steps every rank scales
    every parameter in place (`p.mul_(0.9)`, outside forward; not with ":noscale"). The warnings the runtime
    logged."""
    copy_kind, _, scale = copy_kind.partition(":")
    import logging

    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    handler = Keep(level=logging.WARNING)
    logging.getLogger("agent").addHandler(handler)
    try:
        torch.manual_seed(0)
        model = TinyLM()
        options = RuntimeOptions(share_compute_copy=copy_kind == "shared")
        wrapped = agent.wrap(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            plan=sharded_plan(model, world, "all"),
            feedback_steps=None,
            options=options,
        )
        wrapped.model.load_state_dict(copy.deepcopy(wrapped.model.state_dict()))
        x = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(rank))
        for _ in range(2):
            wrapped.model(input_ids=x, labels=x)["loss"].backward()
            wrapped.optimizer.step()
            wrapped.optimizer.zero_grad()
            with torch.no_grad():
                for p in model.parameters() if scale != "noscale" else []:
                    p.mul_(0.9)
        wrapped.model(input_ids=x, labels=x)
    finally:
        logging.getLogger("agent").removeHandler(handler)
    return {"error": None, "warnings": [w for w in seen if "in place" in w]}


class NormedLM(nn.Module):
    """Residual layers with BatchNorm (running statistics: persistent buffers each rank's forward updates)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.BatchNorm1d(HIDDEN), nn.ReLU()) for _ in range(2)
        )
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.embed(input_ids).flatten(0, 1)
        for layer in self.layers:
            h = h + layer(h)
        return {"loss": nn.functional.cross_entropy(self.head(h), labels.flatten())}


def batchnorm(rank: int, world: int, arg: str) -> dict[str, Any]:
    """`NormedLM` against DistributedDataParallel (its default `broadcast_buffers=True`) for 3 steps, each rank on
    its own batches; `arg` "persistent" or "offloaded" (every chunk), with ":accumulate" two micro-steps per step,
    the first inside no_sync(). Then an evaluation in eval mode, through each wrapper. The largest difference of
    the buffers, of the training and evaluation losses, and of the parameters."""
    placement, _, accumulate = arg.partition(":")
    torch.manual_seed(0)
    model = NormedLM()
    ref = copy.deepcopy(model)
    ddp = DistributedDataParallel(ref)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    plan = manual_plan(model, chunk_size_bytes=4096, offload="none" if placement == "persistent" else "all")
    wrapped = agent.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), plan=plan, feedback_steps=None)
    micro = 2 if accumulate else 1
    g = torch.Generator().manual_seed(rank)
    data = [torch.randint(0, VOCAB, (4, 8), generator=g) for _ in range(3 * micro)]
    ref_losses = _train(ddp, ddp.no_sync, ref_opt, data, micro)
    losses = _train(wrapped.model, wrapped.no_sync, wrapped.optimizer, data, micro)
    x = torch.randint(0, VOCAB, (4, 8), generator=torch.Generator().manual_seed(99))
    ddp.eval()
    wrapped.model.eval()
    with torch.no_grad():
        evals = [float(run(input_ids=x, labels=x)["loss"]) for run in (ddp, wrapped.model)]
    buffers = max(
        float((a - b).abs().max())
        for a, b in zip(model.buffers(), ref.buffers(), strict=True)
        if a.is_floating_point()
    )
    return {
        "error": None,
        "loss_diff": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses, strict=True)),
        "eval_diff": abs(evals[0] - evals[1]) / abs(evals[0]),
        "buffer_diff": buffers,
        "param_rel_diff": rel_diff(model, ref)[0],
    }
