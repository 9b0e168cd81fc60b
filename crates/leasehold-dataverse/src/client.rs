//! A small Dataverse Web API client: the OData headers on every request, the id of a created
//! record from `OData-EntityId`, the Web API's error body, 429 with `Retry-After`, 5xx retried
//! with backoff (reads, updates and deletes only: a create that failed with 5xx may have been
//! done), redirects off, timeouts. The bearer token goes in the `Authorization` header and
//! nowhere else.

use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail};
use reqwest::{Method, StatusCode, header};
use serde_json::Value;
use tokio::sync::Mutex;
use url::Url;
use uuid::Uuid;

use crate::credential::Credential;

/// An error answer of the Web API (the message says what and why; the status lets a caller
/// tell "it is gone" from other failures).
#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    message: String,
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for ApiError {}

/// Whether `e` is the Web API answering 404 (the record is not there, or no longer).
pub fn is_not_found(e: &anyhow::Error) -> bool {
    e.chain()
        .filter_map(|c| c.downcast_ref::<ApiError>())
        .any(|a| a.status == StatusCode::NOT_FOUND)
}

/// The Web API version every request uses.
pub const API_PATH: &str = "api/data/v9.2/";

/// How often and how long to retry.
#[derive(Debug, Clone)]
pub struct RetryPolicy {
    /// Retries after 429 Too Many Requests (each waits `Retry-After`).
    pub throttled: u32,
    /// The longest `Retry-After` we wait; a longer one is an error.
    pub max_wait: Duration,
    /// Retries after 5xx or a failed connection (not for creates).
    pub server_errors: u32,
    /// The first backoff after a 5xx; doubled each time.
    pub backoff: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            throttled: 5,
            max_wait: Duration::from_secs(300),
            server_errors: 3,
            backoff: Duration::from_secs(1),
        }
    }
}

/// Checks an environment or Start URL: https, or http on 127.0.0.1/localhost (tests).
pub fn check_url(raw: &str, what: &str) -> Result<Url> {
    let url = Url::parse(raw.trim()).with_context(|| format!("{what} '{raw}' is not a URL"))?;
    let host = url
        .host_str()
        .ok_or_else(|| anyhow!("{what} '{raw}' has no host"))?;
    let loopback = matches!(host, "127.0.0.1" | "localhost" | "[::1]");
    match url.scheme() {
        "https" => {}
        "http" if loopback => {}
        other => bail!("{what} '{raw}' must be https (http only for 127.0.0.1 or localhost), not {other}"),
    }
    if !url.username().is_empty() || url.password().is_some() {
        bail!("{what} must not carry credentials");
    }
    Ok(url)
}

/// The environment's base URL (`https://<org>.crm.dynamics.com`, no path).
pub fn environment_url(raw: &str) -> Result<Url> {
    let mut url = check_url(raw, "--environment-url")?;
    if !matches!(url.path(), "" | "/") || url.query().is_some() {
        bail!(
            "--environment-url '{raw}' must be the environment's address only, like https://contoso.crm.dynamics.com (no path such as /api/data)"
        );
    }
    url.set_path("/");
    Ok(url)
}

/// The token scope for an environment: `<environment-url>/.default`.
pub fn scope(environment: &Url) -> String {
    format!("{}/.default", environment.as_str().trim_end_matches('/'))
}

/// Percent-encodes an OData query value (spaces as %20, never '+').
pub fn encode_query_value(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    for b in value.bytes() {
        match b {
            b'A'..=b'Z'
            | b'a'..=b'z'
            | b'0'..=b'9'
            | b'-'
            | b'.'
            | b'_'
            | b'~'
            | b'\''
            | b'('
            | b')'
            | b','
            | b'/'
            | b'$'
            | b':' => out.push(b as char),
            _ => out.push_str(&format!("%{b:02X}")),
        }
    }
    out
}

/// `set?$select=..&$filter=..` with the values encoded.
pub fn query(resource: &str, options: &[(&str, &str)]) -> String {
    let mut out = resource.to_owned();
    for (i, (k, v)) in options.iter().enumerate() {
        out.push(if i == 0 { '?' } else { '&' });
        out.push_str(k);
        out.push('=');
        out.push_str(&encode_query_value(v));
    }
    out
}

