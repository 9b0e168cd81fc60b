//! Storage account settings from a connection string, as users already write them in
//! `AzureWebJobsStorage`: `UseDevelopmentStorage=true` (Azurite), `AccountName`/`AccountKey` with
//! an `EndpointSuffix` or explicit `BlobEndpoint`/`QueueEndpoint`/`TableEndpoint`, and
//! `SharedAccessSignature`.
//! Error messages name what is wrong, never a value (values may be secrets).

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

use azure_core::credentials::TokenCredential;

use base64::Engine;
use url::Url;

/// Azurite's well-known development account. Not a secret: it is published by Microsoft.
pub const EMULATOR_ACCOUNT: &str = "devstoreaccount1";
/// Azurite's well-known development key (public, documented by Microsoft).
pub const EMULATOR_KEY: &str =
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw==";

/// A connection string that cannot be used, and why (never quoting a value: values may be
/// secrets).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct InvalidConnectionString(String);

type Result<T> = std::result::Result<T, InvalidConnectionString>;

fn invalid(reason: impl Into<String>) -> InvalidConnectionString {
    InvalidConnectionString(reason.into())
}

/// How requests to the account are authorised.
#[derive(Clone)]
pub(crate) enum Credential {
    /// Shared Key: every request signed with the account key (base64, as in the portal).
    Key(String),
    /// A shared access signature: its query parameters added to every request.
    Sas(Vec<(String, String)>),
    /// An Entra ID identity: a bearer token on every request, fetched and refreshed before it
    /// expires by the SDK (https only).
    Token(Arc<dyn TokenCredential>),
}

/// Where a storage account is and how to sign requests to it.
#[derive(Clone)]
pub struct StorageAccount {
    account: String,
    credential: Credential,
    blob: Url,
    queue: Url,
    /// The Table service (run history). Derived like the others from the account name only when
    /// no endpoint is explicit; `None` when Blob or Queue endpoints are given but no Table one:
    /// behind a private endpoint the derived host would be the account's public one (and plain
    /// HTTP with `DefaultEndpointsProtocol=http`), and history's requests name records.
    table: Option<Url>,
    emulator: bool,
}

impl fmt::Debug for StorageAccount {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StorageAccount")
            .field("account", &self.account)
            .field("blob_endpoint", &self.blob_endpoint())
            .field("queue_endpoint", &self.queue_endpoint())
            .field("table_endpoint", &self.table_endpoint())
            .field("credentials", &"<redacted>")
            .finish()
    }
}

