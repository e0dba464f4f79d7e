"""The jobs the integration tests run, in this process or in a fresh one (`python hf_jobs.py JSON`), or on
every rank under the real launcher (`torchrun --nproc-per-node 2 hf_jobs.py JSON`: the Trainer sets up the
process group itself, gloo on the CPU). JSON: one job's spec, or a list of them run one after the other.

A tiny Hugging Face causal LM built from its config with the library's defaults (use_cache, attention
implementation, tying), a random token dataset, and a `transformers.Trainer` on the CPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

VOCAB, SEQ, N_EXAMPLES = 128, 32, 64
HERE = Path(__file__).parent


def build_model(kind: str) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    if kind == "llama":
        cfg: Any = transformers.LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=SEQ,
        )
        return transformers.LlamaForCausalLM(cfg)
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=128, n_layer=4, n_head=4, n_positions=SEQ)
    return transformers.GPT2LMHeadModel(cfg)  # dropout 0.1 and tied embeddings, as the library makes it


def dataset() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (N_EXAMPLES, SEQ), generator=g)
    return [{"input_ids": x, "labels": x.clone()} for x in ids]


def trainer(
    kind: str,
    out: Path,
    *,
    steps: int,
    save_steps: int | None = None,
    max_grad_norm: float = 0.5,
    accumulation: int = 1,
    save_only_model: bool = False,
    eval_steps: int | None = None,
    lora: bool = False,
    bf16: bool = False,
) -> Any:
    """A Trainer on `dataset()`; with `eval_steps`, evaluating every that many steps on 10 more examples (not a
    multiple of 2 ranks x 4: Accelerate pads the last batch, so every rank runs as many forwards)."""
    import transformers

    args = transformers.TrainingArguments(
        output_dir=str(out),
        per_device_train_batch_size=4,
        per_device_eval_batch_size=4,
        eval_strategy="steps" if eval_steps else "no",
        eval_steps=eval_steps,
        max_steps=steps,
        learning_rate=2e-3,
        logging_steps=1,
        save_strategy="steps" if save_steps else "no",
        save_steps=save_steps or 500,
        max_grad_norm=max_grad_norm,
        gradient_accumulation_steps=accumulation,
        save_only_model=save_only_model,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        seed=7,
        dataloader_num_workers=0,
        bf16=bf16,
    )
    data = dataset()
    model = build_model(kind)
    if lora:  # LoRA adapters from peft on the attention projections; the base model frozen
        import peft

        torch.manual_seed(3)
        targets = ["q_proj", "v_proj"] if kind == "llama" else ["c_attn"]
        model = peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=16, target_modules=targets))
    return transformers.Trainer(
        model=model,
        args=args,
        train_dataset=data,
        eval_dataset=[{k: v.flip(0) for k, v in x.items()} for x in data[:10]] if eval_steps else None,
    )


def history(t: Any) -> list[dict[str, float]]:
    """Per-step loss and grad_norm the Trainer logged."""
    return [
        {"step": h["step"], "loss": h["loss"], "grad_norm": h["grad_norm"]}
        for h in t.state.log_history
        if "loss" in h and "grad_norm" in h
    ]


def plan_for_two_ranks(plan: Any, path: Path, *, persistent_parity: int | None = None) -> Any:
    """`plan` (a `client.contract.Plan`) made for 2 ranks whatever the planner would choose on the shared CPU,
    written to `path` and returned: every offloaded chunk sharded across the ranks (each holds half in host
    memory); with `persistent_parity` every chunk sharded and those at even (0) or odd (1) indices persistent,
    so sharded on the device (ZeRO-3: `model.state_dict()` is a collective)."""
    from client.contract import Placement

    assert plan.policy is not None
    if persistent_parity is None:
        chunks = [
            c.model_copy(update={"sharded": c.placement == Placement.offloaded}) for c in plan.policy.chunks
        ]
    else:
        chunks = [
            c.model_copy(
                update={
                    "sharded": True,
                    "placement": Placement.persistent if i % 2 == persistent_parity else c.placement,
                }
            )
            for i, c in enumerate(plan.policy.chunks)
        ]
    out = plan.model_copy(
        update={"policy": plan.policy.model_copy(update={"chunks": chunks, "world_size": 2})}
    )
    path.write_text(out.model_dump_json())
    return out


def wrap_kwargs(spec: dict[str, Any]) -> dict[str, Any]:
    """What a wrapped job's spec passes to the wrapping call: its plan file, else its device limit; feedback
    after 4 steps to the spec's `feedback` file, else none."""
    from client.contract import Plan

    kw: dict[str, Any] = (
        {"feedback_steps": 4, "feedback_path": Path(spec["feedback"])}
        if spec.get("feedback")
        else {"feedback_steps": None}
    )
    if spec.get("plan"):
        return kw | {"plan": Plan.model_validate_json(Path(spec["plan"]).read_text())}
    return kw | {"device_memory": spec["device_memory"]}


