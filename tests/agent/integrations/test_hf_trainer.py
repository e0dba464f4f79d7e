"""`agent.integrations.hf.wrap_trainer` with the real `transformers.Trainer` (and Accelerate under it), CPU.

Tiny models built from config with the library's defaults; a device limit that makes the planner offload;
the Trainer's default clipping (here max_grad_norm=0.5, active every step: the logged grad_norm is above it).
Two ranks (marked `distributed`): the real launcher (`torchrun --standalone`, gloo), two launches in all (the
plain DDP Trainer, the wrapped one saving a checkpoint, an FSDP-configured one refused; then the resume), at
max_grad_norm=1.0 (the Trainer's default, active every step there) and 2 accumulation micro-steps; the
wrapped runs apply the device-limit plan with its offloaded chunks sharded over the 2 ranks.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import hf_jobs
import pytest
import torch
from hf_jobs import torchrun

pytestmark = pytest.mark.slow
TOL = 1e-5
HERE = Path(__file__).parent


def offloading_limit(model: torch.nn.Module) -> int:
    """A device limit at 70% of the plain job's measured peak (the planner must offload)."""
    import agent

    ids = torch.stack([d["input_ids"] for d in hf_jobs.dataset()[:4]])
    probe = copy.deepcopy(model)
    trace = agent.profile(
        probe,
        {"input_ids": ids, "labels": ids},
        optimizer=torch.optim.AdamW([p for p in probe.parameters() if p.requires_grad]),
        repeats=1,
        allocation_trace=False,
    )
    return int(trace.measurements.peak_device_bytes * 0.7)


@pytest.fixture(scope="module")
def limits() -> dict[str, int]:
    """Per model kind: `offloading_limit`."""
    return {kind: offloading_limit(hf_jobs.build_model(kind)) for kind in ("llama", "gpt2")}


