// Leasehold: one environment (DEV, TEST or PROD) in one resource group.
// Storage account (trigger queue, poison queue, lock container), Application Insights on a Log
// Analytics workspace, and a Linux Function App running `leasehold handler` as a custom handler.
//
// Plans and storage access:
//   FC1 (Flex Consumption, the default): the host and the handler reach storage with the app's
//       managed identity (AzureWebJobsStorage__accountName + __credential), the package lives in
//       a deployment container read with that identity, and the storage account refuses shared
//       keys. Runtime `custom` (functionAppConfig.runtime).
//   EP1-EP3 (Elastic Premium): identity for AzureWebJobsStorage too; the plan's content share
//       (Azure Files: WEBSITE_CONTENTAZUREFILECONNECTIONSTRING, WEBSITE_CONTENTSHARE) needs the
//       account key, so shared keys stay allowed; run from package.
//   Y1 (Linux Consumption): legacy (retired 30 September 2028), connection string with the key.
// The app's identity gets Storage Blob Data Owner (leases, markers, the host's own blobs, the
// deployment container), Storage Queue Data Contributor (triggers, poison, watchdogs) and
// Storage Table Data Contributor (run history) on the account.
//
// Deploy: scripts/deploy.sh <dev|test|prod> (prints the az commands with --dry-run).

targetScope = 'resourceGroup'

@description('Environment name: dev, test or prod.')
@allowed(['dev', 'test', 'prod'])
param environmentName string

@description('Short lower-case prefix for resource names (letters and digits, 3-11 characters).')
@minLength(3)
@maxLength(11)
param namePrefix string

param location string = resourceGroup().location

@description('Hosting plan: FC1 (Flex Consumption: scales to zero, identity-only storage), EP1-EP3 (Elastic Premium: always ready), or Y1 (Linux Consumption, legacy: retired 30 September 2028).')
@allowed(['FC1', 'EP1', 'EP2', 'EP3', 'Y1'])
param planSku string = 'FC1'

@description('Flex Consumption: memory per instance in MB.')
@allowed([512, 2048, 4096])
param instanceMemoryMB int = 2048

@description('Flex Consumption: the most instances the app scales out to.')
@minValue(1)
@maxValue(1000)
param maximumInstanceCount int = 40

@description('Storage redundancy.')
@allowed(['Standard_LRS', 'Standard_ZRS', 'Standard_GRS'])
param storageSku string = 'Standard_LRS'

@description('Trigger queue name, the high lane (the poison queue is <name>-poison; the low lane\'s queues are <name>-low and <name>-low-poison). At most 52 characters.')
param queueName string = 'leasehold-triggers'

@description('Blob container for lock blobs and retrigger markers.')
param containerName string = 'leasehold-locks'

@description('Shell command run per record (LEASEHOLD_LOGIC_COMMAND); set this or logicUrl.')
param logicCommand string = ''

@description('Worker environment variables the logic command gets besides its run\'s and the base ones, comma-separated (LEASEHOLD_LOGIC_ENV); never the storage connection string or the Start key unless named here.')
param logicEnv string = ''

@description('HTTP endpoint POSTed per record (LEASEHOLD_LOGIC_URL); set this or logicCommand.')
@secure()
param logicUrl string = ''

@description('Dataverse organisations allowed to trigger this environment (comma list); empty allows any.')
param allowedOrganizations string = ''

@description('User GUIDs whose events are ignored (the integration\'s own writes), comma list.')
param integrationUserIds string = ''

@description('User GUIDs whose events go to the low lane (the users a data import or a bulk integration runs as), comma list.')
param lowPriorityUserIds string = ''

@description('Dataverse events deeper than this are ignored; empty for no limit.')
param maxDepth string = ''

@description('Lease duration in seconds (15-60).')
param leaseSeconds string = '30'

@description('Write a fencing generation on every grant.')
param fencing string = 'true'

@description('Run time limit in seconds; keep it below functionTimeout in host.json (10 minutes).')
param runTimeoutSeconds string = '540'

@description('How long, in total, logic may put a trigger off by asking to be run later (429, exit 75), in seconds: <default>[,<scope>=<seconds>]... (1-604800 each).')
param maxDeferralSeconds string = '86400'

@description('What a trigger during a run does: coalesce (one more run after it) or supersede (stop it, run again on the new data; needs fencing), as <default>[,<scope>=<policy>]...')
param runPolicy string = 'coalesce'

