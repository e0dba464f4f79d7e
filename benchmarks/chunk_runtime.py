"""Benchmark of the chunk runtime (issue 6): host optimizer throughput, and on CUDA end-to-end training.

    .venv/bin/python benchmarks/chunk_runtime.py                 # CPU parts; CUDA parts too when a GPU is present
    .venv/bin/python benchmarks/chunk_runtime.py --cuda-model 7b # choose the CUDA model size (1b, 3b, 7b)

CPU, always:
  host_optimizer  the runtime's host optimizer path (per-chunk torch AdamW, fused CPU kernel, over views
                  of the flat fp32 master; exactly the code the worker thread runs) against torch's
                  single-tensor AdamW (foreach=False) and foreach AdamW on the same parameters, in
                  parameters per second. Target: runtime path >= 5x single-tensor.
  cpu_training    tokens/s of a small llama trained plainly and through the runtime (all persistent;
                  all offloaded with 2 buffers): the runtime's overhead where device and host are one.
CUDA, when torch.cuda.is_available():
  cuda_training   a llama-shaped model whose model states do not fit on the device (7B on an 80 GB
                  card by default), bf16 compute with fp32 masters, part of the chunks offloaded:
                  tokens/s and the fraction of upload time hidden behind compute (CUDA events: for
                  each wait of the compute stream on an upload, the part of the upload still running
                  when compute reached it is exposed). Target >= 80% hidden.
  fsdp2_offload   the same model and batch with FSDP2 `fully_shard(..., offload_policy=CPUOffloadPolicy())`
                  on one GPU (world size 1), tokens/s, in the same run.
Figures are printed and saved to benchmarks/results/chunk_runtime-<UTC timestamp>.json (pointer: chunk_runtime-latest.json).
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from _results import save

RESULTS = Path(__file__).resolve().parent / "results" / "chunk_runtime.json"


# ----------------------------------------------------------------------------------------- CPU parts
def _llama(layers: int, hidden: int, vocab: int = 1000, seq: int = 256) -> torch.nn.Module:
    from agent.testing.model_zoo import build

    model, _ = build("llama", layers=layers, hidden=hidden, vocab=vocab, seq=seq, seed=0)
    return model


def _interleaved(fns: dict[str, Any], rounds: int) -> dict[str, float]:
    """Median seconds per call of each function, timed in interleaved rounds (the machine is shared)."""
    for f in fns.values():  # warm-up: state allocation, recorded access order
        f()
        f()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for k, f in fns.items():
            t0 = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def bench_host_optimizer(layers: int, hidden: int, rounds: int) -> dict[str, Any]:
    from agent.runtime import manual_plan
    from agent.wrapping import wrap

    model = _llama(layers, hidden)
    n = sum(p.numel() for p in model.parameters())
    out: dict[str, Any] = {"parameters": n, "layers": layers, "hidden": hidden, "rounds": rounds}
    fns: dict[str, Any] = {}
    for label, kwargs in (
        ("torch_single_tensor", {"foreach": False}),
        ("torch_foreach", {"foreach": True}),
        ("torch_fused", {"fused": True}),
    ):
        params = [torch.nn.Parameter(p.detach().clone()) for p in model.parameters()]
        for p in params:
            p.grad = torch.randn_like(p)
        fns[label] = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, **kwargs).step

    # the runtime's host path: every chunk offloaded; exactly the steps the worker thread runs
    chunk_bytes = 32 * 2**20
    plan = manual_plan(model, chunk_size_bytes=chunk_bytes, offload="all", n_buffers=2)
    w = wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1), plan=plan)
    rt = w.runtime
    hypers = w.optimizer.hyper_snapshot()
    work = []
    for st, stepper in zip(rt.states, rt.steppers, strict=True):
        assert st.host_grad is not None
        st.host_grad.normal_()
        work.append((stepper, st.host_grad, set(range(len(st.spec.entries)))))

    def runtime_step() -> None:
        for stepper, grad, touched in work:
            stepper.step(hypers, grad, touched)

    fns["runtime_host"] = runtime_step
    for k, sec in _interleaved(fns, rounds).items():
        out[f"{k}_params_per_s"] = n / sec
    out["runtime_host_impl"] = sorted({s.impl for s in rt.steppers})
    out["chunk_size_bytes"] = chunk_bytes
    out["chunks"] = len(rt.states)
    out["speedup_runtime_vs_single_tensor"] = (
        out["runtime_host_params_per_s"] / out["torch_single_tensor_params_per_s"]
    )
    out["speedup_fused_vs_single_tensor"] = (
        out["torch_fused_params_per_s"] / out["torch_single_tensor_params_per_s"]
    )
    out["target_5x_met"] = out["speedup_runtime_vs_single_tensor"] >= 5.0
    return out


def bench_cpu_training(rounds: int) -> dict[str, Any]:
    import copy

    from agent.runtime import manual_plan
    from agent.wrapping import wrap

    base = _llama(layers=4, hidden=256)
    batch, seq = 4, 128
    x = torch.randint(0, 1000, (batch, seq), generator=torch.Generator().manual_seed(0))
    out: dict[str, Any] = {"model": "llama 4L h256", "batch": batch, "seq": seq, "rounds": rounds}
    size = max(
        sum(p.numel() * 4 for p in base.parameters()) // 8, max(p.numel() * 4 for p in base.parameters())
    )
    fns: dict[str, Any] = {}
    for label in ("plain", "runtime_persistent", "runtime_offloaded_2buf"):
        model = copy.deepcopy(base)
        opt: Any = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        if label != "plain":
            plan = manual_plan(
                model, chunk_size_bytes=size, offload="all" if "offloaded" in label else "none", n_buffers=2
            )
            w = wrap(model, opt, plan=plan)
            model, opt = w.model, w.optimizer

        def one(model: Any = model, opt: Any = opt) -> None:
            model(input_ids=x, labels=x).loss.backward()
            opt.step()
            opt.zero_grad()

        fns[label] = one
    for k, sec in _interleaved(fns, rounds).items():
        out[f"{k}_tokens_per_s"] = batch * seq / sec
    return out


# ---------------------------------------------------------------------------------------- CUDA parts
CUDA_MODELS = {  # llama-shaped: layers, hidden, intermediate, heads, vocab
    "1b": (16, 2048, 5632, 16, 32000),
    "3b": (26, 3200, 8640, 32, 32000),
    "7b": (32, 4096, 11008, 32, 32000),
}


def _cuda_model(size: str, seq: int) -> torch.nn.Module:
    import transformers

    layers, hidden, inter, heads, vocab = CUDA_MODELS[size]
    config = transformers.LlamaConfig(
        num_hidden_layers=layers,
        hidden_size=hidden,
        intermediate_size=inter,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        vocab_size=vocab,
        max_position_embeddings=seq,
        use_cache=False,
    )
    config._attn_implementation = "sdpa"
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # build in bf16 on the host: a 7B model is 14 GB, not 28
    try:
        model = transformers.LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(old)
    return model.train()


def bench_cuda_training(
    size: str, batch: int, seq: int, steps: int, chunk_mib: int, activation_reserve_gib: float
) -> dict[str, Any]:
    """NOT RUN in the session that wrote it (no GPU there): written to run when a GPU is present."""
    from agent.runtime import RuntimeOptions, manual_plan
    from agent.wrapping import wrap
    from client.contract import Placement

    device = torch.device("cuda", torch.cuda.current_device())
    model = _cuda_model(size, seq)
    n_params = sum(p.numel() for p in model.parameters())
    chunk_bytes = chunk_mib * 2**20
    chunk_params = chunk_bytes // 2
    n_chunks = -(-n_params // chunk_params)
    n_buffers = 4
    free, total = torch.cuda.mem_get_info(device)
    budget = free - int(activation_reserve_gib * 2**30) - n_buffers * 2 * chunk_bytes
    per_persistent_chunk = chunk_params * (2 + 2 + 4 + 8)  # bf16 param + grad, fp32 master + Adam moments
    persistent = max(0, min(n_chunks, budget // per_persistent_chunk))

    def rule(i: int, n: int) -> Placement:
        return Placement.persistent if i < persistent else Placement.offloaded

    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.1)
    plan = manual_plan(
        model,
        chunk_size_bytes=chunk_bytes,
        offload=rule,
        n_buffers=n_buffers,
        compute_dtype=torch.bfloat16,
        device_memory_bytes=total,
    )
    w = wrap(
        model,
        opt,
        plan=plan,
        options=RuntimeOptions(device=device, compute_dtype=torch.bfloat16, measure_uploads=True),
    )
    x = torch.randint(0, CUDA_MODELS[size][4], (batch, seq), device=device)

    def one() -> None:
        w.model(input_ids=x, labels=x).loss.backward()
        w.optimizer.step()
        w.optimizer.zero_grad()

    one()
    one()
    torch.cuda.synchronize()
    w.runtime.reset_upload_timings()
    w.runtime.reset_stall_timings()
    t0 = time.perf_counter()
    for _ in range(steps):
        one()
    w.synchronize()
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    upload_s = sum(a.elapsed_time(b) for a, b in w.runtime.reset_upload_timings()) / 1e3
    exposed_s = sum(max(0.0, a.elapsed_time(b)) for a, b in w.runtime.reset_stall_timings()) / 1e3
    rep = w.report()
    out = {
        "model": f"llama-{size}",
        "parameters": n_params,
        "batch": batch,
        "seq": seq,
        "steps": steps,
        "chunks": n_chunks,
        "persistent_chunks": persistent,
        "n_buffers": n_buffers,
        "chunk_mib": chunk_mib,
        "tokens_per_s": batch * seq * steps / elapsed,
        "iteration_s": elapsed / steps,
        "upload_s_per_iteration": upload_s / steps,
        "exposed_upload_s_per_iteration": exposed_s / steps,
        "upload_hidden_fraction": 1.0 - exposed_s / upload_s if upload_s > 0 else None,
        "device_bytes": rep.memory.device_bytes,
        "host_bytes": rep.memory.host_bytes,
        "peak_device_allocated_bytes": torch.cuda.max_memory_allocated(device),
        "host_optimizer": rep.host_optimizer,
    }
    w.runtime.detach()  # frees chunk memory and stops the host worker; the caller collects the rest
    return out


def bench_fsdp2_offload(size: str, batch: int, seq: int, steps: int, param_dtype: str) -> dict[str, Any]:
    """NOT RUN in the session that wrote it (no GPU there): FSDP2 with CPUOffloadPolicy on one GPU."""
    import torch.distributed as dist
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    if not dist.is_initialized():
        dist.init_process_group("nccl", rank=0, world_size=1)
    device = torch.device("cuda", torch.cuda.current_device())
    # FSDP2 keeps the sharded parameters, gradients and optimizer state in the parameters' dtype on the
    # host: fp32 is the like-for-like baseline (fp32 master) but needs ~16 bytes/parameter of host RAM
    # (112 GB for 7B); bf16 halves that at the cost of bf16 optimizer state.
    model = _cuda_model(size, seq)
    if param_dtype == "fp32":
        model = model.float()
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    offload = CPUOffloadPolicy(pin_memory=True)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=mp, offload_policy=offload)
    fully_shard(model, mp_policy=mp, offload_policy=offload)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.1)  # steps on the host shards
    x = torch.randint(0, CUDA_MODELS[size][4], (batch, seq), device=device)

    def one() -> None:
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()

    one()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        one()
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    out = {
        "model": f"llama-{size}",
        "batch": batch,
        "seq": seq,
        "steps": steps,
        "param_dtype": param_dtype,
        "tokens_per_s": batch * seq * steps / elapsed,
        "iteration_s": elapsed / steps,
        "peak_device_allocated_bytes": torch.cuda.max_memory_allocated(device),
    }
    dist.destroy_process_group()
    return out


# ---------------------------------------------------------------------------------------------- main
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--opt-layers", type=int, default=4)
    ap.add_argument("--opt-hidden", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=7, help="interleaved timing rounds (median reported)")
    ap.add_argument("--cuda-model", choices=sorted(CUDA_MODELS), default="7b")
    ap.add_argument("--cuda-batch", type=int, default=1)
    ap.add_argument("--cuda-seq", type=int, default=2048)
    ap.add_argument("--cuda-steps", type=int, default=5)
    ap.add_argument("--chunk-mib", type=int, default=256)
    ap.add_argument("--activation-reserve-gib", type=float, default=16.0)
    ap.add_argument("--skip-fsdp2", action="store_true")
    ap.add_argument("--fsdp2-param-dtype", choices=["fp32", "bf16"], default="fp32")
    args = ap.parse_args()

    results: dict[str, Any] = {
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cpu_threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        },
    }
    print("host optimizer (AdamW, parameters/s) ...", flush=True)
    results["host_optimizer"] = r = bench_host_optimizer(args.opt_layers, args.opt_hidden, args.rounds)
    print(
        f"  {r['parameters'] / 1e6:.1f} M parameters: single-tensor {r['torch_single_tensor_params_per_s'] / 1e6:.1f} M/s, "
        f"foreach {r['torch_foreach_params_per_s'] / 1e6:.1f} M/s, fused {r['torch_fused_params_per_s'] / 1e6:.1f} M/s, "
        f"runtime host path ({'/'.join(r['runtime_host_impl'])}, {r['chunks']} chunks) "
        f"{r['runtime_host_params_per_s'] / 1e6:.1f} M/s = {r['speedup_runtime_vs_single_tensor']:.1f}x single-tensor "
        f"(target 5x: {'met' if r['target_5x_met'] else 'MISSED'})"
    )
    print("CPU training (tokens/s) ...", flush=True)
    results["cpu_training"] = t = bench_cpu_training(args.rounds)
    print(
        "  "
        + ", ".join(
            f"{k.removesuffix('_tokens_per_s')} {v:.0f}" for k, v in t.items() if k.endswith("tokens_per_s")
        )
    )
    if torch.cuda.is_available():
        print(f"CUDA training llama-{args.cuda_model} with offload ...", flush=True)
        results["cuda_training"] = c = bench_cuda_training(
            args.cuda_model,
            args.cuda_batch,
            args.cuda_seq,
            args.cuda_steps,
            args.chunk_mib,
            args.activation_reserve_gib,
        )
        gc.collect()
        torch.cuda.empty_cache()
        print(f"  {c['tokens_per_s']:.0f} tokens/s, upload hidden {c['upload_hidden_fraction']}")
        if not args.skip_fsdp2:
            print("FSDP2 CPUOffloadPolicy ...", flush=True)
            results["fsdp2_offload"] = f = bench_fsdp2_offload(
                args.cuda_model, args.cuda_batch, args.cuda_seq, args.cuda_steps, args.fsdp2_param_dtype
            )
            print(f"  {f['tokens_per_s']:.0f} tokens/s")
    else:
        results["cuda_training"] = "not run: no CUDA device"
        print("CUDA parts: not run (no CUDA device)")
    save(RESULTS, results)


if __name__ == "__main__":
    main()
