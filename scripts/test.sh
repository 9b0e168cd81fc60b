#!/usr/bin/env bash
# The test command: installs what the tests need (pinned Azurite from npm; Chromium from Debian
# for the dashboard's browser test), then runs every test.
# Integration tests start their own Azurite on free ports; nothing else needs to be running.
# Extra arguments go to `cargo test` (e.g. scripts/test.sh -p leasehold-lock), which then runs
# them as it always does.
#
# Without arguments, every test binary is built once and the binaries run two at a time (each in
# its package's directory, as `cargo test` runs it): most of them wait on Azurite, processes and
# timers rather than on the CPU, so two at once take about half the time. Each binary's output is
# kept and printed whole if it fails; the doctests run after them.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
scripts/install-azurite.sh
scripts/install-chromium.sh
if [ "$#" -gt 0 ]; then
  # Every package, unless the arguments name some (before any `--`).
  scope=(--workspace)
  for arg in "$@"; do
    case "$arg" in
      --) break ;;
      -p|-p*|--package|--package=*) scope=() ;;
    esac
  done
  exec cargo test "${scope[@]}" --locked "$@"
fi

target=${CARGO_TARGET_DIR:-$root/target}
logs="$target/test-logs"
rm -rf "$logs"
mkdir -p "$logs"
# The test executables and their packages' directories, from cargo's own account of the build
# (read by Node.js, which the tests need anyway for Azurite).
cargo test --workspace --locked --no-run --message-format=json-render-diagnostics >"$logs/build.json"
node -e '
  const lines = require("fs").readFileSync(process.argv[1], "utf8").split("\n");
  for (const line of lines) {
    if (!line.startsWith("{")) continue;
    const m = JSON.parse(line);
    if (m.reason === "compiler-artifact" && m.executable && m.profile && m.profile.test) {
      const dir = require("path").dirname(m.manifest_path);
      console.log(`${m.executable}\t${dir}\t${m.target.name}`);
    }
  }
' "$logs/build.json" | sort -u >"$logs/binaries.tsv"
# The longest first, so the two lanes end together (the simulation, then the app's processes).
order() {
  case "$3" in
    runtime) echo "0	$*" ;;
    operate|app) echo "1	$*" ;;
    dashboard|lock) echo "2	$*" ;;
    *) echo "3	$*" ;;
  esac
}
mapfile -t binaries < <(while IFS=$'\t' read -r exe dir name; do order "$exe" "$dir" "$name"; done <"$logs/binaries.tsv" | sort -s -k1,1n | cut -f2-)

pids=()
trap 'for p in "${pids[@]}"; do kill -- "$p" 2>/dev/null || true; done' EXIT
failed=0
# Runs one binary; its exit status is written beside its log.
run_one() {
  local exe=$1 dir=$2 name=$3 log=$4
  local started=$SECONDS status=0
  (cd "$dir" && CARGO_MANIFEST_DIR="$dir" "$exe") >"$log" 2>&1 || status=$?
  echo "$status $((SECONDS - started))" >"$log.status"
}
report() {
  local log=$1 status seconds
  read -r status seconds <"$log.status"
  local summary
  summary=$(grep -E '^test result:' "$log" | tail -1 || true)
  echo "$(basename "$log" .log): ${summary:-no summary} (${seconds} s)"
  if [ "$status" != 0 ]; then
    echo "---- $(basename "$log" .log) failed (exit $status); its output:"
    cat "$log"
    failed=1
  fi
}
running=0
i=0
for line in "${binaries[@]}"; do
  IFS=' ' read -r exe dir name <<<"$line"
  i=$((i + 1))
  log="$logs/$(printf '%02d' "$i")-$name.log"
  run_one "$exe" "$dir" "$name" "$log" &
  pids+=($!)
  running=$((running + 1))
  if [ "$running" -ge 2 ]; then
    wait -n || true
    running=$((running - 1))
  fi
done
wait || true
pids=()
for log in "$logs"/*.log; do
  report "$log"
done
cargo test --workspace --locked --doc
if [ "$failed" != 0 ]; then
  echo "test failures: see above" >&2
  exit 1
fi
echo "every test binary passed"
