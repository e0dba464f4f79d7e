"""On a real GPU: the README's `agent.wrap` on Hugging Face models at their library defaults trains like plain
PyTorch on the same GPU, under a device limit that makes the planner offload chunks, and within its predicted peak.

CUDA-only (skipped without a GPU; `tests/conftest.py` allows that skip in CI). `scripts/gpu_check.sh` runs this
file. Everything the CPU suite checks of CUDA ordering (streams, events, pinned memory) is checked on the CPU by
`tests/agent/runtime/cuda_semantics`; this file is where those paths run for real.

Each test prints one line `GPU-FIGURE {...}` (losses' largest relative difference from plain PyTorch on the same
GPU, measured and predicted peak, iteration time measured and predicted) for the report.
"""

from __future__ import annotations

import copy
import gc
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from agent.testing.loops import train_with_clipping, uploads_in_one_step
from agent.testing.model_zoo import build_with_library_defaults, sample_batch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA-only: trains on a real GPU")

REPO = Path(__file__).resolve().parents[3]
STEPS = 6
TOL = 1e-5
LIMIT_FRACTION = 0.7  # of the un-managed peak: the model's states no longer all fit
SIZE = {"layers": 4, "hidden": 256, "vocab": 4096, "seq": 128}
BATCH = (4, 128)


@pytest.fixture(autouse=True)
def exact_fp32() -> Any:
    """fp32 without TF32, so both sides run the same arithmetic (TF32 would make 1e-5 a matter of luck)."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)


def allocated_now(device: torch.device) -> int:
    """Bytes allocated on `device` once Python's garbage (models with reference cycles) is collected."""
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    return int(torch.cuda.memory_allocated(device))


def figure(name: str, **values: Any) -> None:
    print(f"GPU-FIGURE {json.dumps({'test': name, **values})}", flush=True)


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen2"])
def test_wrap_on_cuda_trains_offloaded_like_plain_pytorch(family: str) -> None:
    train_and_compare(family, torch.float32, TOL)


def test_bf16_model_peaks_within_its_prediction_with_the_loss_in_fp32() -> None:
    """A bf16 model: Hugging Face's loss casts the logits to fp32 (`ForCausalLMLoss`), outside every block; a
    fp32 model's cast is a no-op, so only a narrower dtype shows whether the profile counts it. Session 17's bf16
    llama (h2048, seq 1024, vocab 32000) peaked 485 MiB (about the fp32 logits) over its prediction on an H200,
    while the fp32 rows were within 1.1%; this is the check for it. bf16 parameters and moments without an fp32
    master (`fp32_master=False`: the arithmetic of plain PyTorch's bf16 step). On the CPU the same run's losses
    equal plain PyTorch's exactly; 1e-3 leaves room for the norm's summation order on the GPU. Not yet run on a
    GPU (written after session 18's device time was spent)."""
    train_and_compare("llama", torch.bfloat16, 1e-3)


