#!/usr/bin/env bash
# Makes what the client libraries' tests need available and prints the
# folder to put on PYTHONPATH on stdout.
#
# The Python client's tests need pytest and httpx, and the MCP tests (and the
# agent-harness example) the official MCP Python SDK (`mcp`): when python3
# cannot import them, they are installed with pip into .tools/python (ignored
# by git), never into the system's Python. The TypeScript client's tests need node >= 18 (its
# built-in test runner and fetch): when node is missing or older, Debian's
# nodejs is installed with apt-get (as root, or through sudo).
#
# Use:  export TENURE_PYTHONPATH="$(deploy/install-client-test-deps.sh)"
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
target="$root/.tools/python"

python="$(command -v python3 || true)"
if [ -z "$python" ]; then
  echo "error: python3 (>= 3.9) with pip is needed for the Python client's tests: apt-get install python3 python3-pip" >&2
  exit 1
fi
# The MCP SDK's major version is pinned: its client API is what the tests use;
# openapi-python-client is the stock generator the gateway's document is fed to.
packages=("pytest>=7" "httpx>=0.24" "mcp>=2.3,<3" "openapi-python-client>=0.28,<1")
if ! PYTHONPATH="$target${PYTHONPATH:+:$PYTHONPATH}" "$python" -c 'import pytest, httpx, mcp, openapi_python_client' >/dev/null 2>&1; then
  echo "installing pytest, httpx, mcp and openapi-python-client into .tools/python..." >&2
  if ! "$python" -m pip --version >/dev/null 2>&1; then
    echo "error: pip is needed to install pytest, httpx and mcp: apt-get install python3-pip" >&2
    exit 1
  fi
  # --target keeps the install inside the project; on distributions that mark
  # the system Python as externally managed, that is still allowed with the flag below.
  if ! "$python" -m pip install --quiet --upgrade --target "$target" "${packages[@]}" >&2; then
    "$python" -m pip install --quiet --upgrade --break-system-packages --target "$target" "${packages[@]}" >&2
  fi
  PYTHONPATH="$target" "$python" -c 'import pytest, httpx, mcp, openapi_python_client' >&2
fi

node_major() { node --version 2>/dev/null | sed -n 's/^v\([0-9]*\).*/\1/p'; }
if ! command -v node >/dev/null 2>&1 || [ "$(node_major)" -lt 18 ]; then
  echo "installing Debian's nodejs (no node >= 18 on PATH)..." >&2
  sudo=""
  if [ "$(id -u)" != 0 ]; then
    if ! command -v sudo >/dev/null 2>&1; then
      echo "error: node >= 18 is needed for the TypeScript client's tests: apt-get install nodejs (as root)" >&2
      exit 1
    fi
    sudo="sudo"
  fi
  $sudo apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq nodejs >&2
  if ! command -v node >/dev/null 2>&1 || [ "$(node_major)" -lt 18 ]; then
    echo "error: node >= 18 is needed for the TypeScript client's tests; apt-get gave $(node --version 2>/dev/null || echo none)" >&2
    exit 1
  fi
fi
echo "$target"
