#!/usr/bin/env bash
# CI check of the deployment package: builds it, checks the zip's layout and execute bit, and
# starts the packaged binary exactly as the Functions host would (host.json's executable and
# arguments, FUNCTIONS_CUSTOMHANDLER_PORT) until it answers the readiness probe GET /.
# Then packs the example script logic (--logic examples/logic-script), starts that handler from
# another directory against a fresh Azurite, hands it a queue invocation as the host would, and
# checks the packed logic ran for the record (named relative to the app root: logic/run.sh).
# Also checks that scripts/deploy.sh --dry-run prints a full deployment, and its Dataverse
# registration step when the parameters name a CRM (and not otherwise, nor with --no-register).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
zip=$(scripts/package.sh "$root/target/package")
work=$(mktemp -d)
# Stop the handler we start (and wait for it) however this script ends.
trap 'for p in ${pid:-} ${logic_pid:-} ${azurite_pid:-}; do kill "$p" 2>/dev/null; wait "$p" 2>/dev/null; done; rm -rf "$work"; true' EXIT

python3 - "$zip" <<'PY'
import sys, zipfile, stat
z = zipfile.ZipFile(sys.argv[1])
names = sorted(z.namelist())
want = sorted(["host.json", "leasehold", "Start/function.json", "Worker/function.json", "WorkerLow/function.json",
               "Ops/function.json", "Dashboard/function.json"])
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
# The dashboard page, invoked as the host invokes the Dashboard function (it needs no storage).
page=$(curl -fsS -X POST -H 'Content-Type: application/json' \
  -d '{"Data":{"req":{"Url":"https://localhost/api/dashboard","Method":"GET","Headers":{},"Query":{},"Params":{}}},"Metadata":{}}' \
  "http://127.0.0.1:$port/Dashboard")
python3 - "$page" <<'PY'
import json, sys
res = json.loads(sys.argv[1])["Outputs"]["res"]
assert res["statusCode"] == 200, res["statusCode"]
assert res["headers"]["Content-Security-Policy"].startswith("default-src 'none'"), res["headers"]
assert 'content="x-leasehold-admin-key"' in res["body"], "the page under Functions sends the admin key"
assert "master key" not in res["body"], "the page never asks for the master key"
print("packaged handler serves the Dashboard function's page")
PY

kill "$pid" 2>/dev/null; wait "$pid" 2>/dev/null || true; pid=""

# A logic folder with dotfiles (secrets, VCS data) and a link out of it: the dotfiles are left
# out (and said so), the link is refused (it could pack a file from anywhere, ~/.ssh included).
mkdir -p "$work/logic-dots/.git" "$work/logic-dots/bin"
echo 'SECRET=1' >"$work/logic-dots/.env"; echo x >"$work/logic-dots/.git/config"
printf '#!/bin/sh\ntrue\n' >"$work/logic-dots/bin/run.sh"
dots_zip=$(scripts/package.sh --logic "$work/logic-dots" "$work/package-dots" 2>"$work/dots.err")
grep -q "left out" "$work/dots.err" || { echo "check-package: package.sh did not say it left the dotfiles out:" >&2; cat "$work/dots.err" >&2; exit 1; }
python3 - "$dots_zip" <<'PY'
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
assert "logic/bin/run.sh" in names, names
assert not any("/." in n for n in names), f"dotfiles packed: {names}"
print("package.sh --logic leaves dotfiles out")
PY
echo '{"Values":{"AzureWebJobsStorage":"secret"}}' >"$work/logic-dots/local.settings.json"
dots_zip=$(scripts/package.sh --logic "$work/logic-dots" "$work/package-dots" 2>"$work/dots.err")
python3 - "$dots_zip" <<'PY'
import sys, zipfile
assert "logic/local.settings.json" not in zipfile.ZipFile(sys.argv[1]).namelist()
print("package.sh --logic leaves local.settings.json out")
PY
ln "$work/logic-dots/bin/run.sh" "$work/logic-dots/bin/hard.sh"
if scripts/package.sh --logic "$work/logic-dots" "$work/package-link" >/dev/null 2>"$work/link.err"; then
  echo "check-package: package.sh packed a hard-linked file" >&2; exit 1
fi
grep -q "hard link" "$work/link.err" || { echo "check-package: package.sh refused the hard link without saying why:" >&2; cat "$work/link.err" >&2; exit 1; }
rm "$work/logic-dots/bin/hard.sh"
if scripts/package.sh --logic "$work/logic-dots" "$work" >/dev/null 2>"$work/overlap.err"; then
  echo "check-package: package.sh emptied an output directory that holds the logic folder" >&2; exit 1
fi
[ -f "$work/logic-dots/bin/run.sh" ] || { echo "check-package: package.sh deleted the logic folder" >&2; exit 1; }
ln -s /etc/hostname "$work/logic-dots/bin/linked"
if scripts/package.sh --logic "$work/logic-dots" "$work/package-link" >/dev/null 2>"$work/link.err"; then
  echo "check-package: package.sh packed a symbolic link" >&2; exit 1
