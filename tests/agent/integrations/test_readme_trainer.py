"""The README's "Use with Hugging Face Trainer / Accelerate" block runs as written on a real Trainer."""

from __future__ import annotations

import re
from pathlib import Path

import hf_jobs
import pytest

pytestmark = pytest.mark.slow
README = Path(__file__).resolve().parents[3] / "README.md"


def trainer_block() -> str:
    text = README.read_text()
    section = text.split("## Use with Hugging Face Trainer / Accelerate", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match is not None, "README: the Trainer section has no python block"
    return match.group(1)


def test_the_readme_trainer_block_wraps_and_trains(tmp_path: Path) -> None:
    trainer = hf_jobs.trainer("llama", tmp_path, steps=3)
    namespace = {"trainer": trainer, "path": None}  # the variables the block names
    exec(compile(trainer_block(), str(README), "exec"), namespace)  # noqa: S102 - the README's code as written
    wrapped = namespace["wrapped"]
    assert trainer.state.global_step == 3
    assert (
        trainer.optimizer is not None and getattr(trainer.optimizer, "optimizer", None) is wrapped.optimizer
    )
    assert len(hf_jobs.history(trainer)) == 3