@description('Debounce: a record runs once no trigger for it came for this many seconds (0: off, the default), as <default>[,<scope>=<seconds>]... (0-3600 each).')
param debounceSeconds string = '0'

@description('Debounce: the longest a record waits for its burst of triggers to end, in seconds, at least the quiet period, as <default>[,<scope>=<seconds>]... (1-86400 each).')
param debounceMaxSeconds string = '60'

@description('The downstream budget each scope\'s runs draw on (they share its pause after a throttle and its adaptive concurrency), as <default>[,<scope>=<name>]...')
param budget string = 'default'

@description('Whether each worker adapts how many runs of a budget it starts at once after throttles (true) or always starts up to its concurrency (false).')
param adaptiveConcurrency string = 'true'

@description('How long a throttle without a usable Retry-After pauses its budget, in seconds (1-86400).')
param throttlePauseSeconds string = '10'

@description('The longest one throttle pauses its budget, in seconds (1-86400; a longer Retry-After is capped).')
param maxThrottlePauseSeconds string = '300'

@description('Whether every instance writes run history (what happened to each record) to the storage account\'s Table service: LEASEHOLD_HISTORY.')
@allowed([
  'true'
  'false'
])
param history string = 'true'

@description('How long run history is kept and shown, in days (1-366): LEASEHOLD_HISTORY_DAYS.')
param historyDays string = '7'

var suffix = '${namePrefix}${environmentName}'
var storageName = toLower('${take(namePrefix, 11)}${environmentName}st${take(uniqueString(resourceGroup().id), 6)}')
var isFlex = planSku == 'FC1'
var isConsumption = planSku == 'Y1'
var isPremium = startsWith(planSku, 'EP')
// Identity-based AzureWebJobsStorage everywhere but the legacy plan.
var useIdentity = !isConsumption
// Shared keys only where a plan needs them: Y1 (connection string) and EP (its content share).
var allowSharedKey = !isFlex
var deploymentContainerName = 'app-package'
var contentShareName = toLower('func-${suffix}')

resource storage 'Microsoft.Storage/storageAccounts@2023-05-01' = {
  name: storageName
  location: location
  sku: { name: storageSku }
  kind: 'StorageV2'
  properties: {
    minimumTlsVersion: 'TLS1_2'
    supportsHttpsTrafficOnly: true
    allowBlobPublicAccess: false
    allowSharedKeyAccess: allowSharedKey
    defaultToOAuthAuthentication: useIdentity
  }
}

resource blobService 'Microsoft.Storage/storageAccounts/blobServices@2023-05-01' = {
  parent: storage
  name: 'default'
}

resource lockContainer 'Microsoft.Storage/storageAccounts/blobServices/containers@2023-05-01' = {
  parent: blobService
  name: containerName
  properties: { publicAccess: 'None' }
}

// Flex Consumption reads the app's package from here, with the app's identity.
resource deploymentContainer 'Microsoft.Storage/storageAccounts/blobServices/containers@2023-05-01' = if (isFlex) {
  parent: blobService
  name: deploymentContainerName
  properties: { publicAccess: 'None' }
}

resource queueService 'Microsoft.Storage/storageAccounts/queueServices@2023-05-01' = {
  parent: storage
  name: 'default'
}

resource triggerQueue 'Microsoft.Storage/storageAccounts/queueServices/queues@2023-05-01' = {
  parent: queueService
  name: queueName
}

resource poisonQueue 'Microsoft.Storage/storageAccounts/queueServices/queues@2023-05-01' = {
  parent: queueService
  name: '${queueName}-poison'
}

// The low lane (bulk traffic: ?priority=low, LEASEHOLD_LOW_PRIORITY_USER_IDS), WorkerLow's queue.
resource lowQueue 'Microsoft.Storage/storageAccounts/queueServices/queues@2023-05-01' = {
  parent: queueService
  name: '${queueName}-low'
}

resource lowPoisonQueue 'Microsoft.Storage/storageAccounts/queueServices/queues@2023-05-01' = {
  parent: queueService
  name: '${queueName}-low-poison'
}

resource workspace 'Microsoft.OperationalInsights/workspaces@2023-09-01' = {
  name: 'log-${suffix}'
  location: location
  properties: {
    sku: { name: 'PerGB2018' }
    retentionInDays: environmentName == 'prod' ? 90 : 30
  }
}

