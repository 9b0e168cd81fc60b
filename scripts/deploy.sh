#!/usr/bin/env bash
# Deploys one environment: resource group, infrastructure (deploy/main.bicep with
# deploy/parameters/<env>.json), then the package (scripts/package.sh) by zip deploy, and last,
# when the parameters name a Dataverse environment (the file's "leasehold"."dataverse" section,
# which az ignores: it reads only "parameters"), the webhook registration
# (`leasehold dataverse register`, once per table entry) with Start's URL and function key.
#
# Usage: scripts/deploy.sh <dev|test|prod> [--plan FC1|EP1|EP2|EP3|Y1] [--no-register] [--adopt] [--dry-run]
#   --plan         the hosting plan, instead of the environment's (deploy/parameters/<env>.json;
#                  the template's default is FC1, Flex Consumption)
#   --no-register  skip the Dataverse registration
#   --adopt        pass --adopt to the registration: once, after upgrading from a leasehold that
#                  registered its webhook before the ownership marker (register refuses an
#                  unmarked endpoint of its name otherwise, saying whose it looks like)
#   --dry-run      print the commands instead of running them (no Azure login needed; the key
#                  is never fetched, shown as <redacted>)
# Environment: LEASEHOLD_RESOURCE_GROUP (default rg-leasehold-<env>),
#              LEASEHOLD_LOCATION (default westeurope),
#              LEASEHOLD_PARAMETERS (default deploy/parameters/<env>.json),
#              LEASEHOLD_BIN (the leasehold executable for the registration; default: the one
#              package.sh built if it runs here, else `cargo run -p leasehold`),
#              the registration's credentials (docs/dataverse.md, "Credentials"): DATAVERSE_ACCESS_TOKEN,
#              or AZURE_TENANT_ID/AZURE_CLIENT_ID/AZURE_CLIENT_SECRET, else this az login.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

usage() { echo "usage: scripts/deploy.sh <dev|test|prod> [--plan FC1|EP1|EP2|EP3|Y1] [--no-register] [--adopt] [--dry-run]" >&2; exit 2; }
[ $# -ge 1 ] || usage
env=$1
shift
case "$env" in dev|test|prod) ;; *) usage ;; esac
dry=false
register=true
adopt=()
plan_override=()
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) dry=true ;;
    --no-register) register=false ;;
    --adopt) adopt=(--adopt) ;;
    --plan)
      [ $# -ge 2 ] || usage
      case "$2" in FC1|EP1|EP2|EP3|Y1) plan_override=(planSku="$2") ;; *) usage ;; esac
      shift ;;
    *) usage ;;
  esac
  shift
done
params=${LEASEHOLD_PARAMETERS:-deploy/parameters/$env.json}
[ -f "$params" ] || { echo "deploy.sh: $params is missing" >&2; exit 1; }
rg=${LEASEHOLD_RESOURCE_GROUP:-rg-leasehold-$env}
location=${LEASEHOLD_LOCATION:-westeurope}

# The Dataverse registrations: one line per table entry, "env-url<TAB>table<TAB>messages<TAB>columns".
registrations=$(python3 - "$params" <<'PY'
import json, sys
path = sys.argv[1]
dv = json.load(open(path)).get("leasehold", {}).get("dataverse", {})
url = (dv.get("environmentUrl") or "").strip()
entries = dv.get("registrations") or []
if url and not entries:
    sys.exit(f"deploy.sh: {path} names a Dataverse environment but no registrations (table, messages)")
for i, e in enumerate(entries if url else []):
    table, messages = e.get("table", ""), e.get("messages") or []
    if not table or not messages:
        sys.exit(f"deploy.sh: {path}: leasehold.dataverse.registrations[{i}] needs a table and messages")
    print("\t".join([url, table, ",".join(messages), ",".join(e.get("filteringAttributes") or [])]))
PY
)

run() {
  if $dry; then printf '%q ' "$@"; echo; else "$@"; fi
}

if ! $dry; then
  command -v az >/dev/null || { echo "deploy.sh: the Azure CLI (az) is not installed; see docs/deploying.md" >&2; exit 1; }
  az account show >/dev/null || { echo "deploy.sh: not logged in: run az login" >&2; exit 1; }
