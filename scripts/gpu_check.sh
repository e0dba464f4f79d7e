#!/usr/bin/env bash
# One command for a user with an NVIDIA GPU: runs the CUDA checks, tests and GPU benchmarks and writes one
# report (gpu_check.md + gpu_check.json, with the benchmark result files) to attach to a bug report.
#   scripts/gpu_check.sh [--out DIR] [--device cuda:0] [--quick] [--dry-run]
# See scripts/gpu_check.py for the steps. Env: PYTHON (default .venv/bin/python, else python3).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-}"
if [[ -z "$PY" ]]; then
  if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
exec "$PY" scripts/gpu_check.py --python "$PY" "$@"
