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
    return {"cpu": cpu_model_name(), "cores": os.cpu_count(), "platform": platform.platform(),
            "torch": torch.__version__, "device": str(device),
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None}


def save(path: Path, result: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")


class Run:
    """A benchmark run, started when made: the result document it saves records the run's arguments, the
    machine, the load average before and after, and the wall time, ahead of the benchmark's own fields."""

    def __init__(self, benchmark: str, args: Any) -> None:
        self.benchmark, self.args = benchmark, args
        self.load_before = os.getloadavg()
        self.t0 = time.perf_counter()

    def document(self, device: Any = None, **fields: Any) -> dict[str, Any]:
        return {"benchmark": self.benchmark,
                "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(self.args).items()},
                "machine": machine(device), "load_average_before": self.load_before,
                "load_average_after": os.getloadavg(), "wall_s": time.perf_counter() - self.t0, **fields}