impl StorageAccount {
    /// Parses a connection string. `UseDevelopmentStorage=true` means Azurite on its default ports
    /// (10000 blob, 10001 queue, 10002 table).
    /// Setting names are matched without regard to case, as the Azure SDKs do.
    pub fn from_connection_string(text: &str) -> Result<Self> {
        let text = text.trim();
        if text.is_empty() {
            return Err(invalid("the connection string is empty"));
        }
        let mut settings: HashMap<String, &str> = HashMap::new();
        for part in text.split(';').map(str::trim).filter(|p| !p.is_empty()) {
            let Some((name, value)) = part.split_once('=') else {
                return Err(invalid(
                    "not a storage connection string: expected Key=Value pairs separated by ';' \
                     (e.g. UseDevelopmentStorage=true, or AccountName=...;AccountKey=...)",
                ));
            };
            settings.insert(name.trim().to_ascii_lowercase(), value.trim());
        }
        let get = |name: &str| {
            settings
                .get(&name.to_ascii_lowercase())
                .copied()
                .filter(|v| !v.is_empty())
        };

        if get("UseDevelopmentStorage").is_some_and(|v| v.eq_ignore_ascii_case("true")) {
            let host = match get("DevelopmentStorageProxyUri") {
                Some(uri) => url_host(uri)?,
                None => "127.0.0.1".to_string(),
            };
            return Ok(Self::emulator(&host, 10000, 10001, 10002));
        }

        let credential = if let Some(sas) = get("SharedAccessSignature") {
            let sas = sas.trim_start_matches('?');
            let pairs: Vec<(String, String)> = url::form_urlencoded::parse(sas.as_bytes())
                .map(|(k, v)| (k.into_owned(), v.into_owned()))
                .collect();
            if !pairs.iter().any(|(k, _)| k == "sig") {
                return Err(invalid("SharedAccessSignature is not a valid SAS token (no sig)"));
            }
            Credential::Sas(pairs)
        } else {
            match (get("AccountName"), get("AccountKey")) {
                (Some(_), Some(key)) => {
                    base64::engine::general_purpose::STANDARD
                        .decode(key)
                        .map_err(|_| invalid("AccountKey is not base64"))?;
                    Credential::Key(key.to_string())
                }
                (Some(_), None) => {
                    return Err(invalid(
                        "AccountName is set but neither AccountKey nor SharedAccessSignature is",
                    ));
                }
                _ => {
                    return Err(invalid(
                        "no credentials: set AccountName and AccountKey, or SharedAccessSignature",
                    ));
                }
            }
        };

        let protocol = match get("DefaultEndpointsProtocol") {
            Some(p) if p.eq_ignore_ascii_case("http") => "http",
            _ => "https",
        };
        let explicit = get("BlobEndpoint")
            .or(get("QueueEndpoint"))
            .or(get("TableEndpoint"));
        let account = match (get("AccountName"), explicit) {
            (Some(name), _) => name.to_string(),
            (None, Some(endpoint)) => account_from_endpoint(endpoint)?,
            (None, None) => return Err(invalid("set AccountName, or BlobEndpoint and QueueEndpoint")),
        };
        let suffix = get("EndpointSuffix").unwrap_or("core.windows.net");
        let location = |explicit: Option<&str>, service: &str| -> Result<Url> {
            let text = match explicit {
                Some(uri) => uri.trim_end_matches('/').to_string(),
                None => format!("{protocol}://{account}.{}.{suffix}", service.to_ascii_lowercase()),
            };
            Url::parse(&text).map_err(|_| invalid(format!("{service}Endpoint is not a URL")))
        };
        let blob = location(get("BlobEndpoint"), "Blob")?;
        let queue = location(get("QueueEndpoint"), "Queue")?;
        // Never derived beside explicit Blob or Queue endpoints (see `table`).
        let table = match get("TableEndpoint") {
            None if get("BlobEndpoint").is_some() || get("QueueEndpoint").is_some() => None,
            explicit => Some(location(explicit, "Table")?),
        };
        Ok(Self {
            account,
            credential,
            blob,
            queue,
            table,
            emulator: false,
        })
    }

    /// Azurite (or the legacy emulator) at `host` on the given ports, with the well-known account.
    pub fn emulator(host: &str, blob_port: u16, queue_port: u16, table_port: u16) -> Self {
        let account = EMULATOR_ACCOUNT.to_string();
        let url =
            |port: u16| Url::parse(&format!("http://{host}:{port}/{account}")).expect("an emulator URL");
        Self {
            credential: Credential::Key(EMULATOR_KEY.to_string()),
            blob: url(blob_port),
            queue: url(queue_port),
            table: Some(url(table_port)),
            account,
            emulator: true,
        }
    }

    /// A connection string for Azurite at `host` with explicit endpoints (what tests hand to the
    /// binary).
    pub fn emulator_connection_string(
        host: &str,
        blob_port: u16,
        queue_port: u16,
        table_port: u16,
    ) -> String {
        format!(
            "DefaultEndpointsProtocol=http;AccountName={EMULATOR_ACCOUNT};AccountKey={EMULATOR_KEY};\
             BlobEndpoint=http://{host}:{blob_port}/{EMULATOR_ACCOUNT};\
             QueueEndpoint=http://{host}:{queue_port}/{EMULATOR_ACCOUNT};\
             TableEndpoint=http://{host}:{table_port}/{EMULATOR_ACCOUNT};"
        )
    }

    pub fn account(&self) -> &str {
        &self.account
    }

    pub(crate) fn credential(&self) -> &Credential {
        &self.credential
    }

    /// The Entra ID credential requests carry, when the account is reached by identity.
    pub fn token_credential(&self) -> Option<Arc<dyn TokenCredential>> {
        match &self.credential {
            Credential::Token(credential) => Some(credential.clone()),
            _ => None,
        }
    }

