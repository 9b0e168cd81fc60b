//! The HTTP server of both modes: hyper's HTTP/1 connections with their read deadlines, a bound
//! on open connections, and a deadline on graceful shutdown.
//!
//! What holds a hostile client to a bounded cost:
//!
//! - **Request head** (request line and headers, `max_header_size`): at most
//!   [`MAX_HEADER_BYTES`], else 431; it must arrive within `header_timeout` (hyper's
//!   `header_read_timeout`), else the connection is closed. A connection waiting for its next
//!   request (idle, kept alive) is waiting for a head too, so it is closed by the same deadline:
//!   the idle-connection timeout *is* the header-read timeout.
//! - **Body**: read only after Start checked the key from the head, and all of it within
//!   `body_timeout`, else 408 (`leasehold_functions::http`).
//! - **Connections**: at most `max_connections` open; the accept loop takes no more until one
//!   closes, so further clients wait in the kernel's listen backlog, costing this process no
//!   descriptor. The bound is kept below the descriptor limit with room left for storage and the
//!   logic ([`connection_bound`]). The trade-off: while a flood holds every slot, an honest
//!   request waits for a slot (at most the header-read deadline, which frees the slot of any
//!   client that sends nothing useful) instead of the process running out of descriptors, and
//!   runs in progress keep their storage connections.
//! - **Shutdown**: connections are told to finish; any still open after `shutdown_timeout` are
//!   closed.

use std::sync::Arc;
use std::time::Duration;

use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

/// Largest request head (request line and headers) accepted; a larger one is answered 431.
/// Dataverse's and the Functions host's heads are a few KiB.
pub const MAX_HEADER_BYTES: usize = 16 * 1024;

/// Most header fields in a request head (more: 431).
const MAX_HEADERS: usize = 64;

/// hyper's read buffer per connection (the head must fit in it; body chunks pass through it).
const READ_BUFFER_BYTES: usize = 64 * 1024;

/// Descriptors kept for everything but HTTP connections whatever the concurrency: the listener,
/// the runtime's, logs, the queue consumer's and the storage clients' own connections.
const RESERVED_DESCRIPTORS: u64 = 64;

/// Descriptors kept per run in progress: its storage connections (lease renewal, markers,
/// queue) and its logic (a supervisor process's pipes, or a connection to the logic URL).
const DESCRIPTORS_PER_RUN: u64 = 16;

/// Fewest connections the bound goes down to, even under a tiny descriptor limit.
const MIN_CONNECTIONS: usize = 8;

/// The limits of the HTTP side, from the `LEASEHOLD_HTTP_*` settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpOptions {
    /// A request head must arrive within this; a connection that sends none (idle, or kept
    /// alive between requests) is closed after it.
    pub header_timeout: Duration,
    /// A request body must arrive, all of it, within this (408 otherwise).
    pub body_timeout: Duration,
    /// On shutdown, connections still open after this are closed.
    pub shutdown_timeout: Duration,
    /// Most connections open at once (before [`connection_bound`] caps it to the descriptors).
    pub max_connections: usize,
}

impl Default for HttpOptions {
    fn default() -> Self {
        Self {
            header_timeout: Duration::from_secs(10),
            body_timeout: Duration::from_secs(30),
            shutdown_timeout: Duration::from_secs(10),
            max_connections: 1024,
        }
    }
}

/// The connection bound: `configured`, lowered if needed so that `descriptor_limit` (the soft
/// `RLIMIT_NOFILE`; `None`: unknown or unlimited) leaves descriptors for storage and for
/// `concurrency` runs of the logic. Returns the bound and, when it was lowered, why.
pub fn connection_bound(
    configured: usize,
    descriptor_limit: Option<u64>,
    concurrency: usize,
) -> (usize, Option<String>) {
    let Some(limit) = descriptor_limit else {
        return (configured, None);
    };
    let reserved = RESERVED_DESCRIPTORS + DESCRIPTORS_PER_RUN * concurrency as u64;
    let available = usize::try_from(limit.saturating_sub(reserved)).unwrap_or(usize::MAX);
    if configured <= available {
        return (configured, None);
    }
    let bound = available.max(MIN_CONNECTIONS);
    (
        bound,
        Some(format!(
            "the descriptor limit (RLIMIT_NOFILE) is {limit}; {reserved} are kept for storage and \
             {concurrency} runs, so at most {bound} HTTP connections are taken instead of \
             LEASEHOLD_HTTP_MAX_CONNECTIONS={configured} (raise the limit, e.g. `ulimit -n`, to take more)"
        )),
    )
}

