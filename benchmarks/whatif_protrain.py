"""Benchmark: the largest trainable model and its tokens/s on ProTrain's two single-GPU set-ups, by what-if.

Set-ups (ProTrain, arXiv 2406.08334): one RTX 3090 with 384 GiB of host memory, one A100 80GB with 1 TiB.
Models: GPT-2 1.5B and Llama sizes 1B-70B, built from their published configs on fake tensors (no weights).
For each (set-up, model): does batch 1 fit, the largest batch that fits (doubling then bisection, up to
`--max-batch`), and tokens/s at each batch tried; the largest trainable model of a set-up is the largest
that fits at batch 1. Everything is modelled and uncalibrated (docs/architecture/whatif.md): memory from
the fake iteration, times from the roofline with estimated efficiency factors.

ProTrain's own figures (and those it gives for FSDP, DeepSpeed and Colossal-AI) are NOT filled in by this
script: the paper's tables could not be read from this project's machines when it was written. Put them
beside this script's output in docs/BENCHMARKS.md by hand, with the paper's table number. Differences to
expect: ProTrain trains in mixed precision (fp16 parameters, fp32 master weights and Adam states: 16 bytes
per parameter of model state), this script by default in pure bf16 (8 bytes per parameter: the precision
the profiler measures); pass `--dtype fp32` for 16 bytes per parameter of state.

Usage: .venv/bin/python benchmarks/whatif_protrain.py [--seq 1024] [--dtype bf16] [--models gpt2-1.5b,llama-7b]
Prints a table and writes benchmarks/results/whatif_protrain.json.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._results import Run, save  # noqa: E402

GiB = 2**30
RESULTS = Path(__file__).resolve().parent / "results" / "whatif_protrain.json"
SETUPS = {
    "rtx-3090 + 384 GiB": ("rtx-3090", 384 * GiB),
    "a100-80gb-sxm + 1 TiB": ("a100-80gb-sxm", 1024 * GiB),
}
# Published architecture configs (Hugging Face model cards); only the sizes that matter for memory and FLOPs.
MODELS: dict[str, dict[str, Any]] = {
    "gpt2-1.5b": {
        "model_type": "gpt2",
        "n_embd": 1600,
        "n_layer": 48,
        "n_head": 25,
        "vocab_size": 50257,
        "n_positions": 1024,
    },
    "llama-1b": {
        "model_type": "llama",
        "hidden_size": 2048,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 8192,
        "vocab_size": 128256,
        "tie_word_embeddings": True,
        "max_position_embeddings": 4096,
    },
    "llama-7b": {
        "model_type": "llama",
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "intermediate_size": 11008,
        "vocab_size": 32000,
        "max_position_embeddings": 4096,
    },
    "llama-13b": {
        "model_type": "llama",
        "hidden_size": 5120,
        "num_hidden_layers": 40,
        "num_attention_heads": 40,
        "num_key_value_heads": 40,
        "intermediate_size": 13824,
        "vocab_size": 32000,
        "max_position_embeddings": 4096,
    },
    "llama-34b": {
        "model_type": "llama",
        "hidden_size": 8192,
        "num_hidden_layers": 48,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "intermediate_size": 22016,
        "vocab_size": 32000,
        "max_position_embeddings": 4096,
    },
    "llama-70b": {
        "model_type": "llama",
        "hidden_size": 8192,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "intermediate_size": 28672,
        "vocab_size": 32000,
        "max_position_embeddings": 4096,
    },
}


def main() -> None:
    import transformers

    from planner_service.whatif.answer import answer, largest_batch
    from planner_service.whatif.catalog import load_catalog
    from planner_service.whatif.modelled_trace import ModelledWorkload, iterate, trace_on

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--setups", default=",".join(SETUPS))
    ap.add_argument("--max-batch", type=int, default=64)
    ap.add_argument("--time-limit", type=float, default=2.0)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    run = Run("whatif_protrain", args)
    catalog = load_catalog(use_env=False)
    rows: list[dict[str, Any]] = []
    for setup in args.setups.split(","):
        key, host = SETUPS[setup]
        entry = catalog[key]
        for name in args.models.split(","):
            cfg_dict = dict(MODELS[name])
            cfg = transformers.AutoConfig.for_model(cfg_dict.pop("model_type"), **cfg_dict)
            t0 = time.perf_counter()
            iterations: dict[int, Any] = {}

            def at(
                b: int,
                cfg: Any = cfg,
                entry: Any = entry,
                host: int = host,
                iterations: dict[int, Any] = iterations,
            ) -> Any:
                if b not in iterations:
                    iterations[b] = iterate(cfg, ModelledWorkload(b, args.seq, args.dtype))
                return answer(
                    trace_on(iterations[b], entry, host_memory_bytes=host),
                    entry,
                    host_memory_bytes=host,
                    time_limit_s=args.time_limit,
                )

            search = largest_batch(at, limit=args.max_batch)
            best = max((a for a in search.tried if a.fits), key=lambda a: a.tokens_per_s or 0.0, default=None)
            first = search.tried[0]
            params = sum(p.numel for p in next(iter(iterations.values())).record.parameters)
            rows.append(
                {
                    "setup": setup,
                    "model": name,
                    "parameters": params,
                    "fits_batch_1": first.fits,
                    "binding_at_batch_1": first.binding,
                    "largest_batch": search.largest.batch if search.largest else None,
                    "best_tokens_per_s": best.tokens_per_s if best else None,
                    "best_batch": best.batch if best else None,
                    "tried": [
                        {
                            "batch": a.batch,
                            "fits": a.fits,
                            "tokens_per_s": a.tokens_per_s,
                            "binding": a.binding,
                        }
                        for a in search.tried
                    ],
                    "seconds": time.perf_counter() - t0,
                }
            )
            r = rows[-1]
            tps = f"{r['best_tokens_per_s']:,.0f}" if r["best_tokens_per_s"] else "-"
            print(
                f"{setup:24s} {name:10s} {params / 1e9:6.2f}B fits@1 {str(r['fits_batch_1']):5s} "
                f"largest batch {r['largest_batch']!s:4s} best {tps:>8s} tokens/s (batch {r['best_batch']})"
                f" [{r['seconds']:.0f} s]",
                flush=True,
            )
    largest: dict[str, str | None] = {}
    for setup in args.setups.split(","):
        fitting = [r for r in rows if r["setup"] == setup and r["fits_batch_1"]]
        largest[setup] = max(fitting, key=lambda r: r["parameters"])["model"] if fitting else None
        print(f"largest trainable on {setup}: {largest[setup] or 'none'}")
    save(
        args.out,
        run.document(
            rows=rows, largest_trainable=largest, modelled=True, calibrated=False, protrain_paper_figures=None
        ),
    )


if __name__ == "__main__":
    main()
