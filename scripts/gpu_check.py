"""One command for anyone with an NVIDIA GPU: run memplan's CUDA checks and write one report to attach to a bug.

Steps (each a subprocess; a failing step is recorded and the next one still runs):
1. environment: nvidia-smi, torch and CUDA versions, the GPU torch sees;
2. `scripts/check_cuda_build.sh`: the planned allocator's CUDA backend compiles with -Werror;
3. the CUDA-relevant tests: tests/agent/gpu (Hugging Face models trained through `agent.wrap` on the GPU against
   plain PyTorch on the same GPU, and the planned CUDA allocator; each prints a `GPU-FIGURE` line),
   tests/agent/allocator, tests/agent/runtime (with its cuda_semantics and activations) (on a GPU machine the
   CUDA-only tests run instead of skipping);
4. `benchmarks/predict_vs_measure.py --device cuda:N` (plan predictions against measurements);
5. `benchmarks/gpu_timeline.py --device cuda:N` (where a wrapped iteration's time goes: GPU busy and idle time
   per phase, the CPU operations with the most self time);
6. `benchmarks/train_throughput.py --device cuda:N` (memplan against FSDP2 CPU offload and ProTrain,
   a ~1B llama at seq 1024 in bf16 by default; `--quick` for a small model), then again with `--bf16-states`
   (memplan stepping bf16 states as FSDP2's rows do: the comparison at equal arithmetic);
7. `benchmarks/copy_bandwidth.py --device cuda:N` (the hardware probe's H2D and D2H rates, each alone and
   both at once, timed with CUDA events).

The report is `<out>/gpu_check.json` and `<out>/gpu_check.md`: per step the command, exit status, seconds
and the tail of its output, plus the benchmarks' result files copied next to it.

    scripts/gpu_check.sh [--out DIR] [--device cuda:0] [--quick] [--dry-run]

`--dry-run` prints the steps and writes nothing (it runs anywhere; the real run needs a GPU).
First run on a GPU in session 17 (one H200, docs/BENCHMARKS.md "GPU, session 17"), step by step.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TAIL = 6000


@dataclass
class Step:
    name: str
    command: list[str]
    timeout_s: int = 3600
    results: list[str] = field(
        default_factory=list
    )  # result files (relative to ROOT) to copy into the report


@dataclass
class Outcome:
    name: str
    command: str
    returncode: int | None
    seconds: float
    output_tail: str
    copied: list[str]


def steps(device: str, quick: bool, python: str) -> list[Step]:
    """What a check runs, in order."""
    env_probe = (
        "import torch, json; d = torch.device('" + device + "'); ok = torch.cuda.is_available(); "
        "print(json.dumps({'torch': torch.__version__, 'cuda': torch.version.cuda, 'available': ok, "
        "'gpu': torch.cuda.get_device_name(d) if ok else None, "
        "'memory_bytes': torch.cuda.get_device_properties(d).total_memory if ok else None}))"
    )
    size = (
        ["--layers", "4", "--hidden", "256", "--seq", "256", "--batch", "2"]
        if quick
        else ["--layers", "16", "--hidden", "2048", "--seq", "1024", "--batch", "4", "--dtype", "bf16"]
    )
    pvm = (
        ["--kinds", "llama", "--layers", "4", "--hidden", "256", "--seq", "256"]
        if quick
        else ["--kinds", "gpt2", "llama", "--layers", "12", "24", "--hidden", "1024", "--seq", "512"]
    )
    timeline = (
        ["--kind", "llama", "--layers", "4", "--hidden", "256", "--seq", "256", "--batch", "2"]
        if quick
        else ["--kind", "llama", "--layers", "8", "--hidden", "1024", "--seq", "512", "--batch", "4"]
    )
    return [
        Step("nvidia-smi", ["nvidia-smi"], timeout_s=60),
        Step("torch", [python, "-c", env_probe], timeout_s=120),
        Step("check_cuda_build", ["bash", "scripts/check_cuda_build.sh"], timeout_s=900),
        Step(
            "cuda_tests",
            [
                python,
                "-m",
                "pytest",
                "-q",
                "-p",
                "no:cacheprovider",
                "tests/agent/gpu",
                "tests/agent/allocator",
                "tests/agent/runtime",
                "-rs",
                "-s",
            ],
            timeout_s=3600,
        ),
        Step(
            "predict_vs_measure",
            [python, "benchmarks/predict_vs_measure.py", "--device", device, *pvm],
            timeout_s=7200,
            results=["benchmarks/results/predict_vs_measure-latest.json"],
        ),
        Step(
            "gpu_timeline",
            [python, "benchmarks/gpu_timeline.py", "--device", device, *timeline],
            timeout_s=1800,
            results=["benchmarks/results/gpu_timeline-latest.json"],
        ),
        Step(
            "train_throughput",
            [python, "benchmarks/train_throughput.py", "--device", device, *size],
            timeout_s=7200,
            results=["benchmarks/results/train_throughput-latest.json"],
        ),
        Step(
            "train_throughput_bf16_states",
            [python, "benchmarks/train_throughput.py", "--device", device, *size, "--bf16-states"],
            timeout_s=7200,
            results=["benchmarks/results/train_throughput-latest.json"],
        ),
        Step(
            "copy_bandwidth",
            [python, "benchmarks/copy_bandwidth.py", "--device", device, "--rounds", "1" if quick else "3"],
            timeout_s=900,
            results=["benchmarks/results/copy_bandwidth-latest.json"],
        ),
    ]


def run_step(step: Step, out: Path) -> Outcome:
    t0 = time.perf_counter()
    if shutil.which(step.command[0]) is None and not Path(step.command[0]).exists():
        return Outcome(step.name, " ".join(step.command), None, 0.0, f"{step.command[0]}: not found", [])
    try:
        done = subprocess.run(step.command, cwd=ROOT, capture_output=True, text=True, timeout=step.timeout_s)
        code, text = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as exc:
        code = None
        text = f"timed out after {step.timeout_s} s\n{(exc.stdout or b'')[-TAIL:]!r}"
    copied = []
    for rel in step.results:
        pointer = ROOT / rel
        if pointer.is_file():
            target = pointer.parent / json.loads(pointer.read_text()).get("file", pointer.name)
            if target.is_file():
                shutil.copy2(target, out / target.name)
                copied.append(target.name)
    return Outcome(step.name, " ".join(step.command), code, time.perf_counter() - t0, text[-TAIL:], copied)


def markdown(outcomes: list[Outcome], meta: dict[str, str]) -> str:
    lines = [
        "# memplan GPU check",
        "",
        *(f"- {k}: {v}" for k, v in meta.items()),
        "",
        "| step | exit | seconds | result files |",
        "|---|---|---|---|",
    ]
    for o in outcomes:
        status = "not run" if o.returncode is None else str(o.returncode)
        lines.append(f"| {o.name} | {status} | {o.seconds:.0f} | {', '.join(o.copied) or '-'} |")
    for o in outcomes:
        lines += ["", f"## {o.name}", "", f"`{o.command}`", "", "```", o.output_tail.rstrip(), "```"]
    return "\n".join(lines) + "\n"


def write_report(outcomes: list[Outcome], out: Path, meta: dict[str, str]) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    js, md = out / "gpu_check.json", out / "gpu_check.md"
    js.write_text(json.dumps({"meta": meta, "steps": [asdict(o) for o in outcomes]}, indent=2) + "\n")
    md.write_text(markdown(outcomes, meta))
    return js, md


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=None, help="report folder (default: gpu-check-<UTC time>)")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument(
        "--quick", action="store_true", help="small benchmark models (minutes instead of an hour)"
    )
    ap.add_argument("--dry-run", action="store_true", help="print the steps, run nothing")
    ap.add_argument("--python", default=sys.executable)
    args = ap.parse_args(argv)
    plan = steps(args.device, args.quick, args.python)
    if args.dry_run:
        for s in plan:
            print(f"{s.name}: {' '.join(s.command)}")
        return 0
    out = (args.out or ROOT / f"gpu-check-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    meta = {
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": platform.node(),
        "platform": platform.platform(),
        "device": args.device,
        "quick": str(args.quick),
    }
    outcomes = []
    for s in plan:
        print(f"[gpu_check] {s.name} ...", flush=True)
        outcomes.append(run_step(s, out))
        print(
            f"[gpu_check] {s.name}: exit {outcomes[-1].returncode} in {outcomes[-1].seconds:.0f} s",
            flush=True,
        )
    js, md = write_report(outcomes, out, meta)
    print(f"[gpu_check] report: {md} and {js}; attach the folder {out} to the bug report")
    return 0 if all(o.returncode == 0 for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
