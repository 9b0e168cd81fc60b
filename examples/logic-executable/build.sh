#!/usr/bin/env bash
# Builds the example logic for the Functions Linux images (glibc 2.28, as scripts/package.sh
# builds leasehold itself) into examples/logic-executable/dist/sync-record.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
target=x86_64-unknown-linux-gnu
if cargo zigbuild --help >/dev/null 2>&1 && python3 -m ziglang version >/dev/null 2>&1; then
  cargo zigbuild --release --locked --quiet -p leasehold --example logic-executable --target "$target.2.28" >&2
  bin="$root/target/$target/release/examples/logic-executable"
else
  echo "build.sh: cargo-zigbuild not found (scripts/package.sh installs it); building for this machine's glibc" >&2
  cargo build --release --locked --quiet -p leasehold --example logic-executable >&2
  bin="$root/target/release/examples/logic-executable"
fi
mkdir -p examples/logic-executable/dist
cp "$bin" examples/logic-executable/dist/sync-record
echo "examples/logic-executable/dist/sync-record"
