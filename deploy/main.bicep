// Leasehold: one environment (DEV, TEST or PROD) in one resource group.
// Storage account (trigger queue, poison queue, lock container), Application Insights on a Log
// Analytics workspace, and a Linux Function App running `leasehold handler` as a custom handler.
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

@description('Hosting plan: Y1 (Linux Consumption) or EP1-EP3 (Elastic Premium: always ready, VNet, longer runs). Flex Consumption does not run custom handlers.')
@allowed(['Y1', 'EP1', 'EP2', 'EP3'])
param planSku string = 'Y1'

@description('Storage redundancy.')
@allowed(['Standard_LRS', 'Standard_ZRS', 'Standard_GRS'])
param storageSku string = 'Standard_LRS'

@description('Trigger queue name (the poison queue is <name>-poison).')
param queueName string = 'leasehold-triggers'

@description('Blob container for lock blobs and retrigger markers.')
param containerName string = 'leasehold-locks'

@description('Shell command run per record (LEASEHOLD_LOGIC_COMMAND); set this or logicUrl.')
param logicCommand string = ''

@description('HTTP endpoint POSTed per record (LEASEHOLD_LOGIC_URL); set this or logicCommand.')
@secure()
param logicUrl string = ''

@description('Dataverse organisations allowed to trigger this environment (comma list); empty allows any.')
param allowedOrganizations string = ''

@description('User GUIDs whose events are ignored (the integration\'s own writes), comma list.')
param integrationUserIds string = ''

@description('Dataverse events deeper than this are ignored; empty for no limit.')
param maxDepth string = ''

@description('Lease duration in seconds (15-60).')
param leaseSeconds string = '30'

@description('Write a fencing generation on every grant.')
param fencing string = 'true'

@description('Run time limit in seconds; keep it below functionTimeout in host.json (10 minutes).')
param runTimeoutSeconds string = '540'

var suffix = '${namePrefix}${environmentName}'
var storageName = toLower('${take(namePrefix, 11)}${environmentName}st${take(uniqueString(resourceGroup().id), 6)}')
var isConsumption = planSku == 'Y1'

resource storage 'Microsoft.Storage/storageAccounts@2023-05-01' = {
  name: storageName
  location: location
  sku: { name: storageSku }
  kind: 'StorageV2'
  properties: {
    minimumTlsVersion: 'TLS1_2'
    supportsHttpsTrafficOnly: true
    allowBlobPublicAccess: false
    // The handler binary authenticates with the account key (see README, "Storage access").
    allowSharedKeyAccess: true
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

resource plan 'Microsoft.Web/serverfarms@2023-12-01' = {
  name: 'plan-${suffix}'
  location: location
  sku: isConsumption ? { name: 'Y1', tier: 'Dynamic' } : { name: planSku, tier: 'ElasticPremium' }
  kind: isConsumption ? 'functionapp' : 'elastic'
  properties: { reserved: true }
}

var storageConnection = 'DefaultEndpointsProtocol=https;AccountName=${storage.name};EndpointSuffix=${environment().suffixes.storage};AccountKey=${storage.listKeys().keys[0].value}'

resource app 'Microsoft.Web/sites@2023-12-01' = {
  name: 'func-${suffix}'
  location: location
  kind: 'functionapp,linux'
  identity: { type: 'SystemAssigned' }
  properties: {
    serverFarmId: plan.id
    reserved: true
    httpsOnly: true
    siteConfig: {
      minTlsVersion: '1.2'
      ftpsState: 'Disabled'
      http20Enabled: true
      appSettings: [
        { name: 'FUNCTIONS_EXTENSION_VERSION', value: '~4' }
        { name: 'FUNCTIONS_WORKER_RUNTIME', value: 'custom' }
        { name: 'APPLICATIONINSIGHTS_CONNECTION_STRING', value: insights.properties.ConnectionString }
        { name: 'AzureWebJobsStorage', value: storageConnection }
        { name: 'LEASEHOLD_QUEUE', value: queueName }
        { name: 'LEASEHOLD_CONTAINER', value: containerName }
        { name: 'LEASEHOLD_LOGIC_COMMAND', value: logicCommand }
        { name: 'LEASEHOLD_LOGIC_URL', value: logicUrl }
        { name: 'LEASEHOLD_DEMO_SECONDS', value: '' }
        { name: 'LEASEHOLD_ALLOWED_ORGANIZATIONS', value: allowedOrganizations }
        { name: 'LEASEHOLD_INTEGRATION_USER_IDS', value: integrationUserIds }
        { name: 'LEASEHOLD_MAX_DEPTH', value: maxDepth }
        { name: 'LEASEHOLD_LEASE_SECONDS', value: leaseSeconds }
        { name: 'LEASEHOLD_FENCING', value: fencing }
        { name: 'LEASEHOLD_RUN_TIMEOUT_SECONDS', value: runTimeoutSeconds }
        { name: 'LEASEHOLD_LOG_FORMAT', value: 'json' }
        // Standalone-only settings: unused under the Functions host (the host polls the queue and
        // checks function keys), set empty so every environment states every setting.
        { name: 'LEASEHOLD_API_KEY', value: '' }
        { name: 'LEASEHOLD_PORT', value: '' }
        { name: 'LEASEHOLD_BIND', value: '' }
        { name: 'LEASEHOLD_CONCURRENCY', value: '' }
        { name: 'LEASEHOLD_MAX_DEQUEUE_COUNT', value: '' }
        { name: 'LEASEHOLD_POLL_MAX_SECONDS', value: '' }
        { name: 'LEASEHOLD_SHUTDOWN_GRACE_SECONDS', value: '' }
      ]
    }
  }
  dependsOn: [lockContainer, triggerQueue, poisonQueue]
}

output functionAppName string = app.name
output storageAccountName string = storage.name
output startUrl string = 'https://${app.properties.defaultHostName}/api/start'
output resourceGroupName string = resourceGroup().name