resource insights 'Microsoft.Insights/components@2020-02-02' = {
  name: 'appi-${suffix}'
  location: location
  kind: 'web'
  properties: {
    Application_Type: 'web'
    WorkspaceResourceId: workspace.id
  }
}

resource plan 'Microsoft.Web/serverfarms@2024-04-01' = {
  name: 'plan-${suffix}'
  location: location
  sku: isFlex
    ? { name: 'FC1', tier: 'FlexConsumption' }
    : isConsumption ? { name: 'Y1', tier: 'Dynamic' } : { name: planSku, tier: 'ElasticPremium' }
  kind: isPremium ? 'elastic' : 'functionapp'
  properties: { reserved: true }
}

// Only read where a plan needs the key (Y1's AzureWebJobsStorage, EP's content share).
var storageConnection = allowSharedKey
  ? 'DefaultEndpointsProtocol=https;AccountName=${storage.name};EndpointSuffix=${environment().suffixes.storage};AccountKey=${storage.listKeys().keys[0].value}'
  : ''

// How the host and the handler reach storage: the same settings serve both.
var storageSettings = useIdentity
  ? [
      { name: 'AzureWebJobsStorage__accountName', value: storage.name }
      { name: 'AzureWebJobsStorage__credential', value: 'managedidentity' }
    ]
  : [
      { name: 'AzureWebJobsStorage', value: storageConnection }
    ]

// The language worker and the package: Flex states both in functionAppConfig instead.
var planSettings = isFlex
  ? []
  : concat(
      [
        { name: 'FUNCTIONS_EXTENSION_VERSION', value: '~4' }
        { name: 'FUNCTIONS_WORKER_RUNTIME', value: 'custom' }
        { name: 'WEBSITE_RUN_FROM_PACKAGE', value: '1' }
      ],
      isPremium
        ? [
            { name: 'WEBSITE_CONTENTAZUREFILECONNECTIONSTRING', value: storageConnection }
            { name: 'WEBSITE_CONTENTSHARE', value: contentShareName }
          ]
        : []
    )

