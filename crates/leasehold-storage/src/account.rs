//! Storage account settings from a connection string, as users already write them in
//! `AzureWebJobsStorage`: `UseDevelopmentStorage=true` (Azurite), `AccountName`/`AccountKey` with
//! an `EndpointSuffix` or explicit `BlobEndpoint`/`QueueEndpoint`, and `SharedAccessSignature`.
//! Error messages name what is wrong, never a value (values may be secrets).

use std::collections::HashMap;
use std::fmt;

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
}

/// Where a storage account is and how to sign requests to it.
#[derive(Clone)]
pub struct StorageAccount {
    account: String,
    credential: Credential,
    blob: Url,
    queue: Url,
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
            return Ok(Self::emulator(&host, 10000, 10001));
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
        let account = match (get("AccountName"), get("BlobEndpoint").or(get("QueueEndpoint"))) {
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
        Ok(Self {
            account,
            credential,
            blob,
            queue,
            emulator: false,
        })
    }

    /// Azurite (or the legacy emulator) at `host` on the given ports, with the well-known account.
    pub fn emulator(host: &str, blob_port: u16, queue_port: u16) -> Self {
        let account = EMULATOR_ACCOUNT.to_string();
        let url =
            |port: u16| Url::parse(&format!("http://{host}:{port}/{account}")).expect("an emulator URL");
        Self {
            credential: Credential::Key(EMULATOR_KEY.to_string()),
            blob: url(blob_port),
            queue: url(queue_port),
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

    pub(crate) fn credential(&self) -> &Credential {
        &self.credential
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

    /// The URL of `path` (a container, a queue) under the blob or queue endpoint.
    pub fn url(&self, service: Service, path: &str) -> Url {
        let base = match service {
            Service::Blob => &self.blob,
            Service::Queue => &self.queue,
        };
        let mut url = base.clone();
        url.path_segments_mut()
            .expect("storage endpoints are base URLs")
            .pop_if_empty()
            .push(path);
        url
    }
}

/// A storage service of the account.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Service {
    Blob,
    Queue,
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