/// An OData string literal: quoted, quotes doubled.
pub fn literal(value: &str) -> String {
    format!("'{}'", value.replace('\'', "''"))
}

/// The Web API client for one environment. Its `Debug` leaves the token out.
pub struct WebApi {
    http: reqwest::Client,
    environment: Url,
    api: Url,
    credential: Credential,
    token: Mutex<Option<String>>,
    retry: RetryPolicy,
}

impl std::fmt::Debug for WebApi {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WebApi")
            .field("environment", &self.environment.as_str())
            .field("credential", &self.credential)
            .finish_non_exhaustive()
    }
}

impl WebApi {
    pub fn new(environment: Url, credential: Credential, retry: RetryPolicy) -> Result<Self> {
        let api = environment.join(API_PATH)?;
        let http = reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .connect_timeout(Duration::from_secs(10))
            .timeout(Duration::from_secs(60))
            .build()
            .context("building the HTTP client")?;
        Ok(WebApi {
            http,
            environment,
            api,
            credential,
            token: Mutex::new(None),
            retry,
        })
    }

    /// The absolute URL of a resource path (`serviceendpoints(…)`, with its query).
    pub fn url(&self, path: &str) -> Result<Url> {
        Ok(self.api.join(path)?)
    }

    pub fn environment(&self) -> &Url {
        &self.environment
    }

    async fn bearer(&self) -> Result<String> {
        let mut token = self.token.lock().await;
        if let Some(t) = token.as_ref() {
            return Ok(t.clone());
        }
        let t = self.credential.token(&scope(&self.environment)).await?;
        *token = Some(t.clone());
        Ok(t)
    }

    /// GET a resource; the JSON answer.
    pub async fn get(&self, path: &str) -> Result<Value> {
        let response = self.send(Method::GET, path, None).await?;
        let text = response.text().await.context("reading the answer")?;
        serde_json::from_str(&text).with_context(|| format!("GET {path}: the answer is not JSON"))
    }

    /// GET a collection; its `value` array.
    pub async fn get_all(&self, path: &str) -> Result<Vec<Value>> {
        let mut out = Vec::new();
        let mut page = self.get(path).await?;
        loop {
            match page.get_mut("value").map(Value::take) {
                Some(Value::Array(items)) => out.extend(items),
                _ => bail!("GET {path}: the answer has no 'value' array"),
            }
            let Some(next) = page.get("@odata.nextLink").and_then(Value::as_str) else {
                return Ok(out);
            };
            // Follow the server's own link only when it stays on this environment's API.
            let next = Url::parse(next).context("@odata.nextLink")?;
            let rest = next
                .as_str()
                .strip_prefix(self.api.as_str())
                .ok_or_else(|| anyhow!("GET {path}: @odata.nextLink leaves the environment"))?
                .to_owned();
            page = self.get(&rest).await?;
        }
    }

    /// POST to an entity set; the new record's id (from `OData-EntityId`).
    pub async fn create(&self, set: &str, body: &Value) -> Result<Uuid> {
        let response = self.send(Method::POST, set, Some(body)).await?;
        let id = response
            .headers()
            .get("OData-EntityId")
            .and_then(|v| v.to_str().ok())
            .ok_or_else(|| {
                anyhow!(
                    "POST {set}: the answer ({}) has no OData-EntityId header",
                    response.status()
                )
            })?;
        entity_id(id).ok_or_else(|| anyhow!("POST {set}: cannot read the id in OData-EntityId '{id}'"))
    }

    /// PATCH a record.
    pub async fn update(&self, path: &str, body: &Value) -> Result<()> {
        self.send(Method::PATCH, path, Some(body)).await?;
        Ok(())
    }

    /// DELETE a record.
    pub async fn delete(&self, path: &str) -> Result<()> {
        self.send(Method::DELETE, path, None).await?;
        Ok(())
    }

    /// DELETE a record that may already be gone (another run deleted it): whether it was here.
    pub async fn delete_if_there(&self, path: &str) -> Result<bool> {
        match self.delete(path).await {
            Ok(()) => Ok(true),
            Err(e) if is_not_found(&e) => Ok(false),
            Err(e) => Err(e),
        }
    }