/// The soft limit on open descriptors, if there is one.
#[cfg(unix)]
pub fn descriptor_limit() -> Option<u64> {
    use nix::sys::resource::{Resource, getrlimit};
    match getrlimit(Resource::RLIMIT_NOFILE) {
        Ok((soft, _hard)) if soft != nix::sys::resource::RLIM_INFINITY => Some(soft),
        _ => None,
    }
}

#[cfg(not(unix))]
pub fn descriptor_limit() -> Option<u64> {
    None
}

/// Serves `router` on `listener` until `stop` fires, then shuts the HTTP side down within
/// `options.shutdown_timeout`. `options.max_connections` is taken as it is: cap it with
/// [`connection_bound`] first.
pub async fn serve(
    listener: TcpListener,
    router: axum::Router,
    options: &HttpOptions,
    stop: CancellationToken,
) {
    let slots = Arc::new(Semaphore::new(options.max_connections));
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(options.header_timeout)
        .max_header_size(MAX_HEADER_BYTES)
        .max_headers(MAX_HEADERS)
        .max_buf_size(READ_BUFFER_BYTES);
    let graceful = GracefulShutdown::new();
    let mut connections = JoinSet::new();
    loop {
        // A slot first: with every slot taken, further clients wait in the listen backlog.
        let slot = tokio::select! {
            () = stop.cancelled() => break,
            slot = slots.clone().acquire_owned() => slot.expect("the semaphore is never closed"),
        };
        let (stream, _peer) = tokio::select! {
            () = stop.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    // Out of descriptors or memory, or the client gave up: pause so a persistent
                    // error does not spin, then take the next one.
                    tracing::warn!(error = %e, "http: accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
        };
        while connections.try_join_next().is_some() {}
        let _ = stream.set_nodelay(true);
        let connection =
            http.serve_connection(TokioIo::new(stream), TowerToHyperService::new(router.clone()));
        let connection = graceful.watch(connection);
        connections.spawn(async move {
            if let Err(e) = connection.await {
                tracing::debug!(error = %e, "http: connection closed with an error");
            }
            drop(slot);
        });
    }
    // Stop accepting: from here new connections are refused.
    drop(listener);
    let open = graceful.count();
    match tokio::time::timeout(options.shutdown_timeout, graceful.shutdown()).await {
        Ok(()) => tracing::debug!(open, "http: every connection finished"),
        Err(_) => {
            tracing::warn!(
                still_open = connections.len(),
                deadline = ?options.shutdown_timeout,
                "http: connections still open at the shutdown deadline are closed"
            );
            connections.abort_all();
        }
    }
    while connections.join_next().await.is_some() {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_connection_bound_leaves_descriptors_for_storage_and_the_logic() {
        // Plenty of descriptors: the setting stands.
        assert_eq!(connection_bound(1024, Some(1_048_576), 8), (1024, None));
        assert_eq!(connection_bound(1024, None, 8), (1024, None));
        // 1,024 descriptors and 8 runs: 64 + 8 × 16 = 192 kept, 832 left; 256 fits.
        assert_eq!(connection_bound(256, Some(1024), 8), (256, None));
        // Asking for more than is left is capped, and says why.
        let (bound, why) = connection_bound(1024, Some(1024), 8);
        assert_eq!(bound, 832);
        let why = why.unwrap();
        assert!(
            why.contains("1024") && why.contains("832") && why.contains("LEASEHOLD_HTTP_MAX_CONNECTIONS"),
            "{why}"
        );
        // A tiny limit still takes a few connections.
        assert_eq!(connection_bound(256, Some(100), 8).0, MIN_CONNECTIONS);
    }
}