    /// Identity-based access with the settings Azure Functions users know, read through `get`
    /// under `prefix` (`AzureWebJobsStorage`):
    ///
    /// - `<prefix>__accountName`, or `<prefix>__blobServiceUri` and `<prefix>__queueServiceUri`
    ///   (https; default `https://<account>.<service>.core.windows.net`); `<prefix>__tableServiceUri`
    ///   likewise (derived from the account only when neither of the other two is given: beside
    ///   them, none, and run history is off; on its own it does not make the settings
    ///   identity-based);
    /// - `<prefix>__credential`: `managedidentity` for the app's managed identity; unset, the
    ///   identity is found where the process runs: workload identity on Kubernetes
    ///   (`AZURE_FEDERATED_TOKEN_FILE`), a managed identity in Azure (`IDENTITY_ENDPOINT`,
    ///   `MSI_ENDPOINT` or the instance metadata service), else the developer's Azure CLI login;
    /// - `<prefix>__clientId`: a user-assigned identity's client id.
    ///
    /// `None` when none of them is set.
    pub fn from_identity_settings(
        prefix: &str,
        get: impl Fn(&str) -> Option<String>,
    ) -> Option<std::result::Result<Self, InvalidIdentitySettings>> {
        let setting = |name: &str| {
            get(&format!("{prefix}__{name}"))
                .map(|v| v.trim().to_string())
                .filter(|v| !v.is_empty())
        };
        let (name, blob, queue) = (
            setting("accountName"),
            setting("blobServiceUri"),
            setting("queueServiceUri"),
        );
        if name.is_none() && blob.is_none() && queue.is_none() {
            return None;
        }
        Some(identity_account(
            prefix,
            name,
            blob,
            queue,
            setting("tableServiceUri"),
            setting("credential"),
            setting("clientId"),
        ))
    }

    /// Whether this is the emulator (Azurite).
    pub fn is_emulator(&self) -> bool {
        self.emulator || self.account == EMULATOR_ACCOUNT
    }

    /// The blob endpoint URL (no secrets in it).
    pub fn blob_endpoint(&self) -> String {
        self.blob.as_str().trim_end_matches('/').to_string()
    }

    /// The queue endpoint URL (no secrets in it).
    pub fn queue_endpoint(&self) -> String {
        self.queue.as_str().trim_end_matches('/').to_string()
    }

    /// The table endpoint URL (no secrets in it: no query, no user or password); `None` when
    /// the settings give Blob or Queue endpoints but no Table endpoint (run history is then off:
    /// a Table endpoint is never derived beside explicit ones).
    pub fn table_endpoint(&self) -> Option<String> {
        self.table.as_ref().map(|url| {
            let mut url = url.clone();
            url.set_query(None);
            url.set_fragment(None);
            let _ = url.set_password(None);
            let _ = url.set_username("");
            url.as_str().trim_end_matches('/').to_string()
        })
    }

    /// Whether the account has a Table endpoint ([`table_endpoint`](Self::table_endpoint)).
    pub fn has_table_endpoint(&self) -> bool {
        self.table.is_some()
    }

    /// The URL of `path` (a container, a queue, a table resource) under the service's endpoint.
    ///
    /// # Panics
    ///
    /// For [`Service::Table`] on an account without a Table endpoint
    /// ([`has_table_endpoint`](Self::has_table_endpoint)): `TableClient::new` refuses such an
    /// account first.
    pub fn url(&self, service: Service, path: &str) -> Url {
        let base = match service {
            Service::Blob => &self.blob,
            Service::Queue => &self.queue,
            Service::Table => self
                .table
                .as_ref()
                .expect("a Table endpoint (TableClient::new checks has_table_endpoint)"),
        };
        let mut url = base.clone();
        url.path_segments_mut()
            .expect("storage endpoints are base URLs")
            .pop_if_empty()
            .push(path);
        url
    }
}

/// Identity-based storage settings that cannot be used, and why (naming the setting).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct InvalidIdentitySettings(String);

