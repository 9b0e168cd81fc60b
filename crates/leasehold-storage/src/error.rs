//! What a storage call answered when it failed: [`StoreError`], classified by [`StoreErrorKind`].

use std::fmt;
use std::time::Duration;

use crate::counters::Op;

/// What kind of answer a storage call got. Only [`StoreErrorKind::Transient`] is worth retrying.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum StoreErrorKind {
    /// 409 `LeaseAlreadyPresent`: another holder has the lease.
    LeaseAlreadyPresent,
    /// 409 `LeaseIsBreakingAndCannotBeAcquired`: the caller's own lease id is being broken —
    /// possibly from an acquire that took effect after the caller gave up on it. It is neither
    /// "held by another" (nobody will read a marker for it) nor free. (Someone else's breaking
    /// lease answers `LeaseAlreadyPresent`.)
    LeaseBreaking,
    /// 409/412 lease id missing, mismatched or not present: the lease we name is not (or no longer) ours.
    LeaseLost,
    /// 404: the blob or its container does not exist.
    NotFound,
    /// 412 `ConditionNotMet` (an `If-Match` / `If-None-Match` precondition failed).
    ConditionNotMet,
    /// A definitive refusal that retrying will not change: authentication, authorisation, a bad
    /// request. Fix the configuration.
    Rejected,
    /// 5xx, 408, 429, time-outs, connection errors: the same call may succeed later.
    Transient,
}

impl StoreErrorKind {
    /// A short name: the `class` label of `leasehold_storage_errors_total`.
    pub fn label(self) -> &'static str {
        match self {
            StoreErrorKind::LeaseAlreadyPresent => "lease_already_present",
            StoreErrorKind::LeaseBreaking => "lease_breaking",
            StoreErrorKind::LeaseLost => "lease_lost",
            StoreErrorKind::NotFound => "not_found",
            StoreErrorKind::ConditionNotMet => "condition_not_met",
            StoreErrorKind::Rejected => "rejected",
            StoreErrorKind::Transient => "transient",
        }
    }
}

/// One failed storage round trip. Its text never holds a secret: SAS signatures and account keys
/// are removed before it is built.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreError {
    kind: StoreErrorKind,
    op: Op,
    status: Option<u16>,
    code: Option<String>,
    message: String,
    /// No answer came: the request may still take effect later.
    timed_out: bool,
}

impl StoreError {
    /// Builds an error; `message` is redacted here, so callers may pass SDK text as it is.
    pub fn new(kind: StoreErrorKind, op: Op, message: impl Into<String>) -> Self {
        Self {
            kind,
            op,
            status: None,
            code: None,
            message: redact(&message.into()),
            timed_out: false,
        }
    }

    /// Adds the HTTP status and storage error code the service answered.
    pub fn with_status(mut self, status: u16, code: Option<String>) -> Self {
        self.status = Some(status);
        self.code = code;
        self
    }

    pub fn kind(&self) -> StoreErrorKind {
        self.kind
    }

    pub fn op(&self) -> Op {
        self.op
    }

    pub fn status(&self) -> Option<u16> {
        self.status
    }

    /// The storage error code (`LeaseAlreadyPresent`, `BlobNotFound`, ...), when one was given.
    pub fn code(&self) -> Option<&str> {
        self.code.as_deref()
    }

    pub fn is_transient(&self) -> bool {
        self.kind == StoreErrorKind::Transient
    }

    /// A transient error standing for a call that got no answer in time: it may have taken
    /// effect, or may still take effect after the caller gave up on it.
    pub fn timeout(op: Op, after: Duration) -> Self {
        let mut e = Self::new(
            StoreErrorKind::Transient,
            op,
            format!("no answer within {after:?}"),
        );
        e.timed_out = true;
        e
    }

    /// Whether the call got no answer at all (see [`StoreError::timeout`]).
    pub fn is_timeout(&self) -> bool {
        self.timed_out
    }

    /// The `class` label of `leasehold_storage_errors_total`: `timeout` for a call that got no
    /// answer in time, else its kind's [`StoreErrorKind::label`].
    pub fn class(&self) -> &'static str {
        if self.timed_out {
            "timeout"
        } else {
            self.kind.label()
        }
    }
}

impl fmt::Display for StoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} failed", self.op)?;
        if let Some(status) = self.status {
            write!(f, " with HTTP {status}")?;
        }
        if let Some(code) = &self.code {
            write!(f, " ({code})")?;
        }
        if !self.message.is_empty() {
            write!(f, ": {}", self.message)?;
        }
        Ok(())
    }
}

impl std::error::Error for StoreError {}

/// Result of one storage call.
pub type StoreResult<T> = std::result::Result<T, StoreError>;

/// Removes secrets from text that may quote a URL or a connection string: SAS signatures
/// (`sig=...`), account keys and shared-access keys. Everything else is kept.
pub fn redact(text: &str) -> String {
    const SECRET_NAMES: [&str; 4] = [
        "sig=",
        "AccountKey=",
        "SharedAccessSignature=",
        "SharedAccessKey=",
    ];
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    'outer: while !rest.is_empty() {
        for name in SECRET_NAMES {
            // Compared as bytes: `rest` may start with a character of several bytes (any
            // language's OS error text), where slicing the string by `name.len()` would panic.
            if rest
                .as_bytes()
                .get(..name.len())
                .is_some_and(|b| b.eq_ignore_ascii_case(name.as_bytes()))
            {
                out.push_str(&rest[..name.len()]);
                out.push_str("REDACTED");
                let end = rest[name.len()..]
                    .find(|c: char| c == '&' || c == ';' || c == '"' || c == '\'' || c.is_whitespace())
                    .map_or(rest.len(), |i| i + name.len());
                rest = &rest[end..];
                continue 'outer;
            }
        }
        let ch = rest.chars().next().expect("rest is not empty");
        out.push(ch);
        rest = &rest[ch.len_utf8()..];
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redact_removes_sas_signatures_and_keys() {
        let url = "https://acct.blob.core.windows.net/c/b?sv=2022-11-02&sig=abc%2Fdef%3D&se=2030";
        assert_eq!(
            redact(url),
            "https://acct.blob.core.windows.net/c/b?sv=2022-11-02&sig=REDACTED&se=2030"
        );
        let cs = "DefaultEndpointsProtocol=https;AccountName=a;AccountKey=c2VjcmV0Cg==;EndpointSuffix=x";
        assert_eq!(
            redact(cs),
            "DefaultEndpointsProtocol=https;AccountName=a;AccountKey=REDACTED;EndpointSuffix=x"
        );
        assert_eq!(redact("plain text, nothing secret"), "plain text, nothing secret");
        // Text in other languages: multi-byte characters where a secret name could start.
        let french = "Connexion refusée: échec à l'hôte; AccountKey=c2VjcmV0 — réessayez";
        assert_eq!(
            redact(french),
            "Connexion refusée: échec à l'hôte; AccountKey=REDACTED — réessayez"
        );
        assert_eq!(redact("é"), "é");
        assert_eq!(redact("ssssé"), "ssssé");
    }

    #[test]
    fn store_error_text_is_redacted_and_names_the_operation() {
        let e = StoreError::new(
            StoreErrorKind::Transient,
            Op::LeaseAcquire,
            "GET http://x/?sig=SECRET failed",
        )
        .with_status(503, Some("ServerBusy".into()));
        let text = e.to_string();
        assert!(!text.contains("SECRET"), "{text}");
        assert!(
            text.starts_with("lease acquire failed with HTTP 503 (ServerBusy)"),
            "{text}"
        );
    }
}
