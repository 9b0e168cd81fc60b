#!/usr/bin/env bash
# Runs Leasehold locally: installs and starts Azurite (in memory, default ports 10000/10001),
# builds the binary, runs `leasehold serve` with the demo logic (or your LEASEHOLD_LOGIC_COMMAND /
# LEASEHOLD_LOGIC_URL), prints a curl to try, and stops everything on Ctrl-C.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

port=${LEASEHOLD_PORT:-7071}
blob_port=${AZURITE_BLOB_PORT:-10000}
queue_port=${AZURITE_QUEUE_PORT:-10001}
table_port=${AZURITE_TABLE_PORT:-10002}
state="$root/.azurite"
mkdir -p "$state"

for p in "$blob_port" "$queue_port" "$port"; do
  if (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null; then
    echo "dev.sh: port $p is already in use (another Azurite or leasehold?). Stop it, or set" >&2
    echo "        AZURITE_BLOB_PORT / AZURITE_QUEUE_PORT / LEASEHOLD_PORT." >&2
    exit 1
  fi
done

scripts/install-azurite.sh
echo "building leasehold..."
cargo build --locked -p leasehold --quiet

pids=()
cleanup() {
  trap - INT TERM EXIT
  echo
  echo "stopping..."
  # Leasehold first (it hands its runs back and releases their leases, which needs storage),
  # then Azurite.
  for ((i = ${#pids[@]} - 1; i >= 0; i--)); do
    kill -TERM "${pids[i]}" 2>/dev/null || true
    wait "${pids[i]}" 2>/dev/null || true
  done
  echo "stopped."
}
trap cleanup INT TERM EXIT

# In a session of its own, so a Ctrl-C at the terminal reaches leasehold only: Azurite must
# outlive it while it shuts down; the cleanup above stops it last.
(cd "$state" && exec setsid "$root/tools/azurite/node_modules/.bin/azurite" --inMemoryPersistence --silent \
  --disableTelemetry --skipApiVersionCheck \
  --blobPort "$blob_port" --queuePort "$queue_port" --tablePort "$table_port") >"$state/azurite.log" 2>&1 &
pids+=($!)
for _ in $(seq 1 100); do
  (exec 3<>"/dev/tcp/127.0.0.1/$queue_port") 2>/dev/null && break
  sleep 0.2
done
echo "azurite: blob 127.0.0.1:$blob_port, queue 127.0.0.1:$queue_port (log: .azurite/azurite.log)"

export AzureWebJobsStorage="DefaultEndpointsProtocol=http;AccountName=devstoreaccount1;AccountKey=Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw==;BlobEndpoint=http://127.0.0.1:$blob_port/devstoreaccount1;QueueEndpoint=http://127.0.0.1:$queue_port/devstoreaccount1;"
export LEASEHOLD_PORT="$port"
# The dashboard, with a key made for this session (or yours in LEASEHOLD_ADMIN_KEY).
export LEASEHOLD_ADMIN_KEY=${LEASEHOLD_ADMIN_KEY:-dev-$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')}
"$root/target/debug/leasehold" serve --demo &
pids+=($!)
for _ in $(seq 1 100); do
  curl -fsS "http://127.0.0.1:$port/healthz" >/dev/null 2>&1 && break
  sleep 0.2
done

cat <<MSG

Leasehold is running (Ctrl-C stops it). Try:

  curl -i -X POST http://127.0.0.1:$port/api/start -H 'Content-Type: application/json' \\
       -d '{"scope": "account", "recordId": "8f9c1d2e-0000-4000-8000-000000000001"}'

and look at it:

  dashboard  http://127.0.0.1:$port/admin   (key: $LEASEHOLD_ADMIN_KEY)
  or, from another shell:
  AzureWebJobsStorage='$AzureWebJobsStorage' \
    target/debug/leasehold status

MSG
wait "${pids[1]}"
