"""Building the library from source: a clear message without a compiler; the CUDA backend where CUDA headers exist."""

from __future__ import annotations

import ctypes

import pytest

from agent.allocator import AllocatorBuildError
from agent.allocator.build import find_compiler, find_cuda_runtime, library_path


def test_no_compiler_gives_a_clear_message(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(AllocatorBuildError, match=r"no C\+\+ compiler found .*apt-get install g\+\+"):
        find_compiler()


def test_a_cxx_that_does_not_exist_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CXX", "/nonexistent/g++")
    with pytest.raises(AllocatorBuildError, match="CXX='/nonexistent/g"):
        library_path("host")


def test_the_host_library_is_built_into_the_cache_and_reused(
    monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    monkeypatch.setenv("MEMPLAN_CACHE_DIR", str(tmp_path))
    first = library_path("host")
    assert first.is_file() and tmp_path in first.parents
    mtime = first.stat().st_mtime_ns
    assert library_path("host") == first and first.stat().st_mtime_ns == mtime
    assert ctypes.CDLL(str(first)).mp_backend_name  # exports the C API


def torch_cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _cuda_runtime_present() -> bool:
    try:
        find_cuda_runtime()
        return True
    except AllocatorBuildError:
        return False


@pytest.mark.slow
@pytest.mark.skipif(
    not _cuda_runtime_present(), reason="no CUDA runtime headers and libcudart on this machine"
)
def test_the_cuda_backend_compiles_and_exports_the_pluggable_allocator_abi(
    monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    monkeypatch.setenv("MEMPLAN_CACHE_DIR", str(tmp_path))
    path = library_path("cuda")
    lib = ctypes.CDLL(str(path))  # loading needs libcudart, not a GPU
    assert lib.mp_cuda_malloc and lib.mp_cuda_free and lib.mp_cuda_install
    lib.mp_backend_name.restype = ctypes.c_char_p
    assert lib.mp_backend_name() == b"cuda"


@pytest.mark.slow
@pytest.mark.skipif(
    not _cuda_runtime_present(), reason="no CUDA runtime headers and libcudart on this machine"
)
@pytest.mark.skipif(torch_cuda_available(), reason="a real GPU would serve the request")
def test_the_cuda_hooks_without_a_gpu_return_null_and_count_the_failure(
    monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    from agent.allocator.core import MatchRules, PlannedCore
    from agent.allocator.library import Library
    from agent.allocator.slots import plan_slots
    from tests.allocator.conftest import event, plan_for

    monkeypatch.setenv("MEMPLAN_CACHE_DIR", str(tmp_path))
    lib = Library(library_path("cuda"))
    evs = [event(0, 1000, 0, 2)]
    core = PlannedCore(lib, plan_slots(plan_for(evs, {0: 0}), evs), device=0, debug=True, rules=MatchRules())
    malloc, free = lib.cdll.mp_cuda_malloc, lib.cdll.mp_cuda_free
    malloc.restype, malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    lib.mp_cuda_install(core.handle, 0)  # type: ignore[attr-defined]
    assert malloc(1000, 0, None) is None  # cudaMalloc fails without a device: PyTorch sees out-of-memory
    free(None, 0, 0, None)
    assert core.stats().failed_allocs == 1
    lib.mp_cuda_install(None, -1)  # type: ignore[attr-defined]
    core.destroy()
