"""Build the planned allocator's C++ library from source on first use, cached under the user's cache dir.

Three libraries from the same core (`csrc/core.cpp`): a host-memory backend (`host_backend.cpp`, built
wherever a C++ compiler exists, so CI tests the core); the CUDA backend (`cuda_backend.cpp`, needs
the CUDA runtime's headers and `libcudart`; no nvcc because there are no kernels); and, for tests
only, the same CUDA backend built against a fake runtime (`csrc/fake_cuda/`, a test double that
exists because no GPU runs here).

Where the CUDA runtime comes from (`find_cuda_runtime`), first match wins:
* the pip wheels PyTorch depends on, in both layouts: CUDA 13 (`nvidia/cu13/include`, `nvidia/cu13/lib`,
  with `crt/host_defines.h` from `nvidia-cuda-crt` in the same folder) and CUDA 12
  (`nvidia/cuda_runtime/`, with `crt/` from the nvcc wheel, `nvidia/cuda_nvcc/include`), looked up
  in the `nvidia` namespace package and in the folders of `$MEMPLAN_CUDA_WHEELS` (os.pathsep-separated
  roots holding an `nvidia/` folder, e.g. a `pip install --target`);
* a toolkit: `$CUDA_HOME`, `$CUDA_PATH`, `/usr/local/cuda`.
When PyTorch is a CUDA build, only a runtime of its CUDA major version qualifies. The library is linked
by path, which records the soname (`libcudart.so.13`): the dynamic loader then binds to the copy
PyTorch already loaded (same soname), not a second one.

The cache key hashes the sources, the flags and the compiler's version, so an edited source or a new
compiler rebuilds. Concurrent first uses each compile into a private temporary file and publish it
with an atomic rename, so no lock is needed.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

Backend = Literal["host", "cuda", "cuda_fake"]

CSRC = Path(__file__).resolve().parent / "csrc"
FAKE_CUDA = CSRC / "fake_cuda"
COMMON_FLAGS = ("-O2", "-std=c++17", "-shared", "-fPIC", "-fvisibility=default", "-Wall", "-Wextra")
SOURCES: dict[Backend, tuple[str, ...]] = {
    "host": ("core.cpp", "host_backend.cpp"),
    "cuda": ("core.cpp", "cuda_backend.cpp"),
    "cuda_fake": ("core.cpp", "cuda_backend.cpp", "fake_cuda/fake_cudart.cpp"),
}
HEADERS = ("planned_allocator.h", "fake_cuda/cuda_runtime_api.h")
# The C symbols PyTorch's CUDAPluggableAllocator and agent/allocator/library.py need from the CUDA library.
CUDA_EXPORTS = (
    "mp_cuda_malloc",
    "mp_cuda_free",
    "mp_cuda_install",
    "mp_cuda_empty_cache",
    "mp_create",
    "mp_alloc",
)


class AllocatorBuildError(RuntimeError):
    """The planned allocator's library could not be built (no compiler, no CUDA runtime, a compile error)."""


@dataclass(frozen=True)
class CudaRuntime:
    """Where the CUDA runtime's headers (one or two folders: runtime and crt/) and shared library are."""

    include_dirs: tuple[Path, ...]
    library: Path
    major: int


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
    if not lib_dir.is_dir():
        return None
    for name in ("libcudart.so", *sorted(p.name for p in lib_dir.glob("libcudart.so.*"))):
        if (lib_dir / name).is_file():
            return lib_dir / name
    return None


def _header_major(include_dir: Path) -> int | None:
    """CUDA major version from `CUDART_VERSION` in cuda_runtime_api.h (13050 -> 13)."""
    try:
        text = (include_dir / "cuda_runtime_api.h").read_text(errors="replace")
    except OSError:
        return None
    m = re.search(r"#define\s+CUDART_VERSION\s+(\d+)", text)
    return int(m.group(1)) // 1000 if m else None


def _nvidia_roots() -> list[Path]:
    """`nvidia/` folders: those of `$MEMPLAN_CUDA_WHEELS` first, then the installed namespace package."""
    roots = [Path(p) / "nvidia" for p in os.environ.get("MEMPLAN_CUDA_WHEELS", "").split(os.pathsep) if p]
    try:
        # local import: NVIDIA's CUDA wheels are optional (the namespace package may be absent)
        import nvidia  # type: ignore[import-not-found]  # namespace package of NVIDIA's pip wheels

        roots += [Path(p) for p in nvidia.__path__]
    except ImportError:
        pass
    return roots


