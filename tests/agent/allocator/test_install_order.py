"""`wrap(..., allocation="planned")` on CUDA installs the planned allocator before anything initialises CUDA
(issue 19 defect 3).

No GPU here: `torch.cuda.is_available()` is made to say True, `torch.cuda._lazy_init` (what every CUDA call
that initialises goes through: `current_device`, the first CUDA tensor, the hardware probe) records that it
was called, and the install records the plan it was given and stops `wrap` there (the runtime would next
put chunks on a GPU that does not exist). What runs before the install is the real code: the plan's
managed iteration recorded on a CPU copy, or the whole planning in a real child process.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import agent
from agent.allocator import cuda as cuda_module
from agent.allocator.cuda import AllocatorSwitchError
from agent.allocator.install import install_allocator
from agent.allocator.managed import has_managed_allocation, with_managed_allocation
from agent.runtime import manual_plan
from agent.runtime.options import RuntimeOptions
from agent.testing.model_zoo import build, sample_batch
from agent.wrapping import target_device
from client.contract import Plan


class Installed(Exception):
    """Raised by the stand-in install: the order up to here is what the test checks."""


class CudaObserver:
    def __init__(self, monkeypatch: pytest.MonkeyPatch, *, initialised: bool = False) -> None:
        self.order: list[str] = ["lazy_init"] if initialised else []
        self.installed: dict[str, Any] = {}
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: "lazy_init" in self.order)
        monkeypatch.setattr(torch.cuda, "_lazy_init", self._lazy_init)
        monkeypatch.setattr(cuda_module, "install_cuda_planned_allocator", self._install)
        monkeypatch.setattr(cuda_module, "_installed", None)
        if initialised:  # the job used device 0 before wrap
            monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)

    def _lazy_init(self) -> None:
        self.order.append("lazy_init")
        raise RuntimeError("CUDA initialised (no GPU in this test)")

    def _install(self, plan: Any, events: Any, *, device: int, debug: bool, rules: Any) -> None:
        self.order.append("install")
        self.installed = {"allocation": plan, "events": list(events), "device": device}
        raise Installed


@pytest.fixture(scope="module")
def job() -> tuple[torch.nn.Module, dict[str, torch.Tensor], Plan]:
    model, config = build("llama", 2, 64, vocab=256, seq=32)
    batch = sample_batch(config, 2, 16)
    sizes = [p.numel() * p.element_size() for p in model.parameters()]
    plan = manual_plan(model, chunk_size_bytes=max(max(sizes), sum(sizes) // 4), offload="all", n_buffers=2)
    return model, batch, plan


def adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


def test_a_plan_with_its_managed_allocation_is_installed_before_cuda_is_touched(
    job: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, batch, plan = job
    opt = adamw(model)
    managed = with_managed_allocation(model, opt, plan, batch)
    cuda = CudaObserver(monkeypatch)
    with pytest.raises(Installed):
        agent.wrap(model, opt, plan=managed, sample_batch=batch, allocation="planned", feedback_steps=None)
    assert cuda.order == ["install"]
    assert cuda.installed["device"] == 0
    assert cuda.installed["allocation"].iteration == "managed"
    assert managed.allocation is not None and managed.allocation.events is not None
    assert [e.id for e in cuda.installed["events"]] == [e.id for e in managed.allocation.events.events]
    assert not getattr(model, "_memplan_wrapped", False)
    assert all(p.device.type == "cpu" for p in model.parameters())


def test_a_plan_without_one_gets_its_managed_iteration_recorded_on_the_cpu_first(
    job: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Defect: a given plan has no trace, so `events` was None and select() refused; and a plan's allocation
    placed the un-managed iteration."""
    model, batch, plan = job
    assert plan.allocation is None
    cuda = CudaObserver(monkeypatch)
    with pytest.raises(Installed):
        agent.wrap(
            model, adamw(model), plan=plan, sample_batch=batch, allocation="planned", feedback_steps=None
        )
    assert cuda.order == ["install"]
    allocation = cuda.installed["allocation"]
    assert allocation.iteration == "managed" and allocation.events is not None
    assert len(cuda.installed["events"]) == len(allocation.offsets) > 0


def test_cuda_already_initialised_is_refused_before_any_work(
    job: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, batch, plan = job
    cuda = CudaObserver(monkeypatch, initialised=True)
    recorded: list[bool] = []
    monkeypatch.setattr("agent.allocator.install.record_managed_trace", lambda *a, **k: recorded.append(True))
    with pytest.raises(AllocatorSwitchError, match="before the first CUDA allocation"):
        agent.wrap(
            model, adamw(model), plan=plan, sample_batch=batch, allocation="planned", feedback_steps=None
        )
    assert cuda.order == ["lazy_init"] and not recorded


def test_an_index_less_cuda_device_is_found_without_initialising_cuda(
    job: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Defect: `target_device` called `torch.cuda.current_device()`, which initialises CUDA."""
    model, _, _ = job
    cuda = CudaObserver(monkeypatch)
    assert target_device(model, RuntimeOptions(device="cuda")) == torch.device("cuda", 0)
    assert target_device(model) == torch.device("cuda", 0)
    assert cuda.order == []


def test_a_loss_function_that_cannot_reach_the_planning_child_is_named(
    job: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, batch, _ = job
    CudaObserver(monkeypatch)
    with pytest.raises(
        ValueError, match=r"loss_fn: cannot be sent to the planning subprocess.*install_allocator"
    ):
        agent.wrap(
            model,
            adamw(model),
            sample_batch=batch,
            loss_fn=lambda out, b: out.loss,
            allocation="planned",
            feedback_steps=None,
        )


def test_install_allocator_reads_a_saved_plan_and_names_what_it_lacks(
    job: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    model, batch, plan = job
    bare = tmp_path / "bare.json"
    bare.write_text(plan.model_dump_json())
    with pytest.raises(ValueError, match="plan.allocation: absent"):
        install_allocator(bare)
    managed = with_managed_allocation(model, adamw(model), plan, batch)
    assert managed.allocation is not None
    old = managed.model_copy(update={"allocation": managed.allocation.model_copy(update={"events": None})})
    with pytest.raises(ValueError, match="plan.allocation.events: absent"):
        install_allocator(old)
    saved = tmp_path / "plan.json"
    saved.write_text(
        json.dumps({"id": "x", "plan": managed.model_dump(mode="json")})
    )  # a plan record works too
    cuda = CudaObserver(monkeypatch)
    with pytest.raises(Installed):
        install_allocator(saved)
    assert cuda.order == ["install"] and cuda.installed["allocation"] == managed.allocation


@pytest.mark.slow
def test_without_a_plan_the_job_is_planned_in_a_child_process_and_installed_here_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The real child process profiles and solves (for the CPU: it has no GPU either) and records the managed
    iteration; this process initialises nothing before the install."""
    model, config = build("llama", 2, 64, vocab=256, seq=32)
    batch = sample_batch(config, 2, 16)
    cuda = CudaObserver(monkeypatch)
    with pytest.raises(Installed):
        agent.wrap(
            model,
            adamw(model),
            sample_batch=batch,
            device_memory=64 << 20,
            allocation="planned",
            feedback_steps=None,
        )
    assert cuda.order == ["install"]
    allocation = cuda.installed["allocation"]
    assert allocation.iteration == "managed" and has_managed_allocation(
        Plan.model_construct(allocation=allocation)
    )