fi
grep -q "symbolic link" "$work/link.err" || { echo "check-package: package.sh refused the link without saying why:" >&2; cat "$work/link.err" >&2; exit 1; }
echo "package.sh --logic refuses a symbolic link"

# The package with the example script as its logic, run end to end.
zip=$(scripts/package.sh --logic examples/logic-script "$root/target/package-logic")
python3 - "$zip" <<'PY'
import sys, zipfile, stat
z = zipfile.ZipFile(sys.argv[1])
mode = z.getinfo("logic/run.sh").external_attr >> 16
assert mode & stat.S_IXUSR, f"logic/run.sh is not executable in the zip (mode {oct(mode)})"
print(f"zip with logic ok: logic/run.sh mode {oct(mode & 0o777)}")
PY
unzip -q "$zip" -d "$work/logic-app"
scripts/install-azurite.sh >/dev/null
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
blob_port=$(free_port); queue_port=$(free_port); table_port=$(free_port)
mkdir -p "$work/azurite"
(cd "$work/azurite" && exec "$root/tools/azurite/node_modules/.bin/azurite" --inMemoryPersistence --silent \
  --disableTelemetry --skipApiVersionCheck --blobPort "$blob_port" --queuePort "$queue_port" --tablePort "$table_port") \
  >"$work/azurite.log" 2>&1 &
azurite_pid=$!
for _ in $(seq 1 150); do (exec 3<>"/dev/tcp/127.0.0.1/$queue_port") 2>/dev/null && break; sleep 0.2; done
storage="DefaultEndpointsProtocol=http;AccountName=devstoreaccount1;AccountKey=Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw==;BlobEndpoint=http://127.0.0.1:$blob_port/devstoreaccount1;QueueEndpoint=http://127.0.0.1:$queue_port/devstoreaccount1;"
port=$(free_port)
# Started from another directory: the logic is found relative to the app root all the same.
(cd "$work" && exec env -i PATH="$PATH" FUNCTIONS_CUSTOMHANDLER_PORT="$port" FUNCTIONS_WORKER_RUNTIME=custom \
  AzureWebJobsStorage="$storage" LEASEHOLD_QUEUE=leasehold-triggers LEASEHOLD_LOGIC_COMMAND=logic/run.sh \
  LEASEHOLD_LOGIC_ENV=EXAMPLE_OUTPUT EXAMPLE_OUTPUT="$work/runs" \
  "$work/logic-app/leasehold" handler >"$work/logic-handler.log" 2>&1) &
logic_pid=$!
for _ in $(seq 1 300); do curl -fsS "http://127.0.0.1:$port/" >/dev/null 2>&1 && break; sleep 0.1; done
invocation='{"Data":{"trigger":"{\"scope\":\"account\",\"recordId\":\"42\"}"},"Metadata":{"DequeueCount":"1","Id":"\"m1\"","PopReceipt":"\"p1\"","sys":{"MethodName":"Worker"}}}'
status=$(curl -sS -o "$work/worker-answer" -w '%{http_code}' -H 'content-type: application/json' \
  --data "$invocation" "http://127.0.0.1:$port/Worker") || status=000
[ "$status" = 200 ] || { echo "check-package: the packaged handler answered the Worker invocation $status:" >&2; cat "$work/worker-answer" "$work/logic-handler.log" >&2; exit 1; }
read -r kind scope record token attempt <"$work/runs" || { echo "check-package: the packed logic did not run:" >&2; cat "$work/logic-handler.log" >&2; exit 1; }
[ "$kind $scope $record $attempt" = "script account 42 1" ] && [ "$token" -ge 1 ] || { echo "check-package: the packed logic got '$kind $scope $record $token $attempt'" >&2; exit 1; }
echo "packaged handler ran the packed logic (logic/run.sh) for account/42 with fencing token $token, attempt $attempt"

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
echo "$plan" | grep -q -- "--adopt" && { echo "check-package: deploy.sh adopts without --adopt" >&2; exit 1; }
plan=$(LEASEHOLD_PARAMETERS="$work/dev-crm.json" scripts/deploy.sh dev --dry-run --adopt)
[ "$(echo "$plan" | grep 'dataverse register' | grep -c -- '--adopt')" = 2 ] || { echo "check-package: deploy.sh --adopt does not reach each registration:" >&2; echo "$plan" >&2; exit 1; }
plan=$(LEASEHOLD_PARAMETERS="$work/dev-crm.json" scripts/deploy.sh dev --dry-run --no-register)
echo "$plan" | grep -q "dataverse register" && { echo "check-package: deploy.sh --no-register still registers" >&2; exit 1; }
echo "deploy.sh --dry-run ok (prod; dev on FC1, EP1 and Y1; the Dataverse registration with a CRM, --adopt passed on, none without or with --no-register)"
echo "check-package: all checks passed"
