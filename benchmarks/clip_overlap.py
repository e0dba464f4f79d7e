"""Benchmark: what clipping costs the overlap of the host optimizer with backward (issue 16, defect 3).

    .venv/bin/python benchmarks/clip_overlap.py                       # CPU (and the GPU when present)
    .venv/bin/python benchmarks/clip_overlap.py --layers 8 --hidden 512 --rounds 15

A llama from config with every chunk offloaded (2 device buffers), AdamW, trained through `agent.wrap` with
a hand-built plan, each variant timed in interleaved rounds (median seconds per iteration):
  no_clip          default options (host steps speculated during backward, undo backups kept), no clipping
  clip_inactive    default options, torch's clip_grad_norm_ with a max_norm above the norm: the coefficient
                   is 1.0, the gradients are unchanged, every speculative step is kept (nothing redone)
  clip_active      default options, a max_norm below the norm: every chunk is restored and stepped again
                   at optimizer.step() (the worst case: clipping scales every step)
  no_backup        undo_host_steps=False, no clipping: speculation without the backup copies
  deferred_clip    overlap_host_step=False, clipping active: every host step at optimizer.step() (the only
                   way to clip before speculation)
  deferred_no_clip overlap_host_step=False, no clipping
Derived figures: host optimizer seconds per iteration (runtime counters), host time hidden under backward
(deferred_no_clip - no_clip: positive when overlapped host steps run beside backward; on a CPU device the
worker runs inline, so nothing can hide and this measures the speculation's bookkeeping), backup cost
(no_clip - no_backup), redo cost (clip_active - clip_inactive). Printed and saved to
benchmarks/results/clip_overlap.json. Take figures on a quiet machine.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks._results import Run, save

RESULTS = Path(__file__).resolve().parent / "results" / "clip_overlap.json"

VARIANTS: dict[str, tuple[dict[str, bool], float | None]] = {
    # name: (RuntimeOptions fields, clip max_norm: None = no clipping)
    "no_clip": ({}, None),
    "clip_inactive": ({}, 1e9),
    "clip_active": ({}, 1e-4),
    "no_backup": ({"undo_host_steps": False}, None),
    "deferred_clip": ({"overlap_host_step": False}, 1e-4),
    "deferred_no_clip": ({"overlap_host_step": False}, None),
}


def _job(
    args: argparse.Namespace, device: torch.device, fields: dict[str, bool], max_norm: float | None
) -> tuple[Callable[[], None], Any]:
    from agent.runtime import RuntimeOptions, manual_plan
    from agent.testing.model_zoo import build
    from agent.wrapping import wrap

    model, _ = build("llama", layers=args.layers, hidden=args.hidden, vocab=args.vocab, seq=args.seq, seed=0)
    model = model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    plan = manual_plan(model, chunk_size_bytes=args.chunk_mib << 20, offload="all", n_buffers=2)
    w = wrap(model, opt, plan=plan, options=RuntimeOptions(device=device, **fields), feedback_steps=None)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g).to(device)

    def step() -> None:
        w.model(input_ids=x, labels=x).loss.backward()
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(w.model.parameters(), max_norm)
        w.optimizer.step()
        w.optimizer.zero_grad()
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    return step, w


def bench(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    jobs = {name: _job(args, device, fields, norm) for name, (fields, norm) in VARIANTS.items()}
    for step, _ in jobs.values():  # warm-up: state allocation, recorded access order, learned accumulation
        step()
        step()
    before = {
        name: (
            w.runtime.counters.host_step_s,
            w.runtime.counters.host_steps,
            w.runtime.counters.speculative_steps,
            w.runtime.counters.host_step_redos,
        )
        for name, (_, w) in jobs.items()
    }
    from agent.runtime import timing

    # seconds inside optimizer.step() (the runtime's STEP section): the validation of the speculative steps,
    # the redo submissions and, where the host worker is a thread, the wait for the last host steps
    in_step = dict.fromkeys(jobs, 0.0)

    def listener(name: str) -> Callable[[str, float, int], None]:
        def listen(section: str, seconds: float, depth: int) -> None:
            if section == timing.STEP and depth == 0:
                in_step[name] += seconds

        return listen

    handles = [w.runtime.timing.add_listener(listener(name)) for name, (_, w) in jobs.items()]
    times: dict[str, list[float]] = {name: [] for name in jobs}
    for _ in range(args.rounds):
        for name, (step, _) in jobs.items():
            t0 = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - t0)
    for h in handles:
        h.remove()
    out: dict[str, Any] = {"variants": {}}
    for name, (_, w) in jobs.items():
        c = w.runtime.counters
        s0, n0, sp0, r0 = before[name]
        out["variants"][name] = {
            "iteration_s": statistics.median(times[name]),
            "step_s_per_iteration": in_step[name] / args.rounds,
            "host_step_s_per_iteration": (c.host_step_s - s0) / args.rounds,
            "host_steps_per_iteration": (c.host_steps - n0) / args.rounds,
            "speculative_steps_per_iteration": (c.speculative_steps - sp0) / args.rounds,
            "redos_per_iteration": (c.host_step_redos - r0) / args.rounds,
            "host_bytes": w.runtime.memory_report().host_bytes,
        }
    v = {k: d["iteration_s"] for k, d in out["variants"].items()}
    out["derived"] = {
        "host_hidden_under_backward_s": v["deferred_no_clip"] - v["no_clip"],
        "backup_cost_s": v["no_clip"] - v["no_backup"],
        "redo_cost_s": v["clip_active"] - v["clip_inactive"],
        "clip_inactive_vs_deferred_clip_s": v["deferred_clip"] - v["clip_inactive"],
        "undo_backup_host_bytes": out["variants"]["no_clip"]["host_bytes"]
        - out["variants"]["no_backup"]["host_bytes"],
    }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--vocab", type=int, default=1000)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--chunk-mib", type=int, default=2)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    run = Run("clip_overlap", args)
    devices = [torch.device("cpu")] + ([torch.device("cuda", 0)] if torch.cuda.is_available() else [])
    results = {}
    for device in devices:
        r = bench(args, device)
        results[device.type] = r
        print(f"{device.type}: median seconds per iteration")
        for name, d in r["variants"].items():
            print(
                f"  {name:17s} {d['iteration_s'] * 1e3:9.2f} ms   host steps {d['host_step_s_per_iteration'] * 1e3:7.2f} ms"
                f"   step() {d['step_s_per_iteration'] * 1e3:7.2f} ms"
                f"   speculative {d['speculative_steps_per_iteration']:.0f}   redone {d['redos_per_iteration']:.0f}"
            )
        for name, val in r["derived"].items():
            print(f"  {name:33s} {val * 1e3:9.2f} ms" if name.endswith("_s") else f"  {name:33s} {val}")
    save(args.out, run.document(devices[-1], results=results))


if __name__ == "__main__":
    main()
