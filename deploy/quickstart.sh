#!/usr/bin/env bash
# Builds tenure, starts a local cluster (`tenure dev`: nats-server, a
# coordinator, two workers with their sidecars), runs a real shell task on it,
# shows its output as it streams and its outcome, then stops the cluster.
set -euo pipefail
cd "$(dirname "$0")/.."
step() { printf '\n\033[1m==> %s\033[0m\n' "$*"; }

step "nats-server"
nats="$(deploy/install-nats.sh)"
export PATH="$(dirname "$nats"):$PATH"
"$nats" --version

step "building tenure (cargo build; the first build takes a few minutes)"
cargo build --bin tenure --bin tenure-shim
tenure="$PWD/target/debug/tenure"

port="${TENURE_QUICKSTART_PORT:-4222}"
while (echo >"/dev/tcp/127.0.0.1/$port") 2>/dev/null; do port=$((port + 1)); done
data="$PWD/.tenure-dev/quickstart"
mkdir -p "$data"
rm -f "$data/dev.env"

step "starting a local cluster on 127.0.0.1:$port (data and logs in $data)"
"$tenure" dev --data-dir "$data" --nats-port "$port" --workers 2 >"$data.log" 2>&1 &
dev_pid=$!
trap 'kill -TERM $dev_pid 2>/dev/null || true; wait $dev_pid 2>/dev/null || true' EXIT
for _ in $(seq 1 150); do
  # The cluster is secured: dev.env holds alice's credentials (one of the
  # users `tenure dev` creates), written once the cluster is up.
  if [ -f "$data/dev.env" ]; then
    set -a; . "$data/dev.env"; set +a
    if "$tenure" status 2>/dev/null | grep -q ' yes '; then break; fi
  fi
  if ! kill -0 $dev_pid 2>/dev/null; then cat "$data.log"; exit 1; fi
  sleep 0.2
done
echo "acting as $TENURE_NATS_USER (set -a; . $data/dev.env; set +a)"
"$tenure" status

step "submitting: sh -c 'for i in 1 2 3; do echo line-\$i; sleep 0.2; done'"
task="$("$tenure" submit -- sh -c 'for i in 1 2 3; do echo line-$i; sleep 0.2; done')"
echo "task id: $task"

step "tenure logs --follow $task"
"$tenure" logs --follow "$task"

step "tenure wait $task"
"$tenure" wait "$task"

step "stopping the cluster"
kill -TERM $dev_pid
wait $dev_pid || true
trap - EXIT
echo
echo "done. Run your own cluster with:  $tenure dev   (Ctrl-C stops it)"