def train_and_compare(family: str, dtype: torch.dtype, tol: float) -> None:
    """`family` at its library defaults in `dtype`, trained by plain PyTorch and through `agent.wrap` on cuda:0
    under 0.7 of the un-managed peak: losses within `tol`, uploads = the plan's, peak within 2% of the plan's."""
    import agent
    from agent.runtime import RuntimeOptions

    device = torch.device("cuda", 0)
    model, config = build_with_library_defaults(family, **SIZE)
    model = model.to(dtype)
    name = family if dtype == torch.float32 else f"{family}-{str(dtype).removeprefix('torch.')}"
    options = RuntimeOptions(device=device, fp32_master=dtype == torch.float32)
    batch = sample_batch(config, *BATCH, device=device)
    batch_bytes = sum(t.numel() * t.element_size() for t in batch.values())

    reference = copy.deepcopy(model).to(device)
    expected = train_with_clipping(reference, adamw(reference), batch, steps=STEPS)
    del reference
    # what is not this job's: earlier tests' leftovers, and the per-process workspaces the first matmuls of the
    # process allocate (cuBLAS's), which the plan's peak does not count. Measured before the reference's training
    # instead, gpt2 (the first test of the process) read 71 MB over its prediction on an H200 while llama and
    # qwen2 after it were within 1.6%: the workspaces are the likely difference (not yet confirmed on a GPU)
    foreign = allocated_now(device) - batch_bytes
    probe = copy.deepcopy(model).to(device)
    peak = agent.profile(probe, batch, optimizer=adamw(probe), repeats=1).measurements.peak_device_bytes
    del probe
    model.to(device)  # the user's model is on the GPU before wrap, as in the README

    wrapped = agent.wrap(
        model,
        adamw(model),
        sample_batch=batch,
        device_memory=int(peak * LIMIT_FRACTION),
        feedback_steps=None,
        options=options,
    )
    policy = wrapped.plan.policy
    predictions = wrapped.plan.predictions
    assert policy is not None and predictions is not None
    assert any(c.placement.value == "offloaded" for c in policy.chunks), policy.chunks

    # the plan's peak is the job's device memory in training (its chunks, buffers, activations, transients):
    # measured from the steps' window, less the bytes of earlier tests and of the batch
    at_start = allocated_now(device) - foreign - batch_bytes
    torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    got = train_with_clipping(wrapped.model, wrapped.optimizer, batch, steps=STEPS)
    torch.cuda.synchronize(device)
    seconds = (time.perf_counter() - t0) / STEPS
    measured_peak = torch.cuda.max_memory_allocated(device) - foreign - batch_bytes
    uploads = uploads_in_one_step(wrapped, batch)
    worst = max(rel(a, b) for a, b in zip(got, expected, strict=True))
    figure(
        f"wrap-{name}",
        loss_max_rel_diff=worst,
        peak_measured=measured_peak,
        device_bytes_at_start=at_start,
        peak_predicted=predictions.peak_device_bytes,
        device_limit=int(peak * LIMIT_FRACTION),
        iteration_s_measured_incl_first_steps=seconds,
        iteration_s_predicted=predictions.iteration_s,
        uploads=uploads,
        uploads_predicted=predictions.breakdown.get("uploads_per_iteration"),
        offloaded=sum(c.placement.value == "offloaded" for c in policy.chunks),
        chunks=len(policy.chunks),
    )
    for step, (a, b) in enumerate(zip(got, expected, strict=True)):
        assert abs(a - b) <= tol * abs(b), f"{name} step {step}: loss {a} vs plain {b}"
    assert uploads == predictions.breakdown["uploads_per_iteration"]
    assert measured_peak <= predictions.peak_device_bytes * 1.02, (
        measured_peak,
        predictions.peak_device_bytes,
    )
    agent.unwrap(wrapped)


CHILD = textwrap.dedent(
    """
    import json, sys, torch
    import agent
    from agent.testing.loops import train_with_clipping
    from agent.testing.model_zoo import build_with_library_defaults, sample_batch
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    size, batch_shape, steps, limit = json.loads(sys.argv[1])
    model, config = build_with_library_defaults("llama", **size)
    batch = sample_batch(config, *batch_shape)  # on the CPU: nothing has touched CUDA before wrap
    assert not torch.cuda.is_initialized()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    wrapped = agent.wrap(model, opt, sample_batch=batch, device_memory=limit, allocation="planned",
                         feedback_steps=None)
    device = next(p.device for p in wrapped.model.parameters() if p.device.type == "cuda")
    gpu_batch = {k: v.to(device) for k, v in batch.items()}
    losses = train_with_clipping(wrapped.model, wrapped.optimizer, gpu_batch, steps=steps)
    backend = torch.cuda.memory.get_allocator_backend() if hasattr(torch.cuda.memory, "get_allocator_backend") else "?"
    print("CHILD-RESULT " + json.dumps({"losses": losses, "allocator": str(backend),
          "peak_predicted": wrapped.plan.predictions.peak_device_bytes}))
    """
)


def test_planned_allocator_on_cuda_trains_like_plain_pytorch() -> None:
    """`allocation="planned"` with nothing on CUDA yet: wrap plans, installs the planned CUDA allocator before
    CUDA starts, and the job trains with it (a fresh process: an allocator is per process)."""
    device = torch.device("cuda", 0)
    model, config = build_with_library_defaults("llama", **SIZE)
    batch = sample_batch(config, *BATCH)
    import agent

    probe = copy.deepcopy(model).to(device)
    gpu_batch = {k: v.to(device) for k, v in batch.items()}
    peak = agent.profile(probe, gpu_batch, optimizer=adamw(probe), repeats=1).measurements.peak_device_bytes
    reference = copy.deepcopy(model).to(device)
    expected = train_with_clipping(reference, adamw(reference), gpu_batch, steps=STEPS)
    limit = int(peak * LIMIT_FRACTION)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps([SIZE, list(BATCH), STEPS, limit])],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-8000:]
    line = next(ln for ln in done.stdout.splitlines() if ln.startswith("CHILD-RESULT "))
    result = json.loads(line.removeprefix("CHILD-RESULT "))
    worst = max(rel(a, b) for a, b in zip(result["losses"], expected, strict=True))
    figure("planned-allocator-llama", loss_max_rel_diff=worst, allocator=result["allocator"], limit=limit)
    assert worst <= TOL, (result["losses"], expected)
