"""The model's Hugging Face config as a trace records it (`ModelInfo.config`), or None.

With it the planner service can price the trace's blocks (FLOPs and bytes of every operation, from the
architecture) and fit a hardware's efficiency factors to the trace whatever model a what-if later asks about
(planner_service/whatif/calibrate.py). Recording it is best effort: a model without a Hugging Face config, or
one whose config does not serialise to plain JSON within the contract's limits, records none, and profiling goes
on (the trace then calibrates only what-ifs of the same model).
"""

from __future__ import annotations

import json
import math
from typing import Any

from torch import nn

from client.contract.common import MAX_MODEL_CONFIG_KEYS


def _plain(value: Any) -> bool:
    """No NaN or infinity (the contract refuses them), no NUL in a string."""
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, str):
        return "\x00" not in value
    if isinstance(value, dict):
        return all(_plain(k) and _plain(v) for k, v in value.items())
    if isinstance(value, list):
        return all(_plain(v) for v in value)
    return True


def hf_config(model: nn.Module) -> dict[str, Any] | None:
    """`model.config` as the JSON of its `config.json` (every field, `model_type` included), or None."""
    config = getattr(model, "config", None)
    to_json = getattr(config, "to_json_string", None)
    if not callable(to_json):
        return None
    try:
        data = json.loads(to_json(use_diff=False))
    except (TypeError, ValueError):  # a field that is not JSON: record nothing rather than fail the profile
        return None
    if not isinstance(data, dict) or not isinstance(data.get("model_type"), str) or not data["model_type"]:
        return None
    if len(data) > MAX_MODEL_CONFIG_KEYS or not _plain(data):
        return None
    return data
