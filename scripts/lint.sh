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

check "ruff check" "${bin}ruff" check agent client planner_service benchmarks tests
check "ruff format" "${bin}ruff" format --check --output-format concise agent client planner_service benchmarks tests
check "mypy" "${bin}mypy" agent client planner_service

if [ "${#failed[@]}" -gt 0 ]; then
    echo "lint: failed: ${failed[*]}" >&2
    exit 1
fi
echo "lint: all checks passed"
