"""Resume: save the wrapped model's and optimizer's state_dict at step k, resume in a new process, and get
the uninterrupted run's losses exactly (default options, clipping active, offloaded and persistent chunks)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import resume_job

pytestmark = pytest.mark.slow
HERE = Path(__file__).parent


@pytest.mark.parametrize("load_before_wrap", [False, True], ids=["load-into-wrapped", "load-then-wrap"])
def test_a_run_resumed_in_a_new_process_continues_with_identical_losses(
    load_before_wrap: bool, tmp_path: Path
) -> None:
    ckpt = tmp_path / "ckpt.pt"
    full = resume_job.run(
        {"checkpoint": str(ckpt), "steps": 6, "save_at": 3, "load_before_wrap": load_before_wrap}
    )
    assert ckpt.exists()
    spec = {"checkpoint": str(ckpt), "steps": 6, "resume": True, "load_before_wrap": load_before_wrap}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, str(HERE / "resume_job.py"), json.dumps(spec)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    resumed = json.loads(proc.stdout.rsplit("RESULT ", 1)[1])
    assert resumed == full[3:]
