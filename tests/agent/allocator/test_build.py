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
    assert lib.mp_cuda_malloc and lib.mp_cuda_free and lib.mp_cuda_install and lib.mp_cuda_empty_cache
    lib.mp_backend_name.restype = ctypes.c_char_p
    assert lib.mp_backend_name() == b"cuda"


def test_the_cuda_13_wheel_layout_is_found_with_its_separate_crt_headers(
    monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    """Defect 4: PyTorch 2.13's CUDA 13 wheels live under nvidia/cu13/, crt/host_defines.h from nvidia-cuda-crt."""
    cu13 = tmp_path / "nvidia" / "cu13"
    (cu13 / "include" / "crt").mkdir(parents=True)
    (cu13 / "lib").mkdir()
    (cu13 / "include" / "cuda_runtime_api.h").write_text("#define CUDART_VERSION  13050\n")
    (cu13 / "include" / "crt" / "host_defines.h").write_text("\n")
    (cu13 / "lib" / "libcudart.so.13").write_bytes(b"")
    monkeypatch.setenv("MEMPLAN_CUDA_WHEELS", str(tmp_path))
    rt = find_cuda_runtime(13)
    assert (
        rt.include_dirs == (cu13 / "include",)
        and rt.library == cu13 / "lib" / "libcudart.so.13"
        and rt.major == 13
    )


def test_the_cuda_12_wheel_layout_takes_crt_from_the_nvcc_wheel(
    monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    root = tmp_path / "nvidia"
    (root / "cuda_runtime" / "include").mkdir(parents=True)
    (root / "cuda_runtime" / "lib").mkdir()
    (root / "cuda_nvcc" / "include" / "crt").mkdir(parents=True)
    (root / "cuda_runtime" / "include" / "cuda_runtime_api.h").write_text("#define CUDART_VERSION 12090\n")
    (root / "cuda_nvcc" / "include" / "crt" / "host_defines.h").write_text("\n")
    (root / "cuda_runtime" / "lib" / "libcudart.so.12").write_bytes(b"")
    monkeypatch.setenv("MEMPLAN_CUDA_WHEELS", str(tmp_path))
    rt = find_cuda_runtime(12)
    assert rt.include_dirs == (root / "cuda_runtime" / "include", root / "cuda_nvcc" / "include")
    assert rt.library.name == "libcudart.so.12"


def test_a_runtime_without_crt_headers_or_of_another_major_is_refused_with_what_is_missing(
    monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    cu13 = tmp_path / "nvidia" / "cu13"
    (cu13 / "include").mkdir(parents=True)
    (cu13 / "lib").mkdir()
    (cu13 / "include" / "cuda_runtime_api.h").write_text("#define CUDART_VERSION 13050\n")
    (cu13 / "lib" / "libcudart.so.13").write_bytes(b"")
    monkeypatch.setenv("MEMPLAN_CUDA_WHEELS", str(tmp_path))
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "none"))
    import agent.allocator.build as build

    monkeypatch.setattr(build, "_layouts", lambda: [(cu13 / "include", [], [cu13 / "lib"])])
    with pytest.raises(AllocatorBuildError, match="no crt/host_defines.h: install nvidia-cuda-crt"):
        find_cuda_runtime(13)
    with pytest.raises(AllocatorBuildError, match=r"CUDA 13, not 12"):
        find_cuda_runtime(12)