fn identity_account(
    prefix: &str,
    name: Option<String>,
    blob: Option<String>,
    queue: Option<String>,
    table: Option<String>,
    credential: Option<String>,
    client_id: Option<String>,
) -> std::result::Result<StorageAccount, InvalidIdentitySettings> {
    let wrong = |text: String| InvalidIdentitySettings(text);
    let account = match (&name, &blob) {
        (Some(name), _) => name.clone(),
        (None, Some(uri)) => account_from_endpoint(uri).map_err(|_| {
            wrong(format!(
                "{prefix}__blobServiceUri: cannot tell the account name; set {prefix}__accountName"
            ))
        })?,
        (None, None) => {
            return Err(wrong(format!(
                "set {prefix}__accountName or {prefix}__blobServiceUri"
            )));
        }
    };
    let uri = |explicit: Option<String>, setting: &str, service: &str| {
        let text = explicit.unwrap_or_else(|| format!("https://{account}.{service}.core.windows.net"));
        let url = Url::parse(text.trim_end_matches('/'))
            .map_err(|_| wrong(format!("{prefix}__{setting} is not a URL")))?;
        if url.scheme() != "https" {
            return Err(wrong(format!(
                "{prefix}__{setting} must be https: tokens are never sent in the clear"
            )));
        }
        Ok(url)
    };
    // A Table endpoint is never derived beside explicit blob or queue ones (see `table`).
    let derive_table = blob.is_none() && queue.is_none();
    let blob = uri(blob, "blobServiceUri", "blob")?;
    let queue = uri(queue, "queueServiceUri", "queue")?;
    let table = match table {
        None if !derive_table => None,
        table => Some(uri(table, "tableServiceUri", "table")?),
    };
    let credential = identity_credential(prefix, credential.as_deref(), client_id)?;
    Ok(StorageAccount {
        account,
        credential: Credential::Token(credential),
        blob,
        queue,
        table,
        emulator: false,
    })
}

fn identity_credential(
    prefix: &str,
    kind: Option<&str>,
    client_id: Option<String>,
) -> std::result::Result<Arc<dyn TokenCredential>, InvalidIdentitySettings> {
    use azure_identity::{
        AzureCliCredential, ManagedIdentityCredential, ManagedIdentityCredentialOptions, UserAssignedId,
        WorkloadIdentityCredential, WorkloadIdentityCredentialOptions,
    };
    let failed = |what: &str, e: azure_core::Error| InvalidIdentitySettings(format!("{what}: {e}"));
    let managed = |client_id: Option<String>| -> std::result::Result<Arc<dyn TokenCredential>, _> {
        let options = ManagedIdentityCredentialOptions {
            user_assigned_id: client_id.map(UserAssignedId::ClientId),
            ..Default::default()
        };
        Ok(
            ManagedIdentityCredential::new(Some(options)).map_err(|e| failed("managed identity", e))?
                as Arc<dyn TokenCredential>,
        )
    };
    match kind {
        Some(k) if k.eq_ignore_ascii_case("managedidentity") => managed(client_id),
        Some(_) => Err(InvalidIdentitySettings(format!(
            "{prefix}__credential: only managedidentity is understood (or leave it unset to use the identity where this runs)"
        ))),
        None if std::env::var_os("AZURE_FEDERATED_TOKEN_FILE").is_some() => {
            let options = WorkloadIdentityCredentialOptions {
                client_id,
                ..Default::default()
            };
            Ok(
                WorkloadIdentityCredential::new(Some(options)).map_err(|e| failed("workload identity", e))?
                    as Arc<dyn TokenCredential>,
            )
        }
        None if ["IDENTITY_ENDPOINT", "MSI_ENDPOINT"]
            .iter()
            .any(|v| std::env::var_os(v).is_some()) =>
        {
            managed(client_id)
        }
        None => Ok(
            AzureCliCredential::new(None).map_err(|e| failed("Azure CLI login", e))?
                as Arc<dyn TokenCredential>,
        ),
    }
}

/// A storage service of the account.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Service {
    Blob,
    Queue,
    /// The Table service (run history), signed differently from the other two (`auth.rs`).
    Table,
}

fn url_host(uri: &str) -> Result<String> {
    let url = Url::parse(uri).map_err(|_| invalid("DevelopmentStorageProxyUri is not a URL"))?;
    url.host_str()
        .map(str::to_string)
        .ok_or_else(|| invalid("DevelopmentStorageProxyUri has no host"))
}

