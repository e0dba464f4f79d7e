"""The CUDA backend's hooks (`mp_cuda_malloc` / `mp_cuda_free`, `cuda_backend.cpp` unchanged) driven
through a fake CUDA runtime (`csrc/fake_cuda/`): cross-stream reuse, the fallback cache, the arena
reserved once, out-of-memory.

The fake runtime is a test double and exists only because no GPU runs where these tests do: it models
device memory (poisoned on free), an out-of-memory knob, and streams/events with vector clocks so a
kernel touching a range another stream may still be using is reported.
"""

from __future__ import annotations

import ctypes
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from agent.allocator.build import CSRC, find_compiler, library_path
from agent.allocator.core import MatchRules, PlannedCore
from agent.allocator.library import Library, load_library
from agent.allocator.slots import plan_slots
from tests.agent.allocator.conftest import event, plan_for

pytestmark = pytest.mark.cuda_semantics
KiB = 1024


@dataclass
class Fake:
    """The fake-runtime build of the CUDA backend: its hooks and the fake's control API."""

    lib: Library

    def __post_init__(self) -> None:
        c = self.lib.cdll
        c.mp_cuda_malloc.restype = ctypes.c_void_p
        c.mp_cuda_malloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        c.mp_cuda_free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        c.fake_cuda_stream_create.restype = ctypes.c_void_p
        c.fake_cuda_launch.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int]
        c.fake_cuda_is_poisoned.argtypes = [ctypes.c_void_p, ctypes.c_uint64]
        c.fake_cuda_set_capacity.argtypes = [ctypes.c_uint64]
        c.fake_cuda_counter.restype = ctypes.c_uint64
        c.fake_cuda_counter.argtypes = [ctypes.c_char_p]
        c.fake_cuda_mallocs_of.restype = ctypes.c_uint64
        c.fake_cuda_mallocs_of.argtypes = [ctypes.c_uint64]
        c.fake_cuda_first_violation.restype = ctypes.c_char_p

    def malloc(self, size: int, stream: int | None = None) -> int:
        p = self.lib.cdll.mp_cuda_malloc(size, 0, stream)
        assert p, "mp_cuda_malloc returned a null pointer"
        return int(p)

    def free(self, ptr: int, size: int, stream: int | None = None) -> None:
        self.lib.cdll.mp_cuda_free(ptr, size, 0, stream)

    def stream(self) -> int:
        return int(self.lib.cdll.fake_cuda_stream_create())

    def launch(self, stream: int | None, ptr: int, size: int, *, write: bool) -> bool:
        """A kernel on `stream` touching [ptr, ptr+size); True when it is ordered after every conflicting access."""
        return self.lib.cdll.fake_cuda_launch(stream, ptr, size, int(write)) == 0

    def counter(self, name: str) -> int:
        value = int(self.lib.cdll.fake_cuda_counter(name.encode()))
        assert value != 2**64 - 1, f"unknown fake counter {name}"
        return value


@pytest.fixture()
def fake(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Fake]:
    f = Fake(load_library("cuda_fake"))
    f.lib.cdll.fake_cuda_reset()
    yield f
    f.lib.mp_cuda_install(None, -1)  # type: ignore[attr-defined]
    f.lib.mp_cuda_empty_cache()  # type: ignore[attr-defined]
    f.lib.cdll.fake_cuda_reset()


def install(
    f: Fake, offsets: dict[int, int], sizes: dict[int, int], order: list[tuple[int, int]]
) -> PlannedCore:
    """A core whose plan has buffers `sizes` at `offsets`, live over [alloc, free) of `order`, installed as the hook's core."""
    evs = [event(i, sizes[i], a, b) for i, (a, b) in enumerate(order)]
    core = PlannedCore(
        f.lib, plan_slots(plan_for(evs, offsets), evs), device=0, debug=True, rules=MatchRules()
    )
    f.lib.mp_cuda_install(core.handle, 0)  # type: ignore[attr-defined]
    return core


def test_the_fake_runtime_reports_a_missing_wait_and_accepts_an_event_wait(fake: Fake) -> None:
    """Self-test of the double: without an event wait, a second stream writing a range is a violation."""
    a, b = fake.stream(), fake.stream()
    buf = ctypes.create_string_buffer(64)
    ptr = ctypes.addressof(buf)
    assert fake.launch(a, ptr, 64, write=True)
    assert not fake.launch(b, ptr, 64, write=False)
    assert b"while stream" in fake.lib.cdll.fake_cuda_first_violation()
    ev = ctypes.c_void_p()
    fake.lib.cdll.cudaEventCreateWithFlags(ctypes.byref(ev), 2)
    fake.lib.cdll.cudaEventRecord(ev, ctypes.c_void_p(a))
    fake.lib.cdll.cudaStreamWaitEvent(ctypes.c_void_p(b), ev, 0)
    assert fake.launch(b, ptr, 64, write=True)
    fake.lib.cdll.cudaEventDestroy(ev)


