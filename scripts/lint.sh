#!/usr/bin/env bash
# Static checks (CI runs this). Each check is one line; the first failure stops the script.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${MEMPLAN_VENV:-.venv}/bin

# Import layers (.importlinter): client imports neither agent nor planner_service; planner_service never imports
# agent; memplan (the command's composition root) sits on top. PYTHONPATH: this tree's code, whatever the venv links.
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" "$BIN/lint-imports" --no-cache .importlinter
