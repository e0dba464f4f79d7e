"""Build the planned allocator's C++ library from source on first use, cached under the user's cache dir.

Two libraries from the same core (`csrc/core.cpp`): a host-memory backend (`host_backend.cpp`, built
wherever a C++ compiler exists, so CI tests the core) and a CUDA backend (`cuda_backend.cpp`, needs
the CUDA runtime's headers and `libcudart`, either from a toolkit or from the `nvidia-cuda-runtime`
wheel that CUDA builds of PyTorch install; no nvcc is needed because there are no kernels).

The cache key hashes the sources, the flags and the compiler's version, so an edited source or a new
compiler rebuilds. Concurrent first uses each compile into a private temporary file and publish it
with an atomic rename, so no lock is needed.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

Backend = Literal["host", "cuda"]

CSRC = Path(__file__).resolve().parent / "csrc"
COMMON_FLAGS = ("-O2", "-std=c++17", "-shared", "-fPIC", "-fvisibility=default", "-Wall")
SOURCES: dict[Backend, tuple[str, ...]] = {
    "host": ("core.cpp", "host_backend.cpp"),
    "cuda": ("core.cpp", "cuda_backend.cpp"),
}
HEADERS = ("planned_allocator.h",)


class AllocatorBuildError(RuntimeError):
    """The planned allocator's library could not be built (no compiler, no CUDA runtime, a compile error)."""


@dataclass(frozen=True)
class CudaRuntime:
    """Where the CUDA runtime's headers and shared library are."""

    include_dir: Path
    library: Path


def cache_dir() -> Path:
    """`$MEMPLAN_CACHE_DIR`, else `$XDG_CACHE_HOME/memplan`, else `~/.cache/memplan`; then `allocator/`."""
    root = os.environ.get("MEMPLAN_CACHE_DIR")
    if root:
        return Path(root) / "allocator"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "memplan" / "allocator"


def find_compiler() -> str:
    """`$CXX`, else g++, c++ or clang++ on PATH."""
    cxx = os.environ.get("CXX")
    if cxx:
        if shutil.which(cxx) is None:
            raise AllocatorBuildError(f"CXX={cxx!r} is not an executable on PATH")
        return cxx
    for name in ("g++", "c++", "clang++"):
        if shutil.which(name):
            return name
    raise AllocatorBuildError(
        "no C++ compiler found (looked for $CXX, g++, c++, clang++): the planned allocator is built from "
        "source on first use; install one (Debian/Ubuntu: apt-get install g++) or use allocation='caching'"
    )


def _cudart_in(lib_dir: Path) -> Path | None:
    for name in ("libcudart.so", *sorted(p.name for p in lib_dir.glob("libcudart.so.*"))):
        if (lib_dir / name).is_file():
            return lib_dir / name
    return None


def find_cuda_runtime() -> CudaRuntime:
    """Prefer the runtime PyTorch itself loads (the nvidia-cuda-runtime wheel), then a toolkit."""
    candidates: list[Path] = []
    try:
        import nvidia.cuda_runtime as wheel  # type: ignore[import-not-found]

        candidates += [Path(p) for p in wheel.__path__]
    except ImportError:
        pass
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            candidates.append(Path(os.environ[var]))
    candidates.append(Path("/usr/local/cuda"))
    for root in candidates:
        header = root / "include" / "cuda_runtime_api.h"
        if not header.is_file():
            continue
        for lib_dir in (root / "lib", root / "lib64", root / "targets" / "x86_64-linux" / "lib"):
            lib = _cudart_in(lib_dir) if lib_dir.is_dir() else None
            if lib is not None:
                return CudaRuntime(include_dir=root / "include", library=lib)
    looked = ", ".join(str(c) for c in candidates)
    raise AllocatorBuildError(
        f"no CUDA runtime headers and libcudart found (looked in {looked}): install a CUDA build of PyTorch "
        "(it brings the nvidia-cuda-runtime wheel) or a CUDA toolkit and set CUDA_HOME"
    )


def _compiler_version(cxx: str) -> str:
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as exc:
        raise AllocatorBuildError(f"the C++ compiler {cxx!r} does not run: {exc}") from exc
    return out.stdout


def build_command(backend: Backend, cxx: str, output: Path) -> list[str]:
    sources = [str(CSRC / s) for s in SOURCES[backend]]
    cmd = [cxx, *COMMON_FLAGS, *sources, "-o", str(output)]
    if backend == "cuda":
        rt = find_cuda_runtime()
        # link the runtime by path: the soname (libcudart.so.N) is recorded, so the copy PyTorch has
        # already loaded is the one used at run time
        cmd[1:1] = [f"-I{rt.include_dir}"]
        cmd += [str(rt.library), f"-Wl,-rpath,{rt.library.parent}"]
    return cmd


def library_path(backend: Backend) -> Path:
    """The built library for `backend`, building it if the cache has none for these sources."""
    cxx = find_compiler()
    digest = hashlib.sha256()
    digest.update(_compiler_version(cxx).encode())
    probe = build_command(backend, cxx, Path("out.so"))
    digest.update("\0".join(probe).encode())
    for name in (*SOURCES[backend], *HEADERS):
        digest.update((CSRC / name).read_bytes())
    out_dir = cache_dir() / digest.hexdigest()[:20]
    target = out_dir / f"libmemplan_alloc_{backend}.so"
    if target.is_file():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{backend}-", suffix=".so", dir=out_dir)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        cmd = build_command(backend, cxx, tmp)
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise AllocatorBuildError(
                f"building the planned allocator ({backend}) failed:\n$ {' '.join(cmd)}\n{done.stderr[-4000:]}"
            )
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target
