#!/usr/bin/env bash
# Deploys one environment: resource group, infrastructure (deploy/main.bicep with
# deploy/parameters/<env>.json), then the package (scripts/package.sh) by zip deploy.
#
# Usage: scripts/deploy.sh <dev|test|prod> [--plan FC1|EP1|EP2|EP3|Y1] [--dry-run]
#   --plan      the hosting plan, instead of the environment's (deploy/parameters/<env>.json;
#               the template's default is FC1, Flex Consumption)
#   --dry-run   print the az commands instead of running them (no Azure login needed)
# Environment: LEASEHOLD_RESOURCE_GROUP (default rg-leasehold-<env>),
#              LEASEHOLD_LOCATION (default westeurope)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

usage() { echo "usage: scripts/deploy.sh <dev|test|prod> [--plan FC1|EP1|EP2|EP3|Y1] [--dry-run]" >&2; exit 2; }
[ $# -ge 1 ] || usage
env=$1
shift
case "$env" in dev|test|prod) ;; *) usage ;; esac
dry=false
plan_override=()
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) dry=true ;;
    --plan)
      [ $# -ge 2 ] || usage
      case "$2" in FC1|EP1|EP2|EP3|Y1) plan_override=(planSku="$2") ;; *) usage ;; esac
      shift ;;
    *) usage ;;
  esac
  shift
done
params="deploy/parameters/$env.json"
[ -f "$params" ] || { echo "deploy.sh: $params is missing" >&2; exit 1; }
rg=${LEASEHOLD_RESOURCE_GROUP:-rg-leasehold-$env}
location=${LEASEHOLD_LOCATION:-westeurope}

run() {
  if $dry; then printf '%q ' "$@"; echo; else "$@"; fi
}

if ! $dry; then
  command -v az >/dev/null || { echo "deploy.sh: the Azure CLI (az) is not installed; see the README" >&2; exit 1; }
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
echo "# 5. Start's URL and key (give them to the Dataverse webhook registration)"
run az functionapp function show --resource-group "$rg" --name "$app" --function-name Start --query invokeUrlTemplate --output tsv
run az functionapp keys list --resource-group "$rg" --name "$app" --query functionKeys.default --output tsv
