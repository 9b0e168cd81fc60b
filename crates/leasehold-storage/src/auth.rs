//! Authorising requests without Entra ID: Shared Key (every request signed with the account key,
//! as Azure Functions' own storage connection does) or a shared access signature from the
//! connection string. Both are `azure_core` pipeline policies run on every attempt, just before
//! the request is sent, so they sign exactly what goes on the wire. The official crates carry no
//! key-based credential (they take Entra ID tokens only); these are the few lines that replace it.
//!
//! The Table service (run history) has no official crate at all and signs Shared Key requests
//! with a shorter string of its own ([`table_string_to_sign`]); a SAS and a token work for it as
//! for blobs and queues.

use std::collections::BTreeMap;
use std::sync::Arc;

use async_trait::async_trait;
use azure_core::credentials::Secret;
use azure_core::http::policies::{Policy, PolicyResult};
use azure_core::http::{Context, Request};
use azure_core::time::{OffsetDateTime, to_rfc7231};

use crate::account::{Credential, Service};

/// The policy that authorises requests to `service` with `credential` for `account`; none for a
/// token credential, which the SDK's own bearer-token policy serves.
pub(crate) fn policy(account: &str, credential: &Credential, service: Service) -> Option<Arc<dyn Policy>> {
    match credential {
        Credential::Key(key) => Some(Arc::new(SharedKey {
            account: account.to_string(),
            key: Secret::new(key.clone()),
            table: service == Service::Table,
        })),
        Credential::Sas(pairs) => Some(Arc::new(Sas { pairs: pairs.clone() })),
        Credential::Token(_) => None,
    }
}

/// Signs each request with Shared Key: `Authorization: SharedKey <account>:<signature>`.
#[derive(Debug)]
struct SharedKey {
    account: String,
    key: Secret,
    /// Signed as the Table service expects ([`table_string_to_sign`]), not as blobs and queues.
    table: bool,
}

// `Context` carries a lifetime the trait leaves elided; naming it here would not match the trait.
#[allow(elided_lifetimes_in_paths)]
#[async_trait]
impl Policy for SharedKey {
    async fn send(&self, ctx: &Context, request: &mut Request, next: &[Arc<dyn Policy>]) -> PolicyResult {
        // A fresh date and signature on every attempt.
        request.insert_header("x-ms-date", to_rfc7231(&OffsetDateTime::now_utc()));
        let to_sign = if self.table {
            table_string_to_sign(&self.account, request)
        } else {
            string_to_sign(&self.account, request)
        };
        let signature = azure_core::hmac::hmac_sha256(&to_sign, &self.key)?;
        request.insert_header("authorization", format!("SharedKey {}:{signature}", self.account));
        next[0].send(ctx, request, &next[1..]).await
    }
}

fn header<'a>(request: &'a Request, name: &str) -> &'a str {
    request
        .headers()
        .iter()
        .find(|(k, _)| k.as_str().eq_ignore_ascii_case(name))
        .map(|(_, v)| v.as_str())
        .unwrap_or("")
}

/// The Shared Key string to sign (service versions from 2015-02-21 on): verb, the standard
/// headers (an empty or zero `Content-Length` as empty), the `x-ms-` headers sorted, and the
/// canonicalized resource `/<account><path>` with the query parameters sorted, one per line.
fn string_to_sign(account: &str, request: &Request) -> String {
    let mut content_length = header(request, "content-length").to_string();
    if content_length.is_empty() {
        content_length = request.body().len().map(|n| n.to_string()).unwrap_or_default();
    }
    if content_length == "0" {
        content_length.clear();
    }
    let mut s = format!("{}\n", request.method().as_str());
    for name in ["content-encoding", "content-language"] {
        s.push_str(header(request, name));
        s.push('\n');
    }
    s.push_str(&content_length);
    s.push('\n');
    for name in [
        "content-md5",
        "content-type",
        "date",
        "if-modified-since",
        "if-match",
        "if-none-match",
        "if-unmodified-since",
        "range",
    ] {
        s.push_str(header(request, name));
        s.push('\n');
    }
    let ms_headers: BTreeMap<String, &str> = request
        .headers()
        .iter()
        .map(|(k, v)| (k.as_str().to_ascii_lowercase(), v.as_str().trim()))
        .filter(|(k, _)| k.starts_with("x-ms-"))
        .collect();
    for (name, value) in ms_headers {
        s.push_str(&format!("{name}:{value}\n"));
    }
    // Path-style URLs (Azurite) already start with the account: it then appears twice, as the
    // emulator expects.
    s.push('/');
    s.push_str(account);
    s.push_str(request.url().path());
    let mut query: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (k, v) in request.url().query_pairs() {
        query
            .entry(k.to_ascii_lowercase())
            .or_default()
            .push(v.into_owned());
    }
    for (name, mut values) in query {
        values.sort();
        s.push_str(&format!("\n{name}:{}", values.join(",")));
    }
    s
}

