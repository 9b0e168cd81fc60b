#!/usr/bin/env bash
# Installs Chromium (Debian's `chromium` package) for the dashboard's browser test, when
# /usr/bin/chromium is missing. Idempotent: does nothing when it is there. Needs root (CI runs
# as root) or sudo. `apt-get update` runs only when the install fails without it.
set -euo pipefail
exe=${LEASEHOLD_CHROMIUM:-/usr/bin/chromium}
if [ -x "$exe" ]; then
  echo "chromium already installed ($("$exe" --version 2>/dev/null | head -n 1))"
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "install-chromium: $exe is missing and there is no apt-get here; install Chromium and set LEASEHOLD_CHROMIUM" >&2
  exit 1
fi
sudo=""
if [ "$(id -u)" != 0 ]; then
  command -v sudo >/dev/null 2>&1 || { echo "install-chromium: run as root (apt-get install chromium)" >&2; exit 1; }
  sudo=sudo
fi
export DEBIAN_FRONTEND=noninteractive
install() { $sudo apt-get install -y -q --no-install-recommends chromium; }
echo "installing chromium (Debian package)..."
if ! install; then
  echo "install-chromium: the install failed; updating the package lists and trying again"
  $sudo apt-get update -q
  install
fi
[ -x "$exe" ] || { echo "install-chromium: chromium installed but $exe is missing" >&2; exit 1; }
echo "chromium installed ($("$exe" --version 2>/dev/null | head -n 1))"