def run(spec: dict[str, Any]) -> dict[str, Any]:
    """Train as `spec` says (wrapped or plain, resumed or not); the logged history and the plan used."""
    from agent.integrations.hf import wrap_trainer

    t = trainer(
        spec["kind"],
        Path(spec["out"]),
        steps=spec["steps"],
        save_steps=spec.get("save_steps"),
        max_grad_norm=spec.get("max_grad_norm", 0.5),
        accumulation=spec.get("accumulation", 1),
        save_only_model=spec.get("save_only_model", False),
        eval_steps=spec.get("eval_steps"),
        lora=spec.get("lora", False),
        bf16=spec.get("bf16", False),
    )
    if spec.get("prebuilt_scheduler"):
        # the user's optimizer and schedule, as `Trainer(optimizers=(opt, sched))` holds them (the Trainer rebuilds a
        # scheduler it made itself at train())
        import transformers

        opt = torch.optim.AdamW(t.model.parameters(), lr=t.args.learning_rate)
        t.optimizer = opt
        t.lr_scheduler = transformers.get_linear_schedule_with_warmup(opt, 1, spec["steps"])
    plan_json = trace_json = None
    offloaded = sharded = device_sharded = 0
    if spec.get("wrap"):
        w = wrap_trainer(t, **wrap_kwargs(spec))
        t._move_model_to_device(
            t.model, t.args.device
        )  # what the Trainer does with its model: model.to(device)
        plan_json = w.plan.model_dump_json()
        if spec.get("keep_trace") and w.source is not None and w.source.trace is not None:
            trace_json = w.source.trace.model_dump_json()
        assert w.plan.policy is not None
        offloaded = sum(c.placement.value == "offloaded" for c in w.plan.policy.chunks)
        sharded = len(w.plan.policy.sharded_chunks)
        device_sharded = sum(c.sharded and c.placement.value == "persistent" for c in w.plan.policy.chunks)
    t.train(resume_from_checkpoint=spec.get("resume"))
    if spec.get("save_model"):  # the user's final save, on every rank as the Trainer documents it
        t.save_model(spec["save_model"])
    out: dict[str, Any] = {
        "history": history(t),
        "evals": [h["eval_loss"] for h in t.state.log_history if "eval_loss" in h],
        "plan": plan_json,
        "trace": trace_json,
        "offloaded": offloaded,
        "sharded": sharded,
        "device_sharded": device_sharded,
        "world_size": t.args.world_size,
    }
    if spec.get(
        "final"
    ):  # the trained parameters (every rank holds the same; a collective with device shards)
        final = {k: v.detach().clone() for k, v in t.model.state_dict().items()}
        if t.args.process_index == 0:
            torch.save(final, spec["final"])
    if spec.get("wrap"):
        c = w.runtime.counters
        out["counters"] = {
            "speculative": c.speculative_steps,
            "redos": c.host_step_redos,
            "undos": c.host_step_undos,
            "reductions": c.grad_reductions,  # chunk gradients averaged across the ranks
            "backwards": c.iterations,
        }
        assert w.plan.predictions is not None
        # what the Trainer enters on a non-final accumulation micro-step: Accelerate's no_sync on its model
        with t.accelerator.no_sync(t.model_wrapped):
            out["accelerate_no_sync_is_the_runtimes"] = not w.runtime.sync_gradients
        out["predicted_redo_s"] = w.plan.predictions.breakdown.get("host_optimizer_redo_s", 0.0)
    return out