fi

echo "# 1. resource group $rg in $location"
run az group create --name "$rg" --location "$location" --output none
echo "# 2. infrastructure (storage, queues, container, Application Insights, Function App)"
if $dry; then
  run az deployment group create --resource-group "$rg" --name "leasehold-$env" \
    --template-file deploy/main.bicep --parameters "@$params" "${plan_override[@]}" --query properties.outputs.functionAppName.value --output tsv
  app="func-leasehold$env"
else
  app=$(az deployment group create --resource-group "$rg" --name "leasehold-$env" \
    --template-file deploy/main.bicep --parameters "@$params" "${plan_override[@]}" --query properties.outputs.functionAppName.value --output tsv)
fi
echo "# 3. package"
if $dry; then
  echo "scripts/package.sh"
  zip="target/package/leasehold.zip"
else
  zip=$(scripts/package.sh)
fi
echo "# 4. zip deploy to $app (on FC1 and EP the app reads storage with its identity: a first deploy may
#    wait a few minutes for its new role assignments to take effect)"
run az functionapp deployment source config-zip --resource-group "$rg" --name "$app" --src "$zip"
echo "# 5. Start's URL (its key: az functionapp function keys list --resource-group $rg --name $app --function-name Start)"
if $dry; then
  echo "START_URL=\$($(run az functionapp function show --resource-group "$rg" --name "$app" --function-name Start --query invokeUrlTemplate --output tsv | sed 's/ $//'))"
  start_url='$START_URL'
else
  start_url=$(az functionapp function show --resource-group "$rg" --name "$app" --function-name Start --query invokeUrlTemplate --output tsv)
  echo "$start_url"
fi

if [ -z "$registrations" ]; then
  echo "# 6. Dataverse: $params names no environment (leasehold.dataverse.environmentUrl): no webhook registered"
  exit 0
fi
dv_url=$(printf '%s\n' "$registrations" | head -n 1 | cut -f 1)
if ! $register; then
  echo "# 6. Dataverse: --no-register: the webhook in $dv_url is left as it is"
  exit 0
fi
echo "# 6. Dataverse: register Start as the webhook of $dv_url (idempotent; a rotated key updates the endpoint)"
# The leasehold executable: LEASEHOLD_BIN, the packaged one if it runs here, else cargo.
leasehold=()
if [ -n "${LEASEHOLD_BIN:-}" ]; then
  leasehold=("$LEASEHOLD_BIN")
elif [ -x target/x86_64-unknown-linux-gnu/release/leasehold ] && target/x86_64-unknown-linux-gnu/release/leasehold --version >/dev/null 2>&1; then
  leasehold=(target/x86_64-unknown-linux-gnu/release/leasehold)
else
  leasehold=(cargo run --locked --quiet -p leasehold --)
fi
# Start's function key, into the environment only: never echoed, never on a command line.
if $dry; then
  echo "export LEASEHOLD_START_KEY=\$(az functionapp function keys list --resource-group $rg --name $app --function-name Start --query default --output tsv)   # <redacted>, never printed"
else
  LEASEHOLD_START_KEY=$(az functionapp function keys list --resource-group "$rg" --name "$app" --function-name Start --query default --output tsv)
  [ -n "$LEASEHOLD_START_KEY" ] || { echo "deploy.sh: Start has no function key named default" >&2; exit 1; }
  export LEASEHOLD_START_KEY
fi
while IFS=$'\t' read -r url table messages columns; do
  args=(dataverse register --environment-url "$url" --start-url "$start_url" --table "$table" --messages "$messages")
  [ -z "$columns" ] || args+=(--filtering-attributes "$columns")
  args+=("${adopt[@]}")
  if $dry; then
    # As run() prints, but with $START_URL left for the shell to expand.
    printf '%q ' "${leasehold[@]}" "${args[@]}" | sed 's/\\\$START_URL/"$START_URL"/'; echo
  else
    "${leasehold[@]}" "${args[@]}"
  fi
done <<< "$registrations"
