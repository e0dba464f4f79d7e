"""Benchmark: how long a what-if answer for Llama-2-7B takes, without building the model in memory.

Target (issue 21): a 7B what-if answer under 5 s on 2 cores. Two figures, each the median of `--repeat` runs:
- `cli`: the whole command a user runs, `memplan whatif --config llama-2-7b/config.json --hardware KEY
  --batch 1 --seq 4096 --json`, in a fresh process (interpreter start and the torch/transformers imports
  included): wall seconds and the child's CPU seconds (user + system; on a shared machine CPU seconds are
  what the run costs on idle cores);
- `answer`: in this process, after the imports: config -> fake-tensor iteration (4 blocks run, the rest
  extrapolated) -> modelled trace -> solve -> answer, wall and CPU seconds.
The process's peak RSS is recorded too: a 7B bf16 model would need 13.5 GB just for its weights.

Usage: .venv/bin/python benchmarks/whatif.py [--repeat 3] [--hardware a100-80gb-sxm]
Prints a table and writes benchmarks/results/whatif.json.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._results import Run, save  # noqa: E402
from planner_service.whatif.known_configs import LLAMA_2_7B  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "whatif.json"


def cli_run(config: Path, hardware: str) -> tuple[float, float, int, dict[str, object]]:
    """Wall s, CPU s and peak RSS (bytes) of one `memplan whatif` process, and its JSON answer."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "memplan",
            "whatif",
            "--config",
            str(config),
            "--hardware",
            hardware,
            "--batch",
            "1",
            "--seq",
            "4096",
            "--json",
        ],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")},
    )
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, int(after.ru_maxrss) * 1024, json.loads(out.stdout)


def in_process(config: Path, hardware: str) -> tuple[float, float, dict[str, object]]:
    from planner_service.whatif.answer import answer
    from planner_service.whatif.architecture import load_config
    from planner_service.whatif.catalog import load_catalog
    from planner_service.whatif.modelled_trace import ModelledWorkload, iterate, trace_on

    entry = load_catalog()[hardware]
    t0, c0 = time.perf_counter(), time.process_time()
    cfg = load_config(config)
    a = answer(trace_on(iterate(cfg, ModelledWorkload(1, 4096, "bf16")), entry), entry)
    return time.perf_counter() - t0, time.process_time() - c0, a.to_json()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--hardware", default="a100-80gb-sxm")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    run = Run("whatif", args)
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "config.json"
        config.write_text(json.dumps(LLAMA_2_7B))
        cli = [cli_run(config, args.hardware) for _ in range(args.repeat)]
        import transformers  # noqa: F401

        import planner_service.whatif.modelled_trace  # noqa: F401  (imports outside the timed part)

        inproc = [in_process(config, args.hardware) for _ in range(args.repeat)]
    answer = cli[-1][3]
    doc = run.document(
        model="Llama-2-7B (config only)",
        hardware=args.hardware,
        batch=1,
        seq=4096,
        dtype="bf16",
        cli_wall_s=[c[0] for c in cli],
        cli_cpu_s=[c[1] for c in cli],
        cli_wall_median_s=statistics.median(c[0] for c in cli),
        cli_cpu_median_s=statistics.median(c[1] for c in cli),
        cli_peak_rss_bytes=max(c[2] for c in cli),
        answer_wall_s=[r[0] for r in inproc],
        answer_cpu_s=[r[1] for r in inproc],
        answer_wall_median_s=statistics.median(r[0] for r in inproc),
        answer_cpu_median_s=statistics.median(r[1] for r in inproc),
        target_s=5.0,
        answer=answer,
    )
    print(f"Llama-2-7B what-if on {args.hardware} (batch 1, seq 4096, bf16), median of {args.repeat}:")
    print(
        f"  memplan whatif (fresh process): wall {doc['cli_wall_median_s']:.2f} s, CPU {doc['cli_cpu_median_s']:.2f} s,"
        f" peak RSS {doc['cli_peak_rss_bytes'] / 2**30:.2f} GiB"
    )
    print(
        f"  answer after imports:           wall {doc['answer_wall_median_s']:.2f} s, CPU {doc['answer_cpu_median_s']:.2f} s"
    )
    print(
        f"  fits {answer['fits']}, iteration {answer['iteration_s']:.3f} s, {answer['tokens_per_s']:,.0f} tokens/s"
        f" (target: under 5 s; load average {doc['load_average_before']} -> {doc['load_average_after']})"
    )
    save(args.out, doc)


if __name__ == "__main__":
    main()