resource app 'Microsoft.Web/sites@2024-04-01' = {
  name: 'func-${suffix}'
  location: location
  kind: 'functionapp,linux'
  identity: { type: 'SystemAssigned' }
  properties: {
    serverFarmId: plan.id
    reserved: true
    httpsOnly: true
    functionAppConfig: isFlex
      ? {
          deployment: {
            storage: {
              type: 'blobContainer'
              value: '${storage.properties.primaryEndpoints.blob}${deploymentContainerName}'
              authentication: { type: 'SystemAssignedIdentity' }
            }
          }
          scaleAndConcurrency: {
            instanceMemoryMB: instanceMemoryMB
            maximumInstanceCount: maximumInstanceCount
          }
          runtime: { name: 'custom', version: '1.0' }
        }
      : null
    siteConfig: {
      minTlsVersion: '1.2'
      ftpsState: 'Disabled'
      http20Enabled: true
      appSettings: concat(planSettings, storageSettings, [
        { name: 'APPLICATIONINSIGHTS_CONNECTION_STRING', value: insights.properties.ConnectionString }
        { name: 'LEASEHOLD_QUEUE', value: queueName }
        { name: 'LEASEHOLD_CONTAINER', value: containerName }
        { name: 'LEASEHOLD_LOGIC_COMMAND', value: logicCommand }
        { name: 'LEASEHOLD_LOGIC_ENV', value: logicEnv }
        { name: 'LEASEHOLD_LOGIC_URL', value: logicUrl }
        { name: 'LEASEHOLD_DEMO_SECONDS', value: '' }
        { name: 'LEASEHOLD_ALLOWED_ORGANIZATIONS', value: allowedOrganizations }
        { name: 'LEASEHOLD_INTEGRATION_USER_IDS', value: integrationUserIds }
        { name: 'LEASEHOLD_LOW_PRIORITY_USER_IDS', value: lowPriorityUserIds }
        { name: 'LEASEHOLD_MAX_DEPTH', value: maxDepth }
        { name: 'LEASEHOLD_LEASE_SECONDS', value: leaseSeconds }
        { name: 'LEASEHOLD_FENCING', value: fencing }
        { name: 'LEASEHOLD_RUN_TIMEOUT_SECONDS', value: runTimeoutSeconds }
        { name: 'LEASEHOLD_MAX_DEFERRAL_SECONDS', value: maxDeferralSeconds }
        { name: 'LEASEHOLD_RUN_POLICY', value: runPolicy }
        { name: 'LEASEHOLD_DEBOUNCE_SECONDS', value: debounceSeconds }
        { name: 'LEASEHOLD_DEBOUNCE_MAX_SECONDS', value: debounceMaxSeconds }
        { name: 'LEASEHOLD_BUDGET', value: budget }
        { name: 'LEASEHOLD_ADAPTIVE_CONCURRENCY', value: adaptiveConcurrency }
        { name: 'LEASEHOLD_THROTTLE_PAUSE_SECONDS', value: throttlePauseSeconds }
        { name: 'LEASEHOLD_MAX_THROTTLE_PAUSE_SECONDS', value: maxThrottlePauseSeconds }
        { name: 'LEASEHOLD_HISTORY', value: history }
        { name: 'LEASEHOLD_HISTORY_DAYS', value: historyDays }
        { name: 'LEASEHOLD_HISTORY_TABLE', value: '' }
        { name: 'LEASEHOLD_LOG_FORMAT', value: 'json' }
        // How often the handler logs its metrics event (and samples the queue depths): the default.
        { name: 'LEASEHOLD_METRICS_INTERVAL_SECONDS', value: '' }
        // The handler's HTTP limits (its only client is the host, on loopback): the defaults.
        { name: 'LEASEHOLD_HTTP_HEADER_TIMEOUT_SECONDS', value: '' }
        { name: 'LEASEHOLD_HTTP_BODY_TIMEOUT_SECONDS', value: '' }
        { name: 'LEASEHOLD_HTTP_WRITE_TIMEOUT_SECONDS', value: '' }
        { name: 'LEASEHOLD_HTTP_SHUTDOWN_SECONDS', value: '' }
        { name: 'LEASEHOLD_HTTP_MAX_CONNECTIONS', value: '' }
        // Standalone-only settings: unused under the Functions host (the host polls the queue and
        // checks function keys), set empty so every environment states every setting.
        { name: 'LEASEHOLD_API_KEY', value: '' }
        { name: 'LEASEHOLD_INSECURE_NO_START_KEY', value: '' }
        // The dashboard's key (both modes: the handler checks it for the Ops function). Empty: the
        // dashboard's API is off; set it (at least 32 random characters, or a Key Vault reference)
        // to turn it on.
        { name: 'LEASEHOLD_ADMIN_KEY', value: '' }
        { name: 'LEASEHOLD_PORT', value: '' }
        { name: 'LEASEHOLD_BIND', value: '' }
        { name: 'LEASEHOLD_HEALTH_PORT', value: '' }
        { name: 'LEASEHOLD_CONCURRENCY', value: '' }
        { name: 'LEASEHOLD_MAX_DEQUEUE_COUNT', value: '' }
        { name: 'LEASEHOLD_POLL_MAX_SECONDS', value: '' }
        { name: 'LEASEHOLD_SHUTDOWN_GRACE_SECONDS', value: '' }
      ])
    }
  }
  dependsOn: [lockContainer, triggerQueue, poisonQueue, lowQueue, lowPoisonQueue, deploymentContainer]
}

// The roles the app's identity needs on the account (built-in role ids).
var storageRoles = {
  blobDataOwner: 'b7e6dc6d-f1e8-4753-8033-0f276bb0955b'
  queueDataContributor: '974c5e8b-45b9-4653-ba55-5f855dd0fb88'
  // Run history: a table per period, created, written, read and dropped by the app.
  tableDataContributor: '0a9a7e1f-b9d0-4cc4-a60d-0319b160aaa3'
}

resource roleAssignments 'Microsoft.Authorization/roleAssignments@2022-04-01' = [
  for role in items(storageRoles): if (useIdentity) {
    name: guid(storage.id, app.id, role.value)
    scope: storage
    properties: {
      roleDefinitionId: subscriptionResourceId('Microsoft.Authorization/roleDefinitions', role.value)
      principalId: app.identity.principalId
      principalType: 'ServicePrincipal'
    }
  }
]

output functionAppName string = app.name
output storageAccountName string = storage.name
output startUrl string = 'https://${app.properties.defaultHostName}/api/start'
output resourceGroupName string = resourceGroup().name