def _layouts() -> Iterator[tuple[Path, list[Path], list[Path]]]:
    """(runtime include dir, extra include dirs for crt/, lib dirs) for every place a runtime may be."""
    nvidia_roots = _nvidia_roots()
    for root in nvidia_roots:
        for sub in sorted(
            root.glob("cu[0-9]*")
        ):  # CUDA 13+: nvidia/cu13/{include,lib}, crt in the same folder
            yield sub / "include", [], [sub / "lib"]
        crt = [r / "cuda_nvcc" / "include" for r in nvidia_roots]  # CUDA 12: crt/ comes with the nvcc wheel
        yield root / "cuda_runtime" / "include", crt, [root / "cuda_runtime" / "lib"]
    toolkits = [Path(os.environ[v]) for v in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(v)]
    for tk in (*toolkits, Path("/usr/local/cuda")):
        yield tk / "include", [], [tk / "lib64", tk / "lib", tk / "targets" / "x86_64-linux" / "lib"]


def torch_cuda_major() -> int | None:
    """The CUDA major version PyTorch was built for; None for a CPU build."""
    # local import: importing `agent.allocator` loads no torch (its docstring)
    import torch

    return int(torch.version.cuda.split(".")[0]) if torch.version.cuda else None


def find_cuda_runtime(major: int | None = None) -> CudaRuntime:
    """The CUDA runtime headers and libcudart, of CUDA `major` (default: PyTorch's, any for a CPU build)."""
    want = major if major is not None else torch_cuda_major()
    looked: list[str] = []
    for include, crt_dirs, lib_dirs in _layouts():
        looked.append(str(include))
        if not (include / "cuda_runtime_api.h").is_file():
            continue
        found_major = _header_major(include)
        if want is not None and found_major != want:
            looked[-1] += f" (CUDA {found_major}, not {want})"
            continue
        crt = [d for d in (include, *crt_dirs) if (d / "crt" / "host_defines.h").is_file()]
        if not crt:
            looked[-1] += " (no crt/host_defines.h: install nvidia-cuda-crt, or the nvcc wheel for CUDA 12)"
            continue
        lib = next((lib for d in lib_dirs if (lib := _cudart_in(d)) is not None), None)
        if lib is None:
            looked[-1] += " (no libcudart next to it)"
            continue
        dirs = (include,) if crt[0] == include else (include, crt[0])
        return CudaRuntime(include_dirs=dirs, library=lib, major=found_major or 0)
    raise AllocatorBuildError(
        f"no CUDA {want if want else ''} runtime headers and libcudart found (looked in: {'; '.join(looked)}): "
        "install a CUDA build of PyTorch (it brings the nvidia-cuda-runtime wheel) or a CUDA toolkit and set "
        "CUDA_HOME; scripts/check_cuda_build.sh shows the few-MB wheels that suffice"
    )


def _compiler_version(cxx: str) -> str:
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as exc:
        raise AllocatorBuildError(f"the C++ compiler {cxx!r} does not run: {exc}") from exc
    return out.stdout


def build_command(backend: Backend, cxx: str, output: Path, *, werror: bool = False) -> list[str]:
    sources = [str(CSRC / s) for s in SOURCES[backend]]
    cmd = [cxx, *COMMON_FLAGS, *(["-Werror"] if werror else []), *sources, "-o", str(output)]
    if backend == "cuda":
        rt = find_cuda_runtime()
        # link the runtime by path: the soname (libcudart.so.N) is recorded, so the copy PyTorch has
        # already loaded is the one used at run time
        cmd[1:1] = [f"-I{d}" for d in rt.include_dirs]
        cmd += [str(rt.library), f"-Wl,-rpath,{rt.library.parent}"]
    elif backend == "cuda_fake":
        cmd[1:1] = [f"-I{FAKE_CUDA}"]  # the fake's cuda_runtime_api.h; its definitions are compiled in
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


def check_cuda_build(major: int | None, output: Path) -> Path:
    """Compile the CUDA backend against the real CUDA headers with -Werror into `output` (no GPU needed)."""
    cxx = find_compiler()
    rt = find_cuda_runtime(major)
    cmd = build_command("cuda", cxx, output, werror=True)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise AllocatorBuildError(
            f"the CUDA backend does not compile cleanly:\n$ {' '.join(cmd)}\n{done.stderr[-6000:]}"
        )
    print(
        f"built {output} against CUDA {rt.major} headers in {', '.join(map(str, rt.include_dirs))}; libcudart {rt.library}"
    )
    return output


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Compile the planned allocator's CUDA backend with -Werror.")
    parser.add_argument(
        "--cuda-major", type=int, default=None, help="CUDA major version (default: PyTorch's)"
    )
    parser.add_argument("--output", type=Path, required=True, help="where to write the shared library")
    args = parser.parse_args(argv)
    try:
        check_cuda_build(args.cuda_major, args.output)
    except AllocatorBuildError as exc:
        print(exc, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
