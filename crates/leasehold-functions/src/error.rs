//! What can go wrong in the functions layer: a host invocation that is not what its
//! `function.json` declares, an unusable logic setting, and a logic run that failed. (A request
//! Start refuses is not an error of ours: it is a [`Rejection`](crate::start::Rejection), with
//! the HTTP status to answer.)

use std::path::PathBuf;

use leasehold_runtime::LogicError;

/// Everything the functions layer can report.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A custom-handler invocation without the binding its `function.json` declares.
    #[error("invocation has no Data.{0}")]
    MissingBinding(&'static str),
    /// `LEASEHOLD_LOGIC_URL` does not parse.
    #[error("not a URL: {0}")]
    InvalidUrl(#[from] url::ParseError),
    /// `LEASEHOLD_LOGIC_URL` is not http or https.
    #[error("the URL must be http or https, not {0}")]
    UnsupportedScheme(String),
    /// The supervisor of a logic command could not be started.
    #[error("could not start the logic supervisor {}: {error}", program.display())]
    Spawn { program: PathBuf, error: std::io::Error },
    /// The run was cancelled and its logic command stopped.
    #[error("the logic command was terminated (run cancelled)")]
    CommandTerminated,
    /// The logic command's exit could not be awaited.
    #[error("waiting for the logic command: {0}")]
    CommandWait(std::io::Error),
    /// The logic command failed; `stderr` is the end of what it wrote there.
    #[error("the logic command exited with {}{}", exit_text(*.code), stderr_suffix(.stderr))]
    CommandFailed { code: Option<i32>, stderr: String },
    /// The run was cancelled and its request to the logic URL abandoned.
    #[error("the logic request was abandoned (run cancelled)")]
    RequestAbandoned,
    /// The logic URL could not be reached. `target` is its host and path only: a query string
    /// may hold a key.
    #[error("logic URL {target}: {error}")]
    Request { target: String, error: reqwest::Error },
    /// The logic URL answered something other than 2xx; `body` is the start of its answer.
    #[error("logic URL {target} answered {status}: {body}")]
    Refused {
        target: String,
        status: reqwest::StatusCode,
        body: String,
    },
    /// The logic URL answered a redirect, which is not followed (a POST would become a GET).
    /// `location` is where it pointed, without its query string.
    #[error(
        "logic URL {target} answered {status} (to {location}); redirects are not followed: configure the final URL"
    )]
    Redirected {
        target: String,
        status: reqwest::StatusCode,
        location: String,
    },
    /// The HTTP client of the logic URL could not be built.
    #[error("building the HTTP client of the logic URL: {0}")]
    HttpClient(reqwest::Error),
    /// The demo logic was cancelled.
    #[error("demo logic cancelled")]
    DemoCancelled,
}

fn exit_text(code: Option<i32>) -> String {
    code.map_or_else(|| "a signal".to_string(), |c| format!("code {c}"))
}

fn stderr_suffix(stderr: &str) -> String {
    if stderr.is_empty() {
        String::new()
    } else {
        format!(": {stderr}")
    }
}

impl From<Error> for LogicError {
    fn from(error: Error) -> Self {
        LogicError::new(error)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_command_names_its_exit_and_stderr() {
        let failed = |code, stderr: &str| Error::CommandFailed {
            code,
            stderr: stderr.into(),
        };
        assert_eq!(
            failed(Some(3), "no such record").to_string(),
            "the logic command exited with code 3: no such record"
        );
        assert_eq!(
            failed(None, "").to_string(),
            "the logic command exited with a signal"
        );
        assert_eq!(
            LogicError::from(Error::CommandTerminated).message(),
            "the logic command was terminated (run cancelled)"
        );
    }
}
