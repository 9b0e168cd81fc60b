//! Storage account settings from a connection string, as users already write them in
//! `AzureWebJobsStorage`: `UseDevelopmentStorage=true` (Azurite), `AccountName`/`AccountKey` with
//! an `EndpointSuffix` or explicit `BlobEndpoint`/`QueueEndpoint`, and `SharedAccessSignature`.
//! Error messages name what is wrong, never a value (values may be secrets).

use std::fmt;

use azure_storage::{CloudLocation, ConnectionString, EndpointProtocol, StorageCredentials};

/// A connection string that cannot be used, and why (never quoting a value: values may be
/// secrets).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct InvalidConnectionString(String);

type Result<T> = std::result::Result<T, InvalidConnectionString>;

/// Azurite's well-known development account. Not a secret: it is published by Microsoft.
pub const EMULATOR_ACCOUNT: &str = "devstoreaccount1";
/// Azurite's well-known development key (public, documented by Microsoft).
pub const EMULATOR_KEY: &str =
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw==";

/// Where a storage account is and how to sign requests to it.
#[derive(Clone)]
pub struct StorageAccount {
    account: String,
    credentials: StorageCredentials,
    blob: CloudLocation,
    queue: CloudLocation,
    emulator: bool,
}

impl fmt::Debug for StorageAccount {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StorageAccount")
            .field("account", &self.account)
            .field("blob_endpoint", &self.blob_endpoint())
            .field("queue_endpoint", &self.queue_endpoint())
            .field("credentials", &"<redacted>")
            .finish()
    }
}

impl StorageAccount {
    /// Parses a connection string. `UseDevelopmentStorage=true` means Azurite on its default ports.
    pub fn from_connection_string(text: &str) -> Result<Self> {
        let text = text.trim();
        if text.is_empty() {
            return Err(InvalidConnectionString("the connection string is empty".into()));
        }
        let cs = ConnectionString::new(text).map_err(|_| {
            InvalidConnectionString(
                "not a storage connection string: expected Key=Value pairs separated by ';' \
                 (e.g. UseDevelopmentStorage=true, or AccountName=...;AccountKey=...)"
                    .into(),
            )
        })?;
        if cs.use_development_storage == Some(true) {
            let (host, blob_port, queue_port) = match cs.development_storage_proxy_uri {
                Some(uri) => {
                    let url = url_host(uri)?;
                    (url, 10000, 10001)
                }
                None => ("127.0.0.1".to_string(), 10000, 10001),
            };
            return Ok(Self::emulator(&host, blob_port, queue_port));
        }

        let credentials = if let Some(sas) = cs.sas {
            StorageCredentials::sas_token(sas).map_err(|_| {
                InvalidConnectionString("SharedAccessSignature is not a valid SAS token".into())
            })?
        } else {
            match (cs.account_name, cs.account_key) {
                (Some(name), Some(key)) => StorageCredentials::access_key(name.to_string(), key.to_string()),
                (Some(_), None) => {
                    return Err(InvalidConnectionString(
                        "AccountName is set but neither AccountKey nor SharedAccessSignature is".into(),
                    ));
                }
                _ => {
                    return Err(InvalidConnectionString(
                        "no credentials: set AccountName and AccountKey, or SharedAccessSignature".into(),
                    ));
                }
            }
        };

        let protocol = match cs.default_endpoints_protocol {
            Some(EndpointProtocol::Http) => "http",
            _ => "https",
        };
        let account = match (cs.account_name, cs.blob_endpoint.or(cs.queue_endpoint)) {
            (Some(name), _) => name.to_string(),
            (None, Some(endpoint)) => account_from_endpoint(endpoint)?,
            (None, None) => {
                return Err(InvalidConnectionString(
                    "set AccountName, or BlobEndpoint and QueueEndpoint".into(),
                ));
            }
        };
        let suffix = cs.endpoint_suffix.unwrap_or("core.windows.net");
        let location = |explicit: Option<&str>, service: &str| -> Result<CloudLocation> {
            match explicit {
                Some(uri) => {
                    url::Url::parse(uri)
                        .map_err(|_| InvalidConnectionString(format!("{service}Endpoint is not a URL")))?;
                    Ok(CloudLocation::Custom {
                        account: account.clone(),
                        uri: uri.trim_end_matches('/').to_string(),
                    })
                }
                None if suffix == "core.windows.net" && protocol == "https" => Ok(CloudLocation::Public {
                    account: account.clone(),
                }),
                None => Ok(CloudLocation::Custom {
                    account: account.clone(),
                    uri: format!("{protocol}://{account}.{}.{suffix}", service.to_ascii_lowercase()),
                }),
            }
        };
        let blob = location(cs.blob_endpoint, "Blob")?;
        let queue = location(cs.queue_endpoint, "Queue")?;
        Ok(Self {
            account,
            credentials,
            blob,
            queue,
            emulator: false,
        })
    }

