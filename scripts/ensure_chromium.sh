#!/usr/bin/env bash
# Make sure a headless-capable Chromium is on PATH (tests/planner_service/ui/test_browser.py renders the history UI with it).
# Uses the installed one when present; otherwise installs Debian's `chromium` package.
set -euo pipefail

for name in chromium chromium-browser google-chrome; do
  if command -v "$name" >/dev/null 2>&1; then echo "$("$name" --version 2>/dev/null || echo "$name") found"; exit 0; fi
done

SUDO=""
if [ "$(id -u)" != 0 ]; then
  if command -v sudo >/dev/null; then SUDO=sudo; else echo "need root (or sudo) to install chromium" >&2; exit 1; fi
fi
echo "installing Chromium (Debian package)"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium fonts-dejavu-core >/dev/null
chromium --version
