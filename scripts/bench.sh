#!/usr/bin/env bash
# Runs the benchmark suite (Leasehold vs the seed design vs raw storage) on its own Azurite and
# writes the report (default target/bench/leasehold-bench.md; --out FILE to change, --smoke for
# a quick run). Takes a few minutes in full mode.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
scripts/install-azurite.sh
cargo build --release --locked -q -p leasehold -p leasehold-bench
LEASEHOLD_BIN="$root/target/release/leasehold" exec "$root/target/release/leasehold-bench" "$@"
