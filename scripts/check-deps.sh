#!/usr/bin/env bash
# Supply chain: licenses, banned crates (the legacy SDK, versions with known advisories) and
# sources, from deny.toml, offline. Advisories too, when the RustSec database can be fetched
# (it lives on GitHub; say so and go on when it cannot be reached).
# Installs cargo-deny (pinned) with `cargo install` if it is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
version=0.20.2
if ! cargo deny --version 2>/dev/null | grep -q " $version"; then
  echo "installing cargo-deny $version (a few minutes, once)"
  cargo install --locked --quiet cargo-deny --version "$version"
fi
cargo deny --offline check licenses bans sources
if timeout 120 cargo deny fetch db >/dev/null 2>&1; then
  cargo deny check --disable-fetch advisories
else
  echo "check-deps: the RustSec advisory database cannot be fetched from here; advisories not checked"
fi