def in_a_new_process(spec: dict[str, Any]) -> dict[str, Any]:
    """`hf_jobs.run(spec)` in a fresh interpreter (a resume from a checkpoint, as a restarted job does it)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, str(HERE / "hf_jobs.py"), json.dumps(spec)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result: dict[str, Any] = json.loads(proc.stdout.rsplit("RESULT ", 1)[1])
    return result


def assert_same(got: list[dict[str, float]], ref: list[dict[str, float]], *, exact: bool = False) -> None:
    assert [h["step"] for h in got] == [h["step"] for h in ref]
    for g, r in zip(got, ref, strict=True):
        for key in ("loss", "grad_norm"):
            if exact:
                assert g[key] == r[key], f"step {g['step']}: {key} {g[key]} vs {r[key]}"
            else:
                assert abs(g[key] - r[key]) <= TOL * abs(r[key]), (
                    f"step {g['step']}: {key} {g[key]} vs {r[key]}"
                )


@pytest.mark.parametrize(("kind", "accumulation"), [("llama", 1), ("gpt2", 1), ("llama", 2)])
def test_wrapped_trainer_trains_like_the_plain_trainer_with_clipping(
    kind: str, accumulation: int, limits: dict[str, int], tmp_path: Path
) -> None:
    spec = {"kind": kind, "steps": 5, "accumulation": accumulation}
    plain = hf_jobs.run({**spec, "out": str(tmp_path / "plain")})
    got = hf_jobs.run({**spec, "out": str(tmp_path / "wrapped"), "wrap": True, "device_memory": limits[kind]})
    assert got["offloaded"] > 0, "the limit did not make the planner offload"
    assert all(h["grad_norm"] > 0.5 for h in plain["history"]), "clipping is not active"
    assert_same(got["history"], plain["history"])
    c = got["counters"]
    assert c["speculative"] > 0 and c["redos"] > 0  # host steps overlapped backward, clipping redid them
    assert got["predicted_redo_s"] > 0  # the Trainer clips (max_grad_norm): the plan counts the redo


def test_trainer_resumed_from_a_checkpoint_in_a_new_process_continues_identically(
    limits: dict[str, int], tmp_path: Path
) -> None:
    """Save at step 3 (the Trainer's own checkpoint: model, optimizer, scheduler, RNG), resume in a new
    process with the same plan, and get the uninterrupted run's steps 4-6 exactly."""
    spec = {"kind": "llama", "steps": 6, "out": str(tmp_path / "run"), "wrap": True}
    full = hf_jobs.run({**spec, "save_steps": 3, "device_memory": limits["llama"]})
    assert full["offloaded"] > 0
    checkpoint = tmp_path / "run" / "checkpoint-3"
    assert (checkpoint / "optimizer.pt").exists()
    plan = tmp_path / "plan.json"
    plan.write_text(full["plan"])
    resume = {**spec, "out": str(tmp_path / "resumed"), "resume": str(checkpoint), "plan": str(plan)}
    resumed = in_a_new_process(resume)
    assert [h["step"] for h in resumed["history"]] == [1, 2, 3, 4, 5, 6]  # 1-3 read back from the checkpoint
    assert_same(resumed["history"][3:], full["history"][3:], exact=True)


def test_a_lora_trainer_trains_like_the_plain_one_saves_its_adapters_and_resumes_identically(
    tmp_path: Path,
) -> None:
    """Session 21 probe: a peft LoRA model (the base frozen inside PEFT's wrappers) in the Trainer, wrapped under a
    limit that offloads every chunk: the same steps as the plain LoRA Trainer; its checkpoint holds the adapters
    (PEFT's `save_pretrained` of the managed model's state dict), and a resume in a new process (the Trainer's
    `load_adapter` into the managed model) continues the uninterrupted run exactly."""
    pytest.importorskip("peft")
    spec: dict[str, Any] = {"kind": "llama", "steps": 6, "lora": True}
    limit = offloading_limit(hf_jobs.trainer("llama", tmp_path / "probe", steps=1, lora=True).model)
    plain = hf_jobs.run({**spec, "out": str(tmp_path / "plain")})
    full = hf_jobs.run(
        {**spec, "out": str(tmp_path / "run"), "wrap": True, "device_memory": limit, "save_steps": 3}
    )
    assert full["offloaded"] > 0
    assert_same(full["history"], plain["history"])
    checkpoint = tmp_path / "run" / "checkpoint-3"
    assert (checkpoint / "adapter_model.safetensors").exists() and (checkpoint / "optimizer.pt").exists()
    plan = tmp_path / "plan.json"
    plan.write_text(full["plan"])
    resume = {
        **spec,
        "out": str(tmp_path / "resumed"),
        "wrap": True,
        "resume": str(checkpoint),
        "plan": str(plan),
    }
    resumed = in_a_new_process(resume)
    assert_same(resumed["history"][3:], full["history"][3:], exact=True)


def test_a_scheduler_the_trainer_already_holds_drives_the_wrapped_optimizer(
    limits: dict[str, int], tmp_path: Path
) -> None:
    """The user's optimizer and linear schedule in the Trainer before `wrap_trainer` (`Trainer(optimizers=(opt,
    sched))`): refused before session 23, because the scheduler held the original optimizer, whose `param_groups`
    the wrapped one copied. They are one list now, so the decay reaches the steps: the same losses as the plain
    run (without the shared list the losses differ from step 2)."""
    spec = {"kind": "llama", "steps": 4, "prebuilt_scheduler": True}
    plain = hf_jobs.run({**spec, "out": str(tmp_path / "plain")})
    got = hf_jobs.run(
        {**spec, "out": str(tmp_path / "wrapped"), "wrap": True, "device_memory": limits["llama"]}
    )
    assert got["offloaded"] > 0
    assert_same(got["history"], plain["history"])


def _accelerate_loop(model: torch.nn.Module, wrap: bool, limit: int) -> list[tuple[float, float]]:
    """A plain Accelerate loop (prepare, accelerator.backward, accelerator.clip_grad_norm_)."""
    from accelerate import Accelerator

    import agent

    data = hf_jobs.dataset()
    opt: Any = torch.optim.AdamW(model.parameters(), lr=2e-3, fused=True)
    loader = torch.utils.data.DataLoader(data[:24], batch_size=4)
    if wrap:
        first = next(iter(loader))
        w = agent.wrap(model, opt, sample_batch=first, device_memory=limit, feedback_steps=None)
        assert w.plan.policy is not None and any(
            c.placement.value == "offloaded" for c in w.plan.policy.chunks
        )
        model, opt = w.model, w.optimizer
    acc = Accelerator(cpu=True)
    model, opt, loader = acc.prepare(model, opt, loader)
    torch.manual_seed(3)
    out = []
    for batch in loader:
        loss = model(**batch).loss
        acc.backward(loss)
        norm = acc.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        out.append((loss.item(), float(norm)))
    return out


def param_rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest ||a - b|| / ||b|| over the parameters (the DDP tests' measure)."""
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).norm() / b[k].norm().clamp_min(1e-12)) for k in b)


