"""What every benchmark result records about the machine it ran on, and how the result is saved."""

from __future__ import annotations

import json
import os
import platform
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