def refused(spec: dict[str, Any]) -> dict[str, Any]:
    """wrap_trainer on a Trainer configured with `spec["args"]` (extra TrainingArguments): the message."""
    import transformers

    from agent.integrations.hf import wrap_trainer

    args = transformers.TrainingArguments(
        output_dir=spec["out"], use_cpu=True, report_to=[], max_steps=1, **spec["args"]
    )
    t = transformers.Trainer(model=build_model(spec["kind"]), args=args, train_dataset=dataset())
    try:
        wrap_trainer(t, device_memory=1 << 30, feedback_steps=None)
    except ValueError as exc:
        return {"refused": str(exc), "world_size": t.args.world_size}
    return {"refused": None, "world_size": t.args.world_size}


def main(spec: dict[str, Any]) -> dict[str, Any]:
    return refused(spec) if "args" in spec else run(spec)


def report(result: Any) -> None:
    """Print `result` as the `RESULT <json>` line `torchrun` (below) collects: in one process as is, under a
    process group one rank at a time, then end the group."""
    line = "\nRESULT " + json.dumps(result) + "\n"
    if not torch.distributed.is_initialized():
        sys.stdout.write(line)
        return
    # one rank at a time: two ranks' lines longer than a pipe's atomic write (4 KiB) interleave
    for rank in range(torch.distributed.get_world_size()):
        if rank == torch.distributed.get_rank():
            sys.stdout.write(line)
            sys.stdout.flush()
        torch.distributed.barrier()
    # as a torchrun script should end (torch warns otherwise). Without it a wrapped job's rank aborted at
    # exit now and then ("terminate called without an active exception", SIGABRT, after its RESULT):
    # 4 of 30 launches in one period of load on the shared 2-core CPU, 0 of 38 later (the plain DDP
    # Trainer 0 of 8); not root-caused. 0 of 10 with these two lines
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def launch(
    specs: list[dict[str, Any]], script: Path, timeout_s: float = 600
) -> subprocess.CompletedProcess[str]:
    """`specs` run one after the other on each of two ranks of `script` under the real launcher (gloo on the CPU;
    the framework sets up the process group itself): the launcher's process, finished."""
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
        + [str(script), json.dumps(specs)],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def torchrun(specs: list[dict[str, Any]], script: Path = HERE / "hf_jobs.py") -> list[list[dict[str, Any]]]:
    """`launch`, every rank succeeding: each rank's results, rank order."""
    proc = launch(specs, script)
    if proc.returncode != 0:  # the ranks' errors first (the launcher's summary comes last)
        errors = [
            line
            for line in proc.stderr.splitlines()
            if any(k in line for k in ("Error", "error:", "terminate", "what()", "Traceback", "Signal"))
        ]
        raise AssertionError("\n".join(errors[:40]) + "\n...\n" + proc.stderr[-3000:])
    lines = [line.split("RESULT ", 1)[1] for line in proc.stdout.splitlines() if "RESULT " in line]
    assert len(lines) == 2, proc.stdout[-3000:]
    return [json.loads(line) for line in lines]


if __name__ == "__main__":
    specs = json.loads(sys.argv[1])
    report([main(s) for s in specs] if isinstance(specs, list) else main(specs))
