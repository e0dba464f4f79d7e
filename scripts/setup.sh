#!/usr/bin/env bash
# Set up memplan in ./.venv: Python >= 3.11, torch (an existing install is reused; else torch==2.13.0),
# then the project and its test tools. Safe to run again: it only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "memplan needs Python >= 3.11 (found $("$PY" --version 2>&1)); set PYTHON=/path/to/python3.11" >&2
  exit 1
fi
if [ ! -x .venv/bin/python ]; then
  # --system-site-packages: a machine with torch preinstalled (e.g. a CUDA build) keeps using it.
  "$PY" -m venv --system-site-packages .venv
fi
VPY=.venv/bin/python
if ! "$VPY" -c 'import torch' 2>/dev/null; then
  echo "installing torch==2.13.0"
  "$VPY" -m pip install -q "torch==2.13.0"
fi
stamp=.venv/.memplan-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  "$VPY" -m pip install -q -e ".[dev]"
  touch "$stamp"
fi
"$VPY" -c 'import torch, client, planner_service, agent, memplan; print(f"memplan ready: torch {torch.__version__}, cuda available: {torch.cuda.is_available()}")'
./scripts/link_memplan.sh
