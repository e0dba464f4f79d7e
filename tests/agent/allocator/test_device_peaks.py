"""Peaks under the planned allocator come from its own statistics (issue 19 defect 3).

PyTorch's `CUDAPluggableAllocator` refuses peak statistics and memory history (`TORCH_CHECK(false)`), so
`DevicePeakMeter.start` crashed on the first metered step of `wrap(..., allocation="planned")`. The meter now
reads the C++ core's statistics when the planned allocator is installed.

No GPU runs where these tests do: the C++ core is the real CUDA backend (`cuda_backend.cpp`) built against
the fake CUDA runtime (`csrc/fake_cuda/`, a test double), its hooks called as PyTorch calls them; PyTorch's
own refusal is stood in for by making `torch.cuda`'s statistics calls raise as the pluggable allocator's do,
and `torch.cuda.synchronize` (which needs a GPU) does nothing.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from agent.allocator import cuda as cuda_module
from agent.allocator.core import MatchRules, PlannedCore
from agent.allocator.cuda import CudaPlannedAllocator
from agent.allocator.device_memory import AllocatorHistoryUnavailable
from agent.allocator.library import load_library
from agent.allocator.slots import plan_slots
from agent.measure import DevicePeakMeter
from tests.agent.allocator.conftest import event, plan_for
from tests.agent.allocator.test_cuda_backend_fake_runtime import Fake

pytestmark = pytest.mark.cuda_semantics
KiB = 1024
CUDA0 = torch.device("cuda", 0)


def _pluggable_refuses(*args: object, **kwargs: object) -> None:
    raise RuntimeError(
        "CUDAPluggableAllocator does not yet support getDeviceStats"
    )  # PyTorch's TORCH_CHECK text


@pytest.fixture()
def installed(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Fake, CudaPlannedAllocator]]:
    """The planned allocator installed as this process's (fake) CUDA allocator, torch.cuda's stats refusing."""
    fake = Fake(load_library("cuda_fake"))
    fake.lib.cdll.fake_cuda_reset()
    # a: long-lived (held before the window); b [1,3), c [2,4) overlap; d [4,5) reuses b's bytes
    evs = [
        event(0, 3 * KiB, 0, None, "param"),
        event(1, 4 * KiB, 1, 3),
        event(2, 2 * KiB, 2, 4),
        event(3, 4 * KiB, 4, 5),
    ]
    plan = plan_for(evs, {0: 0, 1: 3 * KiB, 2: 7 * KiB, 3: 3 * KiB})
    core = PlannedCore(fake.lib, plan_slots(plan, evs), device=0, debug=True, rules=MatchRules())
    fake.lib.mp_cuda_install(core.handle, 0)  # type: ignore[attr-defined]
    handle = CudaPlannedAllocator(core, None, 0)
    monkeypatch.setattr(cuda_module, "_installed", handle)
    for name in ("reset_peak_memory_stats", "max_memory_allocated", "memory_allocated", "memory_stats"):
        monkeypatch.setattr(torch.cuda, name, _pluggable_refuses)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    yield fake, handle
    fake.lib.mp_cuda_install(None, -1)  # type: ignore[attr-defined]
    fake.lib.mp_cuda_empty_cache()  # type: ignore[attr-defined]
    core.destroy()
    fake.lib.cdll.fake_cuda_reset()


def test_the_meter_reads_the_planned_allocators_peak(installed: tuple[Fake, CudaPlannedAllocator]) -> None:
    fake, handle = installed
    a = fake.malloc(3 * KiB)  # long-lived, before the metered iteration
    handle.begin_iteration()
    meter = DevicePeakMeter(CUDA0)
    meter.start(
        [], None
    )  # crashed here before: torch.cuda.reset_peak_memory_stats under the pluggable allocator
    b = fake.malloc(4 * KiB)
    c = fake.malloc(2 * KiB)  # peak: a + b + c
    fake.free(b, 4 * KiB)
    d = fake.malloc(4 * KiB)
    fake.free(c, 2 * KiB)
    fake.free(d, 4 * KiB)
    peak = meter.stop()
    assert peak == (3 + 4 + 2) * KiB  # every size is a multiple of the plan's 512-byte alignment
    stats = handle.stats()
    assert stats.planned == 3 and stats.fallbacks == 0
    fake.free(a, 3 * KiB)


def test_a_new_window_forgets_the_earlier_peak(installed: tuple[Fake, CudaPlannedAllocator]) -> None:
    fake, handle = installed
    a = fake.malloc(3 * KiB)
    handle.begin_iteration()
    b, c = fake.malloc(4 * KiB), fake.malloc(2 * KiB)
    fake.free(b, 4 * KiB)
    fake.free(c, 2 * KiB)
    meter = DevicePeakMeter(CUDA0)
    meter.start([], None)  # after the 9 KiB peak: only what is held now and later counts
    assert meter.stop() == 3 * KiB
    fake.free(a, 3 * KiB)


def test_without_the_planned_allocator_the_meter_reads_pytorchs_statistics(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The selection's other side: PyTorch's caching allocator answers (here a stand-in, no GPU)."""
    calls: list[str] = []
    monkeypatch.setattr(cuda_module, "_installed", None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: calls.append("reset"))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: calls.append("peak") or 12345)
    meter = DevicePeakMeter(CUDA0)
    meter.start([], None)
    assert meter.stop() == 12345
    assert calls == ["reset", "peak"]


def test_profiling_on_the_gpu_under_the_planned_allocator_says_why_it_cannot(
    installed: tuple[Fake, CudaPlannedAllocator],
) -> None:
    from agent.profiler.cuda_history import CudaAllocatorHistory, CudaGauge

    with pytest.raises(AllocatorHistoryUnavailable, match="no memory history.*plans in a child process"):
        CudaGauge(CUDA0)
    with pytest.raises(AllocatorHistoryUnavailable, match="plan_with_allocation"):
        CudaAllocatorHistory(CUDA0)
