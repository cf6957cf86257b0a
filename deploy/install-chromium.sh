#!/usr/bin/env bash
# Makes a headless-capable Chromium available (the gateway board's browser
# test drives it) and prints its path on stdout.
#
# Uses TENURE_CHROMIUM or a chromium already on PATH; otherwise installs
# Debian's `chromium` package with apt-get (as root, or through sudo).
#
# Use:  export TENURE_CHROMIUM="$(deploy/install-chromium.sh)"
set -euo pipefail

if [ -n "${TENURE_CHROMIUM:-}" ] && [ -x "$TENURE_CHROMIUM" ]; then
  echo "$TENURE_CHROMIUM"; exit 0
fi
for name in chromium chromium-browser google-chrome; do
  if command -v "$name" >/dev/null 2>&1; then
    command -v "$name"; exit 0
  fi
done

echo "installing Debian's chromium (no chromium on PATH)..." >&2
sudo=""
if [ "$(id -u)" != 0 ]; then
  if ! command -v sudo >/dev/null 2>&1; then
    echo "error: chromium is needed for the board's browser test: apt-get install chromium (as root)" >&2
    exit 1
  fi
  sudo="sudo"
fi
$sudo apt-get update -qq >&2
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq chromium >&2
if ! command -v chromium >/dev/null 2>&1; then
  echo "error: apt-get installed chromium but it is not on PATH" >&2
  exit 1
fi
command -v chromium
