#!/usr/bin/env bash
# Set everything up and run the whole test suite (what CI runs). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
./scripts/ensure_postgres.sh
./scripts/ensure_chromium.sh
# static checks: ruff (lint and format), mypy, the import layers, the reasons of imports inside functions
./scripts/lint.sh
# the planned allocator's CUDA backend compiles against the CUDA runtime headers (no GPU needed)
./scripts/check_cuda_build.sh
# one pytest worker per core, at most 4 (pytest-xdist; a file's tests stay on one worker, so its module
# fixtures are built once); MEMPLAN_TEST_WORKERS=0 runs everything in this process. pytest-benchmark (present in
# some system site-packages, unused here) is kept out: under xdist it only warns that it is disabled
workers=${MEMPLAN_TEST_WORKERS:-$(($(nproc) < 4 ? $(nproc) : 4))}
exec .venv/bin/python -m pytest -q -p no:cacheprovider -p no:benchmark -n "$workers" --dist loadfile "$@"
