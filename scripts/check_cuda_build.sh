#!/usr/bin/env bash
# Compile the planned allocator's CUDA backend against the real CUDA runtime headers, with
# -Wall -Wextra -Werror, and check the symbols PyTorch's CUDAPluggableAllocator needs are exported.
# Needs no GPU and no CUDA toolkit: the headers and libcudart come from NVIDIA's small pip wheels
# (nvidia-cuda-runtime + nvidia-cuda-crt for CUDA 13, ~3 MB; nvidia-cuda-runtime-cu12 +
# nvidia-cuda-nvcc-cu12 for CUDA 12, of which only the headers are kept), installed once into a cache
# folder, never a CUDA build of torch.
#
#   scripts/check_cuda_build.sh [CUDA_MAJOR]     default: PyTorch's CUDA major, else 13 (torch 2.13's)
#
# Env: PYTHON (default .venv/bin/python, else python3), MEMPLAN_CUDA_WHEEL_CACHE (default
# ~/.cache/memplan/cuda-wheels). Exit status 0 only when the build and the symbol check pass.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-}"
if [[ -z "$PY" ]]; then
  if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
MAJOR="${1:-$("$PY" -c 'import torch; v = torch.version.cuda; print(v.split(".")[0] if v else 13)')}"
case "$MAJOR" in
  12) WHEELS=("nvidia-cuda-runtime-cu12>=12,<13" "nvidia-cuda-nvcc-cu12>=12,<13") ;;
  13) WHEELS=("nvidia-cuda-runtime>=13,<14" "nvidia-cuda-crt>=13,<14") ;;
  *) echo "check_cuda_build: CUDA major $MAJOR is not supported (12 or 13)" >&2; exit 2 ;;
esac
CACHE="${MEMPLAN_CUDA_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/memplan/cuda-wheels}/cu$MAJOR"
# A runtime already installed (a CUDA build of torch brings its wheels; a toolkit at CUDA_HOME or /usr/local/cuda)
# needs no download: GPU machines are often offline.
if PYTHONPATH="$PWD" "$PY" -c 'import sys; from agent.allocator.build import find_cuda_runtime; find_cuda_runtime(int(sys.argv[1]))' "$MAJOR" 2>/dev/null; then
  echo "check_cuda_build: using the CUDA $MAJOR runtime already installed"
  CACHE=""
elif [[ ! -f "$CACHE/.complete" ]]; then
  echo "check_cuda_build: installing ${WHEELS[*]} into $CACHE"
  rm -rf "$CACHE" && mkdir -p "$CACHE"
  "$PY" -m pip install --quiet --no-deps --target "$CACHE" "${WHEELS[@]}"
  # CUDA 12 takes crt/ from the nvcc wheel: keep its headers, drop the compiler (~100 MB)
  if [[ -d "$CACHE/nvidia/cuda_nvcc" ]]; then
    find "$CACHE/nvidia/cuda_nvcc" -mindepth 1 -maxdepth 1 ! -name include ! -name __init__.py -exec rm -rf {} +
  fi
  touch "$CACHE/.complete"
fi
OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT
MEMPLAN_CUDA_WHEELS="$CACHE" PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" "$PY" -c \
  'import sys; from agent.allocator.build import main; sys.exit(main(sys.argv[1:]))' \
  --cuda-major "$MAJOR" --output "$OUT/libmemplan_alloc_cuda.so"
SYMS="$(nm -D --defined-only "$OUT/libmemplan_alloc_cuda.so" | awk '$2 == "T" {print $3}')"
MISSING=0
for sym in $("$PY" -c 'from agent.allocator.build import CUDA_EXPORTS; print(" ".join(CUDA_EXPORTS))'); do
  if ! grep -qx "$sym" <<<"$SYMS"; then echo "check_cuda_build: $sym is not exported" >&2; MISSING=1; fi
done
if nm -D --defined-only "$OUT/libmemplan_alloc_cuda.so" | awk '{print $3}' | grep -q '^cuda'; then
  echo "check_cuda_build: the library defines CUDA runtime symbols (a fake runtime was linked in)" >&2; MISSING=1
fi
NEEDED="$(readelf -d "$OUT/libmemplan_alloc_cuda.so" | grep -o 'libcudart\.so\.[0-9]*' || true)"
if [[ "$NEEDED" != "libcudart.so.$MAJOR" ]]; then
  echo "check_cuda_build: expected a dependency on libcudart.so.$MAJOR, found '${NEEDED:-none}'" >&2; MISSING=1
fi
[[ $MISSING == 0 ]] || exit 1
echo "check_cuda_build: OK (CUDA $MAJOR; exports ${SYMS//$'\n'/ })"
