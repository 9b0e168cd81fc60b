#!/usr/bin/env bash
# Installs the pinned Azurite (tools/azurite/package-lock.json) from the npm registry.
# Idempotent: does nothing when the pinned version is already installed.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dir="$root/tools/azurite"
want=$(node -p "require('$dir/package-lock.json').packages['node_modules/azurite'].version")
have=$(node -p "try { require('$dir/node_modules/azurite/package.json').version } catch (e) { '' }" 2>/dev/null || true)
if [ "$have" = "$want" ] && [ -x "$dir/node_modules/.bin/azurite" ]; then
  echo "azurite $have already installed"
  exit 0
fi
echo "installing azurite $want from the npm registry (tools/azurite)..."
npm ci --prefix "$dir" --no-audit --no-fund --loglevel=error
echo "azurite $("$dir/node_modules/.bin/azurite" --version) installed"
