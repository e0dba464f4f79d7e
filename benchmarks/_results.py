"""What every benchmark result records about the machine it ran on, and how the result is saved."""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import Any


def machine(device: Any = None) -> dict[str, Any]:
    """CPU model, cores, platform, torch version and the device (with the GPU's name on CUDA)."""
    import torch

    from agent.profiler.hardware import cpu_model_name

    device = torch.device(device or "cpu")
    return {
        "cpu": cpu_model_name(),
        "cores": os.cpu_count(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
    }


# the agent's switches that change what a run measures, recorded as set (None: unset, the default); the other
# MEMPLAN_* variables (server, token, paths) change where results go, not what they are, and a token must not be
# saved in a result file
MEASURING_SWITCHES = ("MEMPLAN_WHOLE_MODEL_PROBE",)


def switches() -> dict[str, str | None]:
    """Each of `MEASURING_SWITCHES` as this run's environment sets it (None: unset, the default)."""
    return {name: os.environ.get(name) for name in MEASURING_SWITCHES}


def stamped(path: Path, when: float | None = None) -> Path:
    """`results/<name>.json` -> `results/<name>-<UTC timestamp>.json`: the file one run writes."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(when))
    return path.with_name(f"{path.stem}-{stamp}{path.suffix}")


def latest(path: Path) -> Path:
    """`results/<name>.json` -> `results/<name>-latest.json`: the pointer to the newest run's file."""
    return path.with_name(f"{path.stem}-latest{path.suffix}")


def save(path: Path, result: dict[str, Any]) -> Path:
    """Save one run's result to its own timestamped file beside `path` (never overwriting a file a document
    may cite) and point `<name>-latest.json` at it; returns the file written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    target = stamped(path)
    with target.open("x") as f:  # "x": an existing file is an error, not overwritten
        f.write(json.dumps(result, indent=2, default=str) + "\n")
    latest(path).write_text(json.dumps({"benchmark": path.stem, "file": target.name}, indent=2) + "\n")
    print(f"wrote {target} (pointed to by {latest(path).name})")
    return target


class Run:
    """A benchmark run, started when made: the result document it saves records the run's arguments, the
    machine, the load average before and after, and the wall time, ahead of the benchmark's own fields."""

    def __init__(self, benchmark: str, args: Any) -> None:
        self.benchmark, self.args = benchmark, args
        self.load_before = os.getloadavg()
        self.t0 = time.perf_counter()

    def document(self, device: Any = None, **fields: Any) -> dict[str, Any]:
        from planner_service.solver import SOLVER_VERSION

        return {
            "benchmark": self.benchmark,
            "solver_version": SOLVER_VERSION,
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(self.args).items()},
            "machine": machine(device),
            "switches": switches(),
            "load_average_before": self.load_before,
            "load_average_after": os.getloadavg(),
            "wall_s": time.perf_counter() - self.t0,
            **fields,
        }
