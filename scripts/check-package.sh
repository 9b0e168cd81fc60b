#!/usr/bin/env bash
# CI check of the deployment package: builds it, checks the zip's layout and execute bit, and
# starts the packaged binary exactly as the Functions host would (host.json's executable and
# arguments, FUNCTIONS_CUSTOMHANDLER_PORT) until it answers the readiness probe GET /.
# Also checks that scripts/deploy.sh --dry-run prints a full deployment, and its Dataverse
# registration step when the parameters name a CRM (and not otherwise, nor with --no-register).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
zip=$(scripts/package.sh "$root/target/package")
work=$(mktemp -d)
# Stop the handler we start (and wait for it) however this script ends.
trap '[ -n "${pid:-}" ] && { kill "$pid" 2>/dev/null; wait "$pid" 2>/dev/null; }; rm -rf "$work"; true' EXIT

python3 - "$zip" <<'PY'
import sys, zipfile, stat
z = zipfile.ZipFile(sys.argv[1])
names = sorted(z.namelist())
want = sorted(["host.json", "leasehold", "Start/function.json", "Worker/function.json"])
assert names == want, f"zip holds {names}, expected {want}"
mode = z.getinfo("leasehold").external_attr >> 16
assert mode & stat.S_IXUSR, f"leasehold is not executable in the zip (mode {oct(mode)})"
print(f"zip layout ok: {names}; leasehold mode {oct(mode & 0o777)}")
PY
unzip -q "$zip" -d "$work/app"
[ -x "$work/app/leasehold" ] || { echo "check-package: the execute bit did not survive unzip" >&2; exit 1; }

exe=$(python3 -c 'import json,sys; d=json.load(open(sys.argv[1]))["customHandler"]["description"]; print(d["defaultExecutablePath"]); print(" ".join(d.get("arguments", [])))' "$work/app/host.json")
path=$(echo "$exe" | sed -n 1p)
args=$(echo "$exe" | sed -n 2p)
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
start=$(date +%s%N)
# `exec`, so $! is the handler itself, not a subshell that would outlive a kill.
(cd "$work/app" && exec env -i PATH="$PATH" FUNCTIONS_CUSTOMHANDLER_PORT="$port" FUNCTIONS_WORKER_RUNTIME=custom \
  AzureWebJobsStorage=UseDevelopmentStorage=true LEASEHOLD_LOGIC_COMMAND=true LEASEHOLD_QUEUE=leasehold-triggers \
  "./$path" $args >"$work/handler.log" 2>&1) &
pid=$!
for _ in $(seq 1 300); do
  if curl -fsS "http://127.0.0.1:$port/" >/dev/null 2>&1; then
    ready_ms=$(( ($(date +%s%N) - start) / 1000000 ))
    echo "packaged handler answered GET / on port $port after ${ready_ms} ms (the host allows 30 s)"
    break
  fi
  kill -0 "$pid" 2>/dev/null || { echo "check-package: the handler exited:" >&2; cat "$work/handler.log" >&2; exit 1; }
  sleep 0.1
done
[ -n "${ready_ms:-}" ] || { echo "check-package: no answer to GET / within 30 s" >&2; cat "$work/handler.log" >&2; exit 1; }

plan=$(scripts/deploy.sh prod --dry-run)
for expect in "az group create" "az deployment group create" "deploy/parameters/prod.json" "config-zip"; do
  echo "$plan" | grep -q -- "$expect" || { echo "check-package: deploy.sh --dry-run lacks '$expect'" >&2; exit 1; }
done
# Every plan the template offers deploys the same way, with the plan passed to the template.
for sku in FC1 EP1 Y1; do
  plan=$(scripts/deploy.sh dev --plan "$sku" --dry-run)
  for expect in "planSku=$sku" "deploy/parameters/dev.json" "config-zip"; do
    echo "$plan" | grep -q -- "$expect" || { echo "check-package: deploy.sh dev --plan $sku --dry-run lacks '$expect'" >&2; exit 1; }
  done
done
scripts/deploy.sh dev --plan B1 --dry-run >/dev/null 2>&1 && { echo "check-package: deploy.sh accepted an unknown plan" >&2; exit 1; }
# The registration step: shown when the parameters name a Dataverse environment, the key redacted.
plan=$(scripts/deploy.sh dev --dry-run)
echo "$plan" | grep -q "dataverse register" && { echo "check-package: deploy.sh registers without a Dataverse environment in dev.json" >&2; exit 1; }
python3 - "$work/dev-crm.json" <<'PY'
import json, sys
d = json.load(open("deploy/parameters/dev.json"))
d["leasehold"]["dataverse"]["environmentUrl"] = "https://contoso-dev.crm4.dynamics.com"
d["leasehold"]["dataverse"]["registrations"] = [
    {"table": "account", "messages": ["Create", "Update"], "filteringAttributes": ["name", "statuscode"]},
    {"table": "contact", "messages": ["Create"]}]
json.dump(d, open(sys.argv[1], "w"))
PY
plan=$(LEASEHOLD_PARAMETERS="$work/dev-crm.json" scripts/deploy.sh dev --dry-run)
for expect in "# 6. Dataverse: register Start as the webhook of https://contoso-dev.crm4.dynamics.com" \
  "az functionapp function keys list --resource-group rg-leasehold-dev --name func-leaseholddev --function-name Start" \
  "<redacted>" \
  "dataverse register --environment-url https://contoso-dev.crm4.dynamics.com --start-url \"\$START_URL\" --table account --messages Create\\,Update --filtering-attributes name\\,statuscode" \
  "--table contact --messages Create"; do
  echo "$plan" | grep -qF -- "$expect" || { echo "check-package: deploy.sh dev --dry-run (with a CRM) lacks '$expect':" >&2; echo "$plan" >&2; exit 1; }
done
[ "$(echo "$plan" | tail -n 1 | grep -c 'dataverse register')" = 1 ] || { echo "check-package: the registration is not deploy.sh's last step" >&2; exit 1; }
plan=$(LEASEHOLD_PARAMETERS="$work/dev-crm.json" scripts/deploy.sh dev --dry-run --no-register)
echo "$plan" | grep -q "dataverse register" && { echo "check-package: deploy.sh --no-register still registers" >&2; exit 1; }
echo "deploy.sh --dry-run ok (prod; dev on FC1, EP1 and Y1; the Dataverse registration with a CRM, none without or with --no-register)"
echo "check-package: all checks passed"