    async fn send(&self, method: Method, path: &str, body: Option<&Value>) -> Result<reqwest::Response> {
        let url = self.url(path)?;
        let idempotent = method != Method::POST;
        let mut throttled = 0;
        let mut failures = 0;
        loop {
            let token = self.bearer().await?;
            let mut request = self
                .http
                .request(method.clone(), url.clone())
                .bearer_auth(token)
                .header("OData-MaxVersion", "4.0")
                .header("OData-Version", "4.0")
                .header(header::ACCEPT, "application/json");
            if let Some(body) = body {
                request = request
                    .header(header::CONTENT_TYPE, "application/json; charset=utf-8")
                    .body(serde_json::to_vec(body)?);
            }
            let response = match request.send().await {
                Ok(r) => r,
                Err(e) if idempotent && failures < self.retry.server_errors => {
                    failures += 1;
                    let wait = self.retry.backoff * 2u32.pow(failures - 1);
                    eprintln!(
                        "… {method} {path}: {} ; retrying in {} s",
                        short(&e),
                        wait.as_secs_f32()
                    );
                    tokio::time::sleep(wait).await;
                    continue;
                }
                Err(e) => return Err(anyhow!("{method} {url}: {}", short(&e))),
            };
            let status = response.status();
            if status.is_success() {
                return Ok(response);
            }
            if status == StatusCode::TOO_MANY_REQUESTS && throttled < self.retry.throttled {
                let wait = retry_after(response.headers()).unwrap_or(Duration::from_secs(5));
                if wait > self.retry.max_wait {
                    bail!(
                        "{method} {path}: Dataverse's service protection limits asked to wait {} s (Retry-After), more than the {} s this command waits: try again later",
                        wait.as_secs(),
                        self.retry.max_wait.as_secs()
                    );
                }
                throttled += 1;
                eprintln!(
                    "… {method} {path}: 429 Too Many Requests (Dataverse service protection); waiting {} s as Retry-After asks",
                    wait.as_secs_f32()
                );
                tokio::time::sleep(wait).await;
                continue;
            }
            if status.is_server_error() && idempotent && failures < self.retry.server_errors {
                failures += 1;
                let wait = self.retry.backoff * 2u32.pow(failures - 1);
                eprintln!(
                    "… {method} {path}: {status}; retrying in {} s",
                    wait.as_secs_f32()
                );
                tokio::time::sleep(wait).await;
                continue;
            }
            let text = response.text().await.unwrap_or_default();
            return Err(self.error(&method, path, status, &text));
        }
    }

    fn error(&self, method: &Method, path: &str, status: StatusCode, body: &str) -> anyhow::Error {
        let detail = error_detail(body);
        let mut message = format!("Dataverse answered {status} to {method} {path}");
        if let Some(detail) = detail {
            message.push_str(": ");
            message.push_str(&detail);
        }
        match status {
            StatusCode::UNAUTHORIZED => {
                message.push_str(&format!(
                    ".\nThe credential used was {}. A 401 means the environment did not accept the token: \
                     it is for another environment or expired, or {} has no user in {}.",
                    self.credential.describe(),
                    if self.credential.is_application() {
                        "the application"
                    } else {
                        "the signed-in account"
                    },
                    self.environment.as_str().trim_end_matches('/')
                ));
                message.push_str(&role_hint(&self.credential));
            }
            StatusCode::FORBIDDEN => {
                message.push_str(&format!(
                    ".\nThe credential used was {}.",
                    self.credential.describe()
                ));
                message.push_str(&role_hint(&self.credential));
            }
            StatusCode::TOO_MANY_REQUESTS => {
                message.push_str(&format!(
                    " (still throttled after {} retries; Dataverse's service protection limits: try again later)",
                    self.retry.throttled
                ));
            }
            _ => {}
        }
        anyhow::Error::new(ApiError { status, message })
    }
}

fn role_hint(credential: &Credential) -> String {
    let who = if credential.is_application() {
        "Its application user in the environment (Power Platform admin center > Environment > Settings > Users + permissions > Application users)"
    } else {
        "The user"
    };
    format!(
        " {who} needs a security role with Create, Read, Write and Delete on Service Endpoint and \
         SDK Message Processing Step, and Read on SDK Message and SDK Message Filter: System Customizer \
         or System Administrator have them (see docs/dataverse.md)."
    )
}

