#!/usr/bin/env bash
# Builds the release binary for the Linux images Azure Functions runs and packs the deployment zip:
#   host.json, leasehold (executable), Start/, Worker/, Ops/ and Dashboard/function.json
#
# glibc: a binary linked on this machine (Debian 12, glibc 2.36) needs GLIBC_2.34 and would not
# start on older images. We link against glibc 2.28 with cargo-zigbuild (zig from PyPI), which
# runs on every current Functions Linux image (Debian 10 and later). Both tools are pinned and
# installed here if missing.
#
# Usage: scripts/package.sh [--logic DIR] [OUTPUT_DIR]   (default target/package; prints the zip's path)
#   --logic DIR   also pack DIR's files under logic/ (mode bits kept), so the Function App's
#                 LEASEHOLD_LOGIC_COMMAND can name them relative to the app root (logic/run.sh).
#                 Dotfiles, dot-folders (.env, .git/) and local.settings.json are left out, and
#                 said so; a symbolic or hard link is refused (it could pack a file from
#                 anywhere): copy the file in. DIR itself is taken as the folder it resolves to.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
logic=""
args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --logic) [ $# -ge 2 ] || { echo "package.sh: --logic needs a directory" >&2; exit 2; }
             logic=$(cd "$2" 2>/dev/null && pwd -P) || { echo "package.sh: --logic $2: no such directory" >&2; exit 2; }
             shift 2 ;;
    --logic=*) d=${1#--logic=}; logic=$(cd "$d" 2>/dev/null && pwd -P) || { echo "package.sh: --logic $d: no such directory" >&2; exit 2; }
             shift ;;
    -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
    *) args+=("$1"); shift ;;
  esac
done
cd "$root"
out=${args[0]:-$root/target/package}
target=x86_64-unknown-linux-gnu
glibc=2.28
zig_version=0.17.1
zigbuild_version=0.24.1

if ! python3 -m ziglang version >/dev/null 2>&1; then
  echo "installing zig $zig_version (PyPI: ziglang)..." >&2
  python3 -m pip install --quiet "ziglang==$zig_version" >&2
fi
if ! cargo zigbuild --help >/dev/null 2>&1; then
  echo "installing cargo-zigbuild $zigbuild_version (crates.io)..." >&2
  cargo install --locked --quiet cargo-zigbuild --version "$zigbuild_version" >&2
fi

echo "building leasehold (release, $target, glibc $glibc)..." >&2
cargo zigbuild --release --locked --quiet -p leasehold --target "$target.$glibc" >&2
bin="$root/target/$target/release/leasehold"

# Refuse a binary that needs a newer glibc than we promise.
needed=$(objdump -T "$bin" | grep -o 'GLIBC_[0-9.]*' | sed 's/GLIBC_//' | sort -t. -k1,1n -k2,2n -u | tail -n 1)
if [ "$(printf '%s\n%s\n' "$needed" "$glibc" | sort -t. -k1,1n -k2,2n | tail -n 1)" != "$glibc" ]; then
  echo "package.sh: the binary needs glibc $needed, more than $glibc" >&2
  exit 1
fi

# The output is emptied first: never when that would delete the logic folder (or the project).
out_real=$(mkdir -p "$out" && cd "$out" && pwd -P)
case "$logic/" in "$out_real"/*) echo "package.sh: the output directory $out holds the --logic folder; choose another" >&2; exit 2 ;; esac
case "$root/" in "$out_real"/*) echo "package.sh: the output directory $out holds the project; choose another" >&2; exit 2 ;; esac
rm -rf "$out"
mkdir -p "$out"
python3 - "$out/leasehold.zip" "$bin" "$logic" <<'PY'
import os, stat, sys, zipfile
zip_path, binary, logic = sys.argv[1], sys.argv[2], sys.argv[3]
entries = [("host.json", "host.json", 0o644),
           ("leasehold", binary, 0o755),
           ("Start/function.json", "Start/function.json", 0o644),
           ("Worker/function.json", "Worker/function.json", 0o644),
           ("WorkerLow/function.json", "WorkerLow/function.json", 0o644),
           ("Ops/function.json", "Ops/function.json", 0o644),
           ("Dashboard/function.json", "Dashboard/function.json", 0o644)]
if logic:
    packed = len(entries)
    left_out, links = [], []
    for folder, dirs, files in os.walk(logic):
        for name in sorted(dirs):
            path = os.path.join(folder, name)
            if name.startswith("."):
                left_out.append(os.path.relpath(path, logic) + "/")
            elif os.path.islink(path):
                links.append(path)
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and not os.path.islink(os.path.join(folder, d)))
        for name in sorted(files):
            path = os.path.join(folder, name)
            if os.path.islink(path):
                links.append(path)
                continue
            if name.startswith(".") or name == "local.settings.json":
                left_out.append(os.path.relpath(path, logic))
                continue
            if not os.path.isfile(path):
                continue
            if os.stat(path).st_nlink > 1:
                links.append(path)
                continue
            rel = os.path.relpath(path, logic).replace(os.sep, "/")
            entries.append(("logic/" + rel, path, stat.S_IMODE(os.stat(path).st_mode)))
    if links:
        sys.exit("package.sh: --logic: refusing to pack a symbolic link or a hard-linked file (it could pack a "
                 "file from anywhere, a key under ~/.ssh included); copy the file into the folder instead: "
                 + ", ".join(f"{p} -> {os.readlink(p)}" if os.path.islink(p) else f"{p} (hard link)" for p in links))
    if left_out:
        print("package.sh: --logic: dotfiles, dot-folders and local.settings.json are left out (they hold secrets "
              "and version-control data; rename a file to pack it): " + ", ".join(left_out), file=sys.stderr)
    if len(entries) == packed:
        sys.exit(f"package.sh: --logic {logic} holds no files")
with zipfile.ZipFile(zip_path, "w", zipfile.ZIP_DEFLATED) as z:
    for name, source, mode in entries:
        info = zipfile.ZipInfo(name, date_time=(2026, 1, 1, 0, 0, 0))
        info.external_attr = (0o100000 | mode) << 16  # regular file + permissions, kept by unzip
        info.create_system = 3  # Unix, so the permissions are honoured
        info.compress_type = zipfile.ZIP_DEFLATED
        with open(source, "rb") as f:
            z.writestr(info, f.read())
PY
echo "$out/leasehold.zip (binary needs glibc >= $needed)${logic:+; logic from $logic under logic/}" >&2
echo "$out/leasehold.zip"
