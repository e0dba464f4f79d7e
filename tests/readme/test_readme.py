"""Every ```python and ```bash block of README.md runs here, as written (no edited copy of the code).

Python blocks run with the names they use (`model`, `optimizer`, `batch`, `loader`) given by a fixture: a
Hugging Face model built from config at its library defaults, its AdamW, a batch and a short loader. Bash
blocks run in a temporary directory whose `.venv` is this interpreter's environment, with a temporary HOME,
against a fresh real PostgreSQL database and a free loopback port; background services they start are
checked (the API answers, a worker solves a plan) and stopped.

Not run, by name (`NOT_RUN`), with the reason: the two set-up commands (`scripts/test.sh` is what runs this
test; `scripts/demo.sh` sets up a virtual environment and is run by tests/memplan/demo). Run elsewhere, by name
(`RUN_ELSEWHERE`): the Trainer block, which needs a `transformers.Trainer` (tests/agent/integrations/
test_readme_trainer.py runs it as written on a real one).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
NOT_RUN = {
    "./scripts/demo.sh": "sets up .venv and trains a demo model; tests/memplan/demo runs the demo itself",
    "./scripts/test.sh": "runs the whole test suite, this test included",
}
RUN_ELSEWHERE = {
    "wrap_trainer(": "tests/agent/integrations/test_readme_trainer.py runs it as written with a real transformers.Trainer",
}
BLOCK = re.compile(r"^```(python|bash)\n(.*?)^```", re.S | re.M)


def blocks(language: str) -> list[str]:
    return [code for lang, code in BLOCK.findall(README.read_text()) if lang == language]


def run_elsewhere(code: str) -> bool:
    return any(marker in code for marker in RUN_ELSEWHERE)


def is_excluded(code: str) -> bool:
    lines = [ln.split("#", 1)[0].strip() for ln in code.splitlines() if ln.split("#", 1)[0].strip()]
    return bool(lines) and all(ln in NOT_RUN for ln in lines)


def test_the_readme_has_the_blocks_this_test_runs() -> None:
    assert len(blocks("python")) >= 1
    assert sum(run_elsewhere(b) for b in blocks("python")) == 1, "only the Trainer block runs in another test"
    assert len(blocks("bash")) >= 2
    assert sum(is_excluded(b) for b in blocks("bash")) == 1, "only the set-up block may be left out"


@pytest.fixture
def names() -> dict[str, Any]:
    """What the README's Python blocks use: a model as users load it (library defaults), its optimizer, one
    batch and a loader of batches."""
    from agent.testing.model_zoo import build_with_library_defaults, sample_batch

    model, config = build_with_library_defaults("llama", layers=2, hidden=64, vocab=256, seq=64)
    batch = sample_batch(config, 2, 32)
    loader = [sample_batch(config, 2, 32, seed=s) for s in range(3)]
    return {
        "model": model,
        "optimizer": torch.optim.AdamW(model.parameters(), lr=1e-3),
        "batch": batch,
        "loader": loader,
    }


@pytest.mark.slow
@pytest.mark.parametrize("index", [i for i, b in enumerate(blocks("python")) if not run_elsewhere(b)])
def test_python_block_runs_as_written(
    index: int, names: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    code = blocks("python")[index]
    namespace = dict(names)
    exec(compile(code, f"README.md python block {index}", "exec"), namespace)  # noqa: S102 - the README's code
    if "agent.wrap(" in code:
        assert namespace["wrapped"].unwrapped is ("agent.unwrap(" in code)
        assert "predicted" in capsys.readouterr().out


def _venv_dir(tmp_path: Path) -> Path:
    """A working directory whose `.venv` is the environment running the tests (the README's `.venv/bin/...`)."""
    work = tmp_path / "checkout"
    work.mkdir()
    (work / ".venv").symlink_to(Path(sys.prefix))
    return work


@pytest.mark.slow
@pytest.mark.postgres
@pytest.mark.parametrize("index", [i for i, b in enumerate(blocks("bash")) if not is_excluded(b)])
def test_bash_block_runs_as_written(index: int, tmp_path: Path, postgres_admin: str) -> None:
    from client.sdk import Client
    from planner_service.embedded import free_port
    from planner_service.solver.testing.synthetic import synthetic_trace
    from tests.conftest import _fresh_postgres

    code = blocks("bash")[index]
    for db_url in _fresh_postgres(postgres_admin):
        port = free_port()
        home = tmp_path / "home"
        home.mkdir()
        env = {
            **os.environ,
            "HOME": str(home),
            "MEMPLAN_DATABASE_URL": db_url,
            "MEMPLAN_PORT": str(port),
            "PATH": f"{Path(sys.prefix) / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
        }
        env.pop("MEMPLAN_SERVER", None)
        proc = subprocess.Popen(
            ["bash", "-e", "-c", code],
            cwd=_venv_dir(tmp_path),
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            rc = proc.wait(timeout=120)
            assert rc == 0, proc.stdout.read() if proc.stdout else ""
            if "serve" in code:
                url = f"http://127.0.0.1:{port}"
                deadline = time.monotonic() + 60
                while True:
                    try:
                        if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                            break
                    except httpx.TransportError:
                        pass
                    assert time.monotonic() < deadline, "the README's `memplan serve` did not become ready"
                    time.sleep(0.3)
            if "worker" in code:  # the README's worker (the API runs --workers 0) solves a plan
                from client.contract import Constraints

                with Client(url) as client:
                    created = client.upload_trace(
                        synthetic_trace(n_blocks=4, hidden=256, vocab=1000, batch=2, seq=128)
                    )
                    record = client.request_plan(
                        created.id, Constraints(device_memory_bytes=8 << 30, time_limit_s=5)
                    )
                    record = client.wait_for_plan(record.id, timeout_s=90, poll_s=1)
                assert record.status == "done", record
        finally:
            try:
                os.killpg(proc.pid, signal.SIGTERM)  # the block's own session: its background services
            except ProcessLookupError:
                pass
            time.sleep(1.0)
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
