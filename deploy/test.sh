#!/usr/bin/env bash
# The whole test suite: formatting, lints, and every test (unit, pure-core
# tables and properties, and integration tests that start their own
# nats-server on a free loopback port and the real tenure binaries).
set -euo pipefail
cd "$(dirname "$0")/.."
nats="$(deploy/install-nats.sh)"
export PATH="$(dirname "$nats"):$PATH"
echo "== nats-server: $("$nats" --version)"
# The gateway board's browser test fails (never skips) without a browser.
TENURE_CHROMIUM="$(deploy/install-chromium.sh)"
export TENURE_CHROMIUM
echo "== chromium: $("$TENURE_CHROMIUM" --version 2>/dev/null || echo "$TENURE_CHROMIUM")"
# The client libraries' suites and the MCP suite (cli/tests/clients.rs) need
# python3 with pytest, httpx and the MCP SDK (installed into .tools/python when
# missing) and node >= 18.
deploy/install-client-test-deps.sh >/dev/null
echo "== clients: $(python3 --version), node $(node --version)"
echo "== cargo fmt --check"
cargo fmt --all -- --check
echo "== cargo clippy --all-targets -- -D warnings"
cargo clippy --workspace --all-targets --quiet -- -D warnings
echo "== tests"
if cargo nextest --version >/dev/null 2>&1; then
  cargo nextest run --workspace --test-threads 2 --no-fail-fast
else
  cargo test --workspace --no-fail-fast -- --test-threads 2
fi