    /// Azurite (or the legacy emulator) at `host` on the given ports, with the well-known account.
    pub fn emulator(host: &str, blob_port: u16, queue_port: u16) -> Self {
        let account = EMULATOR_ACCOUNT.to_string();
        Self {
            credentials: StorageCredentials::access_key(account.clone(), EMULATOR_KEY.to_string()),
            blob: CloudLocation::Custom {
                account: account.clone(),
                uri: format!("http://{host}:{blob_port}/{account}"),
            },
            queue: CloudLocation::Custom {
                account: account.clone(),
                uri: format!("http://{host}:{queue_port}/{account}"),
            },
            account,
            emulator: true,
        }
    }

    /// A connection string for Azurite at `host` with explicit endpoints (what tests hand to the
    /// binary).
    pub fn emulator_connection_string(host: &str, blob_port: u16, queue_port: u16) -> String {
        format!(
            "DefaultEndpointsProtocol=http;AccountName={EMULATOR_ACCOUNT};AccountKey={EMULATOR_KEY};\
             BlobEndpoint=http://{host}:{blob_port}/{EMULATOR_ACCOUNT};\
             QueueEndpoint=http://{host}:{queue_port}/{EMULATOR_ACCOUNT};"
        )
    }

    pub fn account(&self) -> &str {
        &self.account
    }

    pub fn credentials(&self) -> &StorageCredentials {
        &self.credentials
    }

    pub fn blob_location(&self) -> &CloudLocation {
        &self.blob
    }

    pub fn queue_location(&self) -> &CloudLocation {
        &self.queue
    }

    /// Whether this is the emulator (Azurite).
    pub fn is_emulator(&self) -> bool {
        self.emulator || self.account == EMULATOR_ACCOUNT
    }

    /// The blob endpoint URL (no secrets in it).
    pub fn blob_endpoint(&self) -> String {
        endpoint(&self.blob, "blob")
    }

    /// The queue endpoint URL (no secrets in it).
    pub fn queue_endpoint(&self) -> String {
        endpoint(&self.queue, "queue")
    }
}

fn endpoint(location: &CloudLocation, service: &str) -> String {
    match location {
        CloudLocation::Public { account } => format!("https://{account}.{service}.core.windows.net"),
        CloudLocation::China { account } => format!("https://{account}.{service}.core.chinacloudapi.cn"),
        CloudLocation::Emulator { address, port } => format!("http://{address}:{port}/{EMULATOR_ACCOUNT}"),
        CloudLocation::Custom { uri, .. } => uri.clone(),
    }
}

fn url_host(uri: &str) -> Result<String> {
    let url = url::Url::parse(uri)
        .map_err(|_| InvalidConnectionString("DevelopmentStorageProxyUri is not a URL".into()))?;
    url.host_str()
        .map(str::to_string)
        .ok_or_else(|| InvalidConnectionString("DevelopmentStorageProxyUri has no host".into()))
}

/// `https://acct.blob.core.windows.net` → `acct`; `http://127.0.0.1:10000/devstoreaccount1` →
/// `devstoreaccount1` (path-style, as Azurite uses).
fn account_from_endpoint(endpoint: &str) -> Result<String> {
    let url =
        url::Url::parse(endpoint).map_err(|_| InvalidConnectionString("BlobEndpoint is not a URL".into()))?;
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
        .ok_or_else(|| {
            InvalidConnectionString("cannot tell the account name from BlobEndpoint; set AccountName".into())
        })
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
        let sovereign = StorageAccount::from_connection_string(
            "DefaultEndpointsProtocol=https;AccountName=g;AccountKey=c2VjcmV0;EndpointSuffix=core.usgovcloudapi.net",
        )
        .unwrap();
        assert_eq!(sovereign.blob_endpoint(), "https://g.blob.core.usgovcloudapi.net");
    }

    #[test]
    fn explicit_endpoints_as_azurite_on_other_ports() {
        let cs = StorageAccount::emulator_connection_string("127.0.0.1", 41000, 41001);
        let a = StorageAccount::from_connection_string(&cs).unwrap();
        assert_eq!(a.account(), "devstoreaccount1");
        assert_eq!(a.blob_endpoint(), "http://127.0.0.1:41000/devstoreaccount1");
        assert_eq!(a.queue_endpoint(), "http://127.0.0.1:41001/devstoreaccount1");
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
        assert!(!format!("{a:?}").contains("TOPSECRET"));
    }
}