/// `https://acct.blob.core.windows.net` → `acct`; `http://127.0.0.1:10000/devstoreaccount1` →
/// `devstoreaccount1` (path-style, as Azurite uses).
fn account_from_endpoint(endpoint: &str) -> Result<String> {
    let url = Url::parse(endpoint).map_err(|_| invalid("BlobEndpoint is not a URL"))?;
    if let Some(first) = url
        .path_segments()
        .and_then(|mut s| s.next())
        .filter(|s| !s.is_empty())
    {
        return Ok(first.to_string());
    }
    url.host_str()
        .and_then(|h| h.split('.').next())
        .map(str::to_string)
        .ok_or_else(|| invalid("cannot tell the account name from BlobEndpoint; set AccountName"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn development_storage_means_azurite_defaults() {
        let a = StorageAccount::from_connection_string("UseDevelopmentStorage=true").unwrap();
        assert!(a.is_emulator());
        assert_eq!(a.blob_endpoint(), "http://127.0.0.1:10000/devstoreaccount1");
        assert_eq!(a.queue_endpoint(), "http://127.0.0.1:10001/devstoreaccount1");
        assert_eq!(
            a.table_endpoint().as_deref(),
            Some("http://127.0.0.1:10002/devstoreaccount1")
        );
        let proxied = StorageAccount::from_connection_string(
            "UseDevelopmentStorage=true;DevelopmentStorageProxyUri=http://azurite",
        )
        .unwrap();
        assert_eq!(
            proxied.table_endpoint().as_deref(),
            Some("http://azurite:10002/devstoreaccount1")
        );
    }

    #[test]
    fn account_key_with_suffix() {
        let a = StorageAccount::from_connection_string(
            "DefaultEndpointsProtocol=https;AccountName=prodacct;AccountKey=c2VjcmV0;EndpointSuffix=core.windows.net",
        )
        .unwrap();
        assert_eq!(a.account(), "prodacct");
        assert_eq!(a.blob_endpoint(), "https://prodacct.blob.core.windows.net");
        assert_eq!(a.queue_endpoint(), "https://prodacct.queue.core.windows.net");
        assert_eq!(
            a.table_endpoint().as_deref(),
            Some("https://prodacct.table.core.windows.net")
        );
        assert_eq!(
            a.url(Service::Table, "Tables").as_str(),
            "https://prodacct.table.core.windows.net/Tables"
        );
        let sovereign = StorageAccount::from_connection_string(
            "DefaultEndpointsProtocol=https;AccountName=g;AccountKey=c2VjcmV0;EndpointSuffix=core.usgovcloudapi.net",
        )
        .unwrap();
        assert_eq!(sovereign.blob_endpoint(), "https://g.blob.core.usgovcloudapi.net");
        assert_eq!(
            sovereign.table_endpoint().as_deref(),
            Some("https://g.table.core.usgovcloudapi.net")
        );
        let plain = StorageAccount::from_connection_string(
            "DefaultEndpointsProtocol=http;AccountName=p;AccountKey=c2VjcmV0",
        )
        .unwrap();
        assert_eq!(
            plain.table_endpoint().as_deref(),
            Some("http://p.table.core.windows.net")
        );
    }

    #[test]
    fn an_explicit_table_endpoint_is_used_as_written() {
        let a = StorageAccount::from_connection_string(
            "AccountName=acct;AccountKey=c2VjcmV0;TableEndpoint=https://tables.example.net/acct/",
        )
        .unwrap();
        assert_eq!(
            a.table_endpoint().as_deref(),
            Some("https://tables.example.net/acct")
        );
        assert_eq!(a.blob_endpoint(), "https://acct.blob.core.windows.net");
        // The account named by the table endpoint alone (SAS, no AccountName).
        let sas = StorageAccount::from_connection_string(
            "TableEndpoint=https://only.table.core.windows.net;SharedAccessSignature=sv=2019-02-02&ss=t&sig=S",
        )
        .unwrap();
        assert_eq!(sas.account(), "only");
        assert_eq!(
            sas.table_endpoint().as_deref(),
            Some("https://only.table.core.windows.net")
        );
        let e = StorageAccount::from_connection_string("AccountName=a;AccountKey=c2VjcmV0;TableEndpoint=::")
            .unwrap_err()
            .to_string();
        assert!(e.contains("TableEndpoint is not a URL"), "{e}");
    }

    #[test]
    fn explicit_endpoints_as_azurite_on_other_ports() {
        let cs = StorageAccount::emulator_connection_string("127.0.0.1", 41000, 41001, 41002);
        let a = StorageAccount::from_connection_string(&cs).unwrap();
        assert_eq!(a.account(), "devstoreaccount1");
        assert_eq!(a.blob_endpoint(), "http://127.0.0.1:41000/devstoreaccount1");
        assert_eq!(a.queue_endpoint(), "http://127.0.0.1:41001/devstoreaccount1");
        assert_eq!(
            a.table_endpoint().as_deref(),
            Some("http://127.0.0.1:41002/devstoreaccount1")
        );
        assert_eq!(
            StorageAccount::emulator("127.0.0.1", 41000, 41001, 41002).table_endpoint(),
            a.table_endpoint()
        );
        assert_eq!(
            a.url(Service::Blob, "locks").as_str(),
            "http://127.0.0.1:41000/devstoreaccount1/locks"
        );
    }

    #[test]
    fn sas_with_endpoints() {
        let a = StorageAccount::from_connection_string(
            "BlobEndpoint=https://acct.blob.core.windows.net/;QueueEndpoint=https://acct.queue.core.windows.net/;\
             SharedAccessSignature=sv=2022-11-02&ss=bq&srt=sco&sp=rwdlacup&se=2030-01-01T00:00:00Z&sig=SECRETSIG",
        )
        .unwrap();
        assert_eq!(a.account(), "acct");
        assert_eq!(a.blob_endpoint(), "https://acct.blob.core.windows.net");
        assert!(!format!("{a:?}").contains("SECRETSIG"));
        assert_eq!(
            a.url(Service::Queue, "triggers").as_str(),
            "https://acct.queue.core.windows.net/triggers"
        );
    }

    /// Issue 44: Blob and Queue endpoints without a Table endpoint (the form the docs once
    /// showed) give no Table endpoint, never a derived `<account>.table.core.windows.net` (the
    /// account's public host behind a private endpoint, plain HTTP with `http`); the same for
    /// identity settings. With an explicit one, or none explicit, as before; what is shown of
    /// it carries no SAS.
    #[test]
    fn no_table_endpoint_is_derived_beside_explicit_blob_or_queue_endpoints() {
        for cs in [
            "DefaultEndpointsProtocol=http;AccountName=acct;AccountKey=c2VjcmV0;\
             BlobEndpoint=http://10.0.0.4/acct;QueueEndpoint=http://10.0.0.5/acct",
            "BlobEndpoint=https://acct.privatelink.blob.core.windows.net/;\
             QueueEndpoint=https://acct.privatelink.queue.core.windows.net/;SharedAccessSignature=sv=1&sig=S",
            "AccountName=acct;AccountKey=c2VjcmV0;BlobEndpoint=https://blob.example.net/acct",
            "AccountName=acct;AccountKey=c2VjcmV0;QueueEndpoint=https://queue.example.net/acct",
        ] {
            let a = StorageAccount::from_connection_string(cs).unwrap();
            assert_eq!(a.table_endpoint(), None, "{cs}");
            assert!(!a.has_table_endpoint());
            assert!(!format!("{a:?}").contains(".table."), "{a:?}");
        }
        let with_table = StorageAccount::from_connection_string(
            "AccountName=acct;AccountKey=c2VjcmV0;BlobEndpoint=https://10.0.0.4/acct;\
             QueueEndpoint=https://10.0.0.5/acct;TableEndpoint=https://10.0.0.6/acct?sv=1&sig=SECRET",
        )
        .unwrap();
        assert_eq!(
            with_table.table_endpoint().as_deref(),
            Some("https://10.0.0.6/acct")
        );
        let by_identity = identity(&[
            ("AzureWebJobsStorage__blobServiceUri", "https://10.0.0.4/acct"),
            ("AzureWebJobsStorage__queueServiceUri", "https://10.0.0.5/acct"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(by_identity.table_endpoint(), None);
        let by_name = identity(&[("AzureWebJobsStorage__accountName", "acct")])
            .unwrap()
            .unwrap();
        assert_eq!(
            by_name.table_endpoint().as_deref(),
            Some("https://acct.table.core.windows.net"),
            "nothing explicit: all three derived"
        );
    }

    #[test]
    fn errors_name_the_problem_and_never_the_key() {
        for (cs, expect) in [
            ("", "empty"),
            ("AccountName=x", "neither AccountKey"),
            ("this is not it", "Key=Value"),
            ("AccountKey=TOPSECRETKEY", "no credentials"),
        ] {
            let e = StorageAccount::from_connection_string(cs)
                .unwrap_err()
                .to_string();
            assert!(e.contains(expect), "{cs:?} gave {e}");
            assert!(!e.contains("TOPSECRET"), "{e}");
        }
        let a = StorageAccount::from_connection_string("AccountName=a;AccountKey=TOPSECRETKEY").unwrap();
        let debug = format!("{a:?}");
        assert!(!debug.contains("TOPSECRET"), "{debug}");
        assert!(debug.contains("table_endpoint"), "{debug}");
    }

    fn identity(
        pairs: &[(&str, &str)],
    ) -> Option<std::result::Result<StorageAccount, InvalidIdentitySettings>> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        StorageAccount::from_identity_settings("AzureWebJobsStorage", |name| map.get(name).cloned())
    }

    #[test]
    fn identity_settings_name_the_account_and_the_https_endpoints() {
        assert!(
            identity(&[]).is_none(),
            "no identity settings: not identity-based"
        );
        let a = identity(&[
            ("AzureWebJobsStorage__accountName", "prodacct"),
            ("AzureWebJobsStorage__credential", "managedidentity"),
            (
                "AzureWebJobsStorage__clientId",
                "7d3c2b1a-0f9e-4d8c-8b7a-6f5e4d3c2b1a",
            ),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(a.account(), "prodacct");
        assert_eq!(a.blob_endpoint(), "https://prodacct.blob.core.windows.net");
        assert_eq!(a.queue_endpoint(), "https://prodacct.queue.core.windows.net");
        assert_eq!(
            a.table_endpoint().as_deref(),
            Some("https://prodacct.table.core.windows.net")
        );
        assert!(a.token_credential().is_some());
        let custom = identity(&[
            (
                "AzureWebJobsStorage__blobServiceUri",
                "https://127.0.0.1:41000/devstoreaccount1",
            ),
            (
                "AzureWebJobsStorage__queueServiceUri",
                "https://127.0.0.1:41001/devstoreaccount1",
            ),
            (
                "AzureWebJobsStorage__tableServiceUri",
                "https://127.0.0.1:41002/devstoreaccount1",
            ),
            ("AzureWebJobsStorage__credential", "ManagedIdentity"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(custom.account(), "devstoreaccount1");
        assert_eq!(
            custom.table_endpoint().as_deref(),
            Some("https://127.0.0.1:41002/devstoreaccount1")
        );
        assert!(
            identity(&[(
                "AzureWebJobsStorage__tableServiceUri",
                "https://a.table.core.windows.net"
            )])
            .is_none(),
            "a table endpoint alone does not make the settings identity-based"
        );
        assert_eq!(
            custom.queue_endpoint(),
            "https://127.0.0.1:41001/devstoreaccount1"
        );
    }

    #[test]
    fn identity_settings_that_cannot_work_are_refused_by_name() {
        for (pairs, expect) in [
            (
                vec![(
                    "AzureWebJobsStorage__blobServiceUri",
                    "http://127.0.0.1:10000/devstoreaccount1",
                )],
                "AzureWebJobsStorage__blobServiceUri must be https",
            ),
            (
                vec![
                    ("AzureWebJobsStorage__accountName", "a"),
                    ("AzureWebJobsStorage__credential", "clientsecret"),
                ],
                "AzureWebJobsStorage__credential",
            ),
            (
                vec![(
                    "AzureWebJobsStorage__queueServiceUri",
                    "https://a.queue.core.windows.net",
                )],
                "set AzureWebJobsStorage__accountName",
            ),
            (
                vec![
                    ("AzureWebJobsStorage__accountName", "a"),
                    (
                        "AzureWebJobsStorage__tableServiceUri",
                        "http://a.table.core.windows.net",
                    ),
                ],
                "AzureWebJobsStorage__tableServiceUri must be https",
            ),
        ] {
            let e = identity(&pairs).unwrap().map(drop).unwrap_err().to_string();
            assert!(e.contains(expect), "{pairs:?}: {e}");
        }
    }
}