/// reqwest errors name the URL; the token is never in it. Keep the chain short.
fn short(e: &reqwest::Error) -> String {
    let mut text = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

/// `Retry-After` in seconds (the form Dataverse sends; an HTTP date is not expected).
pub fn retry_after(headers: &header::HeaderMap) -> Option<Duration> {
    let value = headers.get(header::RETRY_AFTER)?.to_str().ok()?.trim();
    if let Ok(secs) = value.parse::<u64>() {
        return Some(Duration::from_secs(secs));
    }
    value
        .parse::<f64>()
        .ok()
        .filter(|s| s.is_finite() && *s >= 0.0)
        // Too long for a Duration (`1e20`): the longest, which the wait limit then refuses.
        .map(|s| Duration::try_from_secs_f64(s).unwrap_or(Duration::MAX))
}

/// The Web API error body: `{"error":{"code":"0x…","message":"…"}}`.
pub fn error_detail(body: &str) -> Option<String> {
    let value: Value = serde_json::from_str(body).ok()?;
    let error = value.get("error")?;
    let message = error.get("message").and_then(Value::as_str).unwrap_or("").trim();
    let code = error.get("code").and_then(Value::as_str).unwrap_or("").trim();
    match (code.is_empty(), message.is_empty()) {
        (true, true) => None,
        (true, false) => Some(message.to_owned()),
        (false, true) => Some(code.to_owned()),
        (false, false) => Some(format!("{message} ({code})")),
    }
}

/// The id in `…/serviceendpoints(00000000-0000-0000-0000-000000000000)`.
pub fn entity_id(header: &str) -> Option<Uuid> {
    let open = header.rfind('(')?;
    let close = header[open..].find(')')? + open;
    Uuid::parse_str(&header[open + 1..close]).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls() {
        assert!(environment_url("https://contoso.crm.dynamics.com").is_ok());
        assert!(environment_url("https://contoso.crm.dynamics.com/").is_ok());
        assert!(environment_url("http://127.0.0.1:9000").is_ok());
        let e = environment_url("http://contoso.crm.dynamics.com")
            .unwrap_err()
            .to_string();
        assert!(e.contains("must be https"), "{e}");
        let e = environment_url("https://contoso.crm.dynamics.com/api/data/v9.2")
            .unwrap_err()
            .to_string();
        assert!(e.contains("address only"), "{e}");
        let env = environment_url("https://contoso.crm4.dynamics.com/").unwrap();
        assert_eq!(scope(&env), "https://contoso.crm4.dynamics.com/.default");
    }

    #[test]
    fn query_encoding() {
        assert_eq!(
            query(
                "sdkmessagefilters",
                &[("$filter", "sdkmessageid/name eq 'Update' and x eq 1")]
            ),
            "sdkmessagefilters?$filter=sdkmessageid/name%20eq%20'Update'%20and%20x%20eq%201"
        );
        assert_eq!(encode_query_value("a+b&c#"), "a%2Bb%26c%23");
        assert_eq!(literal("it's"), "'it''s'");
    }

    #[test]
    fn ids_and_errors() {
        let id = Uuid::new_v4();
        assert_eq!(
            entity_id(&format!(
                "https://x.crm.dynamics.com/api/data/v9.2/serviceendpoints({id})"
            )),
            Some(id)
        );
        assert_eq!(entity_id("nothing"), None);
        assert_eq!(
            error_detail(r#"{"error":{"code":"0x80040217","message":"Not there"}}"#).as_deref(),
            Some("Not there (0x80040217)")
        );
        assert_eq!(error_detail("<html>"), None);
        let mut h = header::HeaderMap::new();
        h.insert(header::RETRY_AFTER, "7".parse().unwrap());
        assert_eq!(retry_after(&h), Some(Duration::from_secs(7)));
        h.insert(header::RETRY_AFTER, "1e20".parse().unwrap());
        assert_eq!(retry_after(&h), Some(Duration::MAX));
        h.insert(header::RETRY_AFTER, "1.5".parse().unwrap());
        assert_eq!(retry_after(&h), Some(Duration::from_millis(1500)));
    }
}
