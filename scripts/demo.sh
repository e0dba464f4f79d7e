#!/usr/bin/env bash
# Set everything up and run the main job on the embedded default (SQLite, in-process solver).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
exec .venv/bin/memplan demo "$@"