def test_a_range_reused_on_another_stream_waits_for_the_stream_that_used_it(fake: Fake) -> None:
    primary, side = fake.stream(), fake.stream()
    # a [0,1) and b [1,2) share offset 0; c [2,3) and d [3,4) too
    core = install(
        fake, {0: 0, 1: 0, 2: 0, 3: 0}, {i: 4 * KiB for i in range(4)}, [(0, 1), (1, 2), (2, 3), (3, 4)]
    )
    core.begin_iteration()
    a = fake.malloc(4 * KiB, primary)  # the first allocation makes `primary` the ordering stream
    assert fake.launch(primary, a, 4 * KiB, write=True)
    fake.free(a, 4 * KiB, primary)
    b = fake.malloc(4 * KiB, side)  # same bytes, another stream: must wait for primary's kernel
    assert b == a
    assert fake.launch(side, b, 4 * KiB, write=True), fake.lib.cdll.fake_cuda_first_violation()
    fake.free(b, 4 * KiB, side)  # freed on the side stream: primary must wait for it before reuse
    c = fake.malloc(4 * KiB, primary)
    assert c == a
    assert fake.launch(primary, c, 4 * KiB, write=True), fake.lib.cdll.fake_cuda_first_violation()
    fake.free(c, 4 * KiB, primary)
    assert fake.counter("violations") == 0 and fake.counter("device_syncs") == 0
    core.check()
    core.destroy()


def test_a_failed_arena_reservation_is_not_retried_on_every_allocation(fake: Fake) -> None:
    """Defect 6: the arena's cudaMalloc was asked again on every request after it failed once."""
    core = install(fake, {0: 0, 1: 64 * KiB}, {0: 64 * KiB, 1: 64 * KiB}, [(0, 2), (1, 3)])
    arena = core.slots.arena_bytes
    fake.lib.cdll.fake_cuda_set_capacity(arena - 1)  # the arena never fits; small blocks do
    core.begin_iteration()
    ptrs = [fake.malloc(KiB) for _ in range(5)]
    for p in ptrs:
        fake.free(p, KiB)
    assert fake.lib.cdll.fake_cuda_mallocs_of(arena) == 1
    stats = core.stats()
    assert stats.arena_reserve_failures == 1 and stats.arena_bytes == 0 and stats.failed_allocs == 0
    fake.lib.cdll.fake_cuda_set_capacity(2**64 - 1)
    core.reserve_arena()  # an explicit request retries and now succeeds
    assert core.stats().arena_bytes == arena
    core.destroy()


def test_fallback_blocks_are_cached_instead_of_freed_and_synchronising_each_time(fake: Fake) -> None:
    """Defect 6: every free of a plain fallback block called cudaFree, which synchronises the device."""
    core = install(fake, {0: 0}, {0: 4 * KiB}, [(0, 1)])
    core.begin_iteration()
    for _ in range(4):  # an unplanned size larger than the arena: a plain fallback each time
        p = fake.malloc(256 * KiB)
        fake.free(p, 256 * KiB)
    assert fake.lib.cdll.fake_cuda_mallocs_of(256 * KiB) == 1
    assert fake.counter("frees") == 0 and fake.counter("device_syncs") == 0
    assert core.stats().device_fallbacks == 4
    assert fake.lib.mp_cuda_cached_bytes() == 256 * KiB  # type: ignore[attr-defined]
    core.destroy()


def test_out_of_memory_empties_the_cache_and_retries_and_released_blocks_are_poisoned(fake: Fake) -> None:
    core = install(fake, {0: 0}, {0: 4 * KiB}, [(0, 1)])
    core.begin_iteration()
    p = fake.malloc(256 * KiB)
    fake.free(p, 256 * KiB)  # cached
    fake.lib.cdll.fake_cuda_set_capacity(
        fake.counter("live_bytes") + 100 * KiB
    )  # room only without the cached block
    q = fake.malloc(300 * KiB)  # fails once, the cache is emptied (cudaFree), the retry succeeds
    assert fake.counter("failed_mallocs") == 1 and fake.counter("frees") == 1
    assert fake.lib.cdll.fake_cuda_is_poisoned(p, 256 * KiB) == 1  # really released
    assert fake.lib.mp_cuda_cached_bytes() == 0  # type: ignore[attr-defined]
    fake.free(q, 300 * KiB)
    core.destroy()


DRIVER = r"""
// Calls the hook the way PyTorch's CUDAPluggableAllocator does (from C++) and reports what it gets.
#include <cstdint>
#include <cstdio>
#include <stdexcept>
#include "planned_allocator.h"
extern "C" {
void mp_cuda_install(mp_core*, int);
void* mp_cuda_malloc(size_t, int, void*);
void fake_cuda_set_capacity(uint64_t);
}
int main() {
    uint64_t sizes[1] = {4096}, offsets[1] = {0};
    uint8_t persistent[1] = {0};
    mp_core* core = mp_create(4096, 512, sizes, offsets, persistent, 1, 0, MP_RULES_ALL, 16, 64, 8, 0);
    mp_cuda_install(core, 0);
    fake_cuda_set_capacity(0);  // the device is full
    mp_begin_iteration(core);
    try {
        void* p = mp_cuda_malloc(1 << 20, 0, nullptr);
        std::printf("returned %p\n", p);
        return 3;
    } catch (const std::exception& e) {
        std::printf("threw: %s\n", e.what());
        return 0;
    }
}
"""


def test_out_of_memory_raises_a_clear_error_instead_of_returning_null(tmp_path: Path) -> None:
    """Defect 6: a null pointer reached PyTorch, which does not check it (an illegal-address fault later)."""
    lib = library_path("cuda_fake")
    src = tmp_path / "driver.cpp"
    src.write_text(DRIVER)
    exe = tmp_path / "driver"
    subprocess.run(
        [
            find_compiler(),
            "-std=c++17",
            f"-I{CSRC}",
            str(src),
            str(lib),
            f"-Wl,-rpath,{lib.parent}",
            "-o",
            str(exe),
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    done = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "threw: CUDA out of memory in memplan's planned allocator" in done.stdout
    assert "1048576 bytes on device 0" in done.stdout and "(the arena could not be reserved)" in done.stdout
    assert "allocation='caching'" in done.stdout