TWO_RANKS = {
    "kind": "llama",
    "steps": 4,
    "accumulation": 2,
    "max_grad_norm": 1.0,
    "save_steps": 2,
    "eval_steps": 2,
}


@pytest.fixture(scope="module")
def two_rank_plan(limits: dict[str, int], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The plan `wrap_trainer` makes under the device limit (it offloads), for 2 ranks with every offloaded chunk
    sharded. Planned in this process: under the group the planner shards an offloaded chunk where the measured
    all-gather and reduce-scatter make it faster than replicating, which on the shared CPU not every run finds."""
    from agent.integrations.hf import wrap_trainer

    root = tmp_path_factory.mktemp("plan")
    t = hf_jobs.trainer("llama", root, steps=1, max_grad_norm=1.0, accumulation=2)
    plan = wrap_trainer(t, device_memory=limits["llama"], feedback_steps=None).plan
    hf_jobs.plan_for_two_ranks(plan, root / "plan.json")
    return root / "plan.json"


@pytest.fixture(scope="module")
def two_ranks(
    two_rank_plan: Path, two_rank_lora_plan: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, list[Any]]:
    """One launch of two ranks: the plain Trainer (Accelerate wraps it in DDP), then the wrapped Trainer with
    offloaded chunks sharded over the ranks, both saving a checkpoint at step 2 of 4; then an FSDP-configured
    Trainer; then the plain and the wrapped Trainer of a peft LoRA llama."""
    root = tmp_path_factory.mktemp("two_ranks")
    plain = {**TWO_RANKS, "out": str(root / "plain"), "final": str(root / "plain.pt")}
    wrapped = {
        **TWO_RANKS,
        "out": str(root / "wrapped"),
        "final": str(root / "wrapped.pt"),
        "wrap": True,
        "plan": str(two_rank_plan),
    }
    fsdp = {"kind": "llama", "out": str(root / "fsdp"), "args": {"fsdp": "full_shard"}}
    lora = {**TWO_RANKS, "save_steps": None, "eval_steps": None, "lora": True}
    lora_plain = {**lora, "out": str(root / "lora-plain"), "final": str(root / "lora-plain.pt")}
    lora_wrapped = {
        **lora,
        "out": str(root / "lora-wrapped"),
        "final": str(root / "lora-wrapped.pt"),
        "wrap": True,
        "plan": str(two_rank_lora_plan),
    }
    return root, torchrun([plain, wrapped, fsdp, lora_plain, lora_wrapped])


@pytest.fixture(scope="module")
def two_rank_lora_plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """As `two_rank_plan`, for the llama with peft's LoRA adapters (`hf_jobs.trainer(lora=True)`)."""
    pytest.importorskip("peft")
    from agent.integrations.hf import wrap_trainer

    root = tmp_path_factory.mktemp("lora_plan")
    t = hf_jobs.trainer("llama", root, steps=1, max_grad_norm=1.0, accumulation=2, lora=True)
    plan = wrap_trainer(t, device_memory=offloading_limit(t.model), feedback_steps=None).plan
    hf_jobs.plan_for_two_ranks(plan, root / "plan.json")
    return root / "plan.json"


@pytest.mark.distributed
def test_wrapped_trainer_on_two_ranks_trains_like_the_ddp_trainer(two_ranks: tuple[Path, list[Any]]) -> None:
    """torchrun, 2 ranks: the wrapped Trainer (its offloaded chunks sharded over the ranks, no DDP, gradients
    averaged by the runtime, accumulation over 2 micro-steps without a reduce on the first) logs the plain
    DDP Trainer's losses and clipped norms and ends with its parameters, within 1e-5 relative."""
    root, results = two_ranks
    for plain, wrapped, *_ in results:
        assert wrapped["world_size"] == 2 and wrapped["offloaded"] > 0 and wrapped["sharded"] > 0
        assert all(h["grad_norm"] > 1.0 for h in plain["history"]), "clipping is not active"
        assert_same(wrapped["history"], plain["history"])
        # the Trainer's evaluation at steps 2 and 4 (every rank, its share of the eval set, losses gathered)
        assert len(plain["evals"]) == 2 and len(wrapped["evals"]) == 2
        for got, ref in zip(wrapped["evals"], plain["evals"], strict=True):
            assert abs(got - ref) <= TOL * abs(ref), (wrapped["evals"], plain["evals"])
        c = wrapped["counters"]
        assert c["speculative"] > 0  # host steps overlapped backward
        # Accelerate's no_sync found the runtime's: every chunk's gradient (sharded: reduce-scattered;
        # replicated: all-reduced) is averaged once per optimizer step, after the last micro-step; a sharded
        # chunk's local gradient accumulates without a collective inside no_sync
        assert wrapped["accelerate_no_sync_is_the_runtimes"]
        chunks = len(json.loads(wrapped["plan"])["policy"]["chunks"])
        micro_steps = TWO_RANKS["steps"] * TWO_RANKS["accumulation"]
        assert c["backwards"] == micro_steps
        assert c["reductions"] == chunks * TWO_RANKS["steps"], (c, chunks, wrapped["sharded"])
    got = torch.load(root / "wrapped.pt", weights_only=True)
    ref = torch.load(root / "plain.pt", weights_only=True)
    w = results[0][1]
    print(
        f"2-rank wrapped Trainer vs DDP Trainer: parameters {param_rel_diff(got, ref):.2e} relative "
        f"({w['offloaded']} chunks offloaded, {w['sharded']} sharded, {w['counters']['reductions']} reductions)"
    )
    assert param_rel_diff(got, ref) <= TOL


@pytest.mark.distributed
def test_a_lora_trainer_on_two_ranks_trains_like_the_ddp_lora_trainer(
    two_ranks: tuple[Path, list[Any]],
) -> None:
    """torchrun, 2 ranks, peft LoRA adapters on a frozen llama (session 21 probe): the wrapped Trainer, its
    offloaded chunks (frozen base weights and adapters) sharded over the ranks, logs the plain DDP LoRA Trainer's
    losses and clipped norms over 2 accumulation micro-steps and ends with its parameters."""
    root, results = two_ranks
    for *_, plain, wrapped in results:
        assert wrapped["world_size"] == 2 and wrapped["offloaded"] > 0 and wrapped["sharded"] > 0
        assert_same(wrapped["history"], plain["history"])
    got = torch.load(root / "lora-wrapped.pt", weights_only=True)
    ref = torch.load(root / "lora-plain.pt", weights_only=True)
    assert param_rel_diff(got, ref) <= TOL


@pytest.mark.distributed
def test_wrapped_trainer_on_two_ranks_saves_a_checkpoint_and_resumes_it_identically(
    two_ranks: tuple[Path, list[Any]], two_rank_plan: Path
) -> None:
    """The checkpoint at step 2 was written without a hang (`optimizer.state_dict()` is a collective the
    Trainer calls on rank 0 only), as the Trainer's own files; a new launch resumes it with the same plan and
    reproduces the uninterrupted run's steps 3-4 and final parameters exactly."""
    root, results = two_ranks
    checkpoint = root / "wrapped" / "checkpoint-2"
    assert {"optimizer.pt", "scheduler.pt", "rng_state_0.pth", "rng_state_1.pth"} <= {
        p.name for p in checkpoint.iterdir()
    }
    full = results[0][1]
    resume = {
        **TWO_RANKS,
        "out": str(root / "resumed"),
        "final": str(root / "resumed.pt"),
        "wrap": True,
        "plan": str(two_rank_plan),
        "resume": str(checkpoint),
    }
    for (resumed,) in torchrun([resume]):
        assert resumed["sharded"] > 0
        assert [h["step"] for h in resumed["history"]] == [1, 2, 3, 4]  # 1-2 read back from the checkpoint
        assert_same(resumed["history"][2:], full["history"][2:], exact=True)
    got = torch.load(root / "resumed.pt", weights_only=True)
    ref = torch.load(root / "wrapped.pt", weights_only=True)
    assert all(torch.equal(got[k], ref[k]) for k in ref)


@pytest.fixture(scope="module")
def device_shard_plan(two_rank_plan: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`two_rank_plan` with every chunk sharded and every other one (the first included) persistent whatever the
    planner chose on the shared CPU: persistent sharded chunks are sharded on the device (ZeRO-3), so
    `model.state_dict()` is a collective."""
    from client.contract import Plan

    path = tmp_path_factory.mktemp("device_shard_plan") / "plan.json"
    hf_jobs.plan_for_two_ranks(Plan.model_validate_json(two_rank_plan.read_text()), path, persistent_parity=0)
    return path


@pytest.mark.distributed
def test_wrapped_trainer_with_device_sharded_chunks_saves_the_model_on_two_ranks_and_resumes_it_identically(
    device_shard_plan: Path, two_ranks: tuple[Path, list[Any]], tmp_path: Path
) -> None:
    """torchrun, 2 ranks, persistent chunks sharded on the device: the Trainer's model saves (a checkpoint,
    a `save_only_model` checkpoint, the user's final `save_model()`) take `model.state_dict()` on every rank
    (a collective; the Trainer takes it on the writing rank only, which raised RankArrivalError); the
    checkpoint resumes to the uninterrupted run's steps 3-4 and parameters exactly, and the saved model files
    hold the trained parameters."""
    from safetensors.torch import load_file

    wrapped = {**TWO_RANKS, "wrap": True, "plan": str(device_shard_plan)}
    full = {**wrapped, "out": str(tmp_path / "full"), "final": str(tmp_path / "full.pt")}
    full["save_model"] = str(tmp_path / "model")
    resume = {**wrapped, "out": str(tmp_path / "resumed"), "final": str(tmp_path / "resumed.pt")}
    resume["resume"] = str(tmp_path / "full" / "checkpoint-2")
    only_model = {**wrapped, "steps": 2, "out": str(tmp_path / "only_model"), "save_only_model": True}
    for (plain, *_), (got_full, got_resumed, got_only) in zip(
        two_ranks[1], torchrun([full, resume, only_model]), strict=True
    ):
        for got, ref in zip(got_full["evals"], plain["evals"], strict=True):  # the DDP Trainer's evaluations
            assert abs(got - ref) <= TOL * abs(ref), (got_full["evals"], plain["evals"])
        # the Trainer's evaluations at steps 2 and 4 ran on every rank (their forwards gather the device shards,
        # a collective); the resumed run's at step 4 is the uninterrupted run's (step 2's read back with the log)
        assert len(got_full["evals"]) == 2 and got_resumed["evals"] == got_full["evals"]
        assert (
            got_full["device_sharded"] > 0
            and got_resumed["device_sharded"] > 0
            and got_only["device_sharded"] > 0
        )
        assert [h["step"] for h in got_resumed["history"]] == [
            1,
            2,
            3,
            4,
        ]  # 1-2 read back from the checkpoint
        assert_same(got_resumed["history"][2:], got_full["history"][2:], exact=True)
    ref = torch.load(tmp_path / "full.pt", weights_only=True)
    resumed = torch.load(tmp_path / "resumed.pt", weights_only=True)
    assert all(torch.equal(resumed[k], ref[k]) for k in ref)
    saved = load_file(str(tmp_path / "model" / "model.safetensors"))
    assert saved and all(torch.equal(saved[k], ref[k]) for k in saved)
    only = {p.name for p in (tmp_path / "only_model" / "checkpoint-2").iterdir()}
    assert "model.safetensors" in only and "optimizer.pt" not in only


@pytest.mark.distributed
def test_wrap_trainer_under_torchrun_refuses_fsdp_naming_the_argument(
    two_ranks: tuple[Path, list[Any]],
) -> None:
    _, results = two_ranks
    for _, _, fsdp, *_ in results:  # every rank refuses, before any collective: nothing hangs
        assert fsdp["world_size"] == 2
        message = fsdp["refused"]
        assert message is not None and message.startswith("trainer.args.fsdp: True;")
        assert "plain data parallelism only" in message


def test_an_accelerate_loop_over_the_wrapped_model_matches_the_plain_loop(limits: dict[str, int]) -> None:
    base = hf_jobs.build_model("gpt2")
    ref = _accelerate_loop(copy.deepcopy(base), False, 0)
    got = _accelerate_loop(copy.deepcopy(base), True, limits["gpt2"])
    for (gl, gn), (rl, rn) in zip(got, ref, strict=True):
        assert abs(gl - rl) <= TOL * abs(rl) and abs(gn - rn) <= TOL * abs(rn)
    assert all(rn > 0.5 for _, rn in ref)


def test_a_bf16_trainer_is_profiled_under_its_autocast_and_trains_like_the_plain_one(
    limits: dict[str, int], tmp_path: Path
) -> None:
    """`bf16=True` (Accelerate's autocast around every training forward): `wrap_trainer` profiles under the same
    autocast, so the plan holds the activations training keeps (before session 22 it profiled in fp32, every
    block's activations the fp32 ones); losses and gradient norms equal the plain bf16 Trainer's."""
    import agent
    from client.contract import Trace

    spec = {"kind": "llama", "steps": 4, "bf16": True}
    plain = hf_jobs.run({**spec, "out": str(tmp_path / "plain")})
    got = hf_jobs.run(
        {
            **spec,
            "out": str(tmp_path / "wrapped"),
            "wrap": True,
            "device_memory": limits["llama"],
            "keep_trace": True,
        }
    )
    assert got["offloaded"] > 0
    assert_same(got["history"], plain["history"])

    profiled = [b.activation_bytes for b in Trace.model_validate_json(got["trace"]).measurements.blocks]
    ids = torch.stack([d["input_ids"] for d in hf_jobs.dataset()[:4]])
    batch = {"input_ids": ids, "labels": ids}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under_autocast = agent.profile(hf_jobs.build_model("llama"), batch, repeats=1, allocation_trace=False)
    in_fp32 = agent.profile(hf_jobs.build_model("llama"), batch, repeats=1, allocation_trace=False)
    # the first repeated block is profiled under any device limit (later ones may be extrapolated from it)
    assert profiled[1] == under_autocast.measurements.blocks[1].activation_bytes
    assert profiled[1] < in_fp32.measurements.blocks[1].activation_bytes
