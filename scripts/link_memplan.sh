#!/usr/bin/env bash
# Put the `memplan` command on PATH after set-up: link .venv/bin/memplan into ~/.local/bin (MEMPLAN_BIN_DIR to
# choose another directory) when that directory is on PATH; otherwise print the one line that adds it.
# Called by scripts/setup.sh; safe to run again (an existing link is replaced, another file is left alone).
set -euo pipefail
cd "$(dirname "$0")/.."
target="$PWD/.venv/bin/memplan"
bin_dir=${MEMPLAN_BIN_DIR:-$HOME/.local/bin}
if [[ ":$PATH:" == *":$bin_dir:"* ]]; then
  link="$bin_dir/memplan"
  if [ -e "$link" ] && [ ! -L "$link" ]; then
    echo "memplan: $link exists and is not a link; left alone (run $target, or remove it and set up again)"
    exit 0
  fi
  mkdir -p "$bin_dir"
  ln -sfn "$target" "$link"
  echo "memplan: the command is on PATH ($link -> $target)"
else
  echo "memplan: to run the command from anywhere, add this line to your shell profile:"
  echo "  export PATH=\"$PWD/.venv/bin:\$PATH\""
fi
