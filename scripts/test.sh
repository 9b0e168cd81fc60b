#!/usr/bin/env bash
# The test command: installs what the tests need (pinned Azurite from npm; Chromium from Debian
# for the dashboard's browser test), then runs every test.
# Integration tests start their own Azurite on free ports; nothing else needs to be running.
# Extra arguments go to `cargo test` (e.g. scripts/test.sh -p leasehold-lock).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
scripts/install-azurite.sh
scripts/install-chromium.sh
# Every package, unless the arguments name some (before any `--`).
scope=(--workspace)
for arg in "$@"; do
  case "$arg" in
    --) break ;;
    -p|-p*|--package|--package=*) scope=() ;;
  esac
done
cargo test "${scope[@]}" --locked "$@"
