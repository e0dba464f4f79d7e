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
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