/// The Table service's Shared Key string to sign (every version from 2009-09-19 on): the verb,
/// `Content-MD5`, `Content-Type`, the date, and the canonicalized resource, one per line. No other
/// header is signed. The date is `x-ms-date` (which the policy always sets; `Date` only if it were
/// absent). The resource is `/<account><path>` as sent (still percent-encoded), with `?comp=<v>`
/// appended only when the request has a `comp` parameter: the `$filter`, `$top` and continuation
/// parameters are not signed. Path-style URLs (Azurite) name the account twice, as for blobs.
fn table_string_to_sign(account: &str, request: &Request) -> String {
    let mut date = header(request, "x-ms-date");
    if date.is_empty() {
        date = header(request, "date");
    }
    let mut s = format!(
        "{}\n{}\n{}\n{date}\n/{account}{}",
        request.method().as_str(),
        header(request, "content-md5"),
        header(request, "content-type"),
        request.url().path()
    );
    if let Some((_, comp)) = request.url().query_pairs().find(|(k, _)| k == "comp") {
        s.push_str("?comp=");
        s.push_str(&comp);
    }
    s
}

/// Adds a shared access signature's parameters to each request.
#[derive(Debug)]
struct Sas {
    pairs: Vec<(String, String)>,
}

#[allow(elided_lifetimes_in_paths)]
#[async_trait]
impl Policy for Sas {
    async fn send(&self, ctx: &Context, request: &mut Request, next: &[Arc<dyn Policy>]) -> PolicyResult {
        request.url_mut().query_pairs_mut().extend_pairs(&self.pairs);
        next[0].send(ctx, request, &next[1..]).await
    }
}

#[cfg(test)]
mod tests {
    use azure_core::http::{Method, Url};

    use super::*;

    /// The layout of the Shared Key string to sign, checked field by field: the signature Azure
    /// (and Azurite) compute from the same request must come out the same.
    #[test]
    fn the_string_to_sign_is_laid_out_as_storage_expects() {
        let url =
            Url::parse("http://127.0.0.1:10000/devstoreaccount1/locks/a%2Fb?comp=lease&Timeout=30&comp=x")
                .unwrap();
        let mut request = Request::new(url, Method::Put);
        request.insert_header("x-ms-version", "2026-04-06");
        request.insert_header("x-ms-date", "Sun, 22 Nov 2026 17:00:00 GMT");
        request.insert_header("x-ms-lease-action", " acquire ");
        request.insert_header("if-match", "\"0x1\"");
        request.insert_header("content-length", "0");
        let expected = [
            "PUT",
            "",
            "",
            "",
            "",
            "",
            "",
            "",
            "\"0x1\"",
            "",
            "",
            "",
            "x-ms-date:Sun, 22 Nov 2026 17:00:00 GMT",
            "x-ms-lease-action:acquire",
            "x-ms-version:2026-04-06",
            "/devstoreaccount1/devstoreaccount1/locks/a%2Fb",
            "comp:lease,x",
            "timeout:30",
        ]
        .join("\n");
        assert_eq!(string_to_sign("devstoreaccount1", &request), expected);
    }

    /// The Table service's shorter layout: verb, Content-MD5, Content-Type, date, resource; no
    /// `x-ms-` header lines and no query parameters but `comp`.
    #[test]
    fn the_table_string_to_sign_is_laid_out_as_the_table_service_expects() {
        let url = Url::parse(
            "http://127.0.0.1:10002/devstoreaccount1/runs202611()?$filter=PartitionKey%20eq%20%27a%27&$top=5&NextRowKey=1!4!eA--",
        )
        .unwrap();
        let mut request = Request::new(url, Method::Get);
        request.insert_header("x-ms-version", "2019-02-02");
        request.insert_header("x-ms-date", "Sun, 22 Nov 2026 17:00:00 GMT");
        request.insert_header("accept", "application/json;odata=nometadata");
        request.insert_header("dataserviceversion", "3.0");
        assert_eq!(
            table_string_to_sign("devstoreaccount1", &request),
            "GET\n\n\nSun, 22 Nov 2026 17:00:00 GMT\n/devstoreaccount1/devstoreaccount1/runs202611()"
        );

        let url = Url::parse("https://acct.table.core.windows.net/Tables").unwrap();
        let mut request = Request::new(url, Method::Post);
        request.insert_header("x-ms-date", "Sun, 22 Nov 2026 17:00:00 GMT");
        request.insert_header("content-type", "application/json");
        request.insert_header("content-md5", "bWQ1");
        assert_eq!(
            table_string_to_sign("acct", &request),
            "POST\nbWQ1\napplication/json\nSun, 22 Nov 2026 17:00:00 GMT\n/acct/Tables"
        );

        // Only `comp` joins the resource (Get Table ACL).
        let url = Url::parse("https://acct.table.core.windows.net/runs?comp=acl&timeout=30").unwrap();
        let mut request = Request::new(url, Method::Get);
        request.insert_header("date", "Sun, 22 Nov 2026 17:00:00 GMT");
        assert_eq!(
            table_string_to_sign("acct", &request),
            "GET\n\n\nSun, 22 Nov 2026 17:00:00 GMT\n/acct/runs?comp=acl"
        );
    }
}
