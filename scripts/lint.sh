#!/usr/bin/env bash
# Static checks, one independent command each: every one runs, and the script fails if any failed.
# Run from anywhere: ./scripts/lint.sh (uses .venv/bin when present, else the tools on PATH).
set -uo pipefail
cd "$(dirname "$0")/.."
bin=".venv/bin/"
[ -x "${bin}ruff" ] || bin=""
failed=()

check() {  # check NAME COMMAND...: run one check, remember it when it fails
    local name="$1"; shift
    echo "== ${name}: $*"
    if ! "$@"; then failed+=("${name}"); fi
}

check "ruff check" "${bin}ruff" check agent client planner_service memplan benchmarks tests
check "ruff format" "${bin}ruff" format --check --output-format concise agent client planner_service memplan benchmarks tests
check "mypy" "${bin}mypy" agent client planner_service memplan
# import layers (.importlinter): client imports neither agent nor planner_service; planner_service never
# imports agent; memplan (the command's composition root) sits on top. PYTHONPATH: this tree's code.
check "import layers" env PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" "${bin}lint-imports" --no-cache .importlinter
# imports inside functions: each at the module top, or with `# local import: <reason>` (scripts/check_local_imports.py)
check "local imports" "${bin}python" scripts/check_local_imports.py

if [ "${#failed[@]}" -gt 0 ]; then
    echo "lint: failed: ${failed[*]}" >&2
    exit 1
fi
echo "lint: all checks passed"
