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
//! - **Answers**: once a write cannot complete at once, everything the connection has to send
//!   must be taken by the client within `write_timeout`, else the connection is closed
//!   ([`Deadlined`]). That one deadline covers a client that stops reading (no progress) and one
//!   that reads a byte at a time (progress, but a response pending too long). Without it, a
//!   client that pipelines requests and never reads its answers held its slot for ever.
//! - **Connection age**: at most [`MAX_CONNECTION_AGE`] (then the request being answered is
//!   finished and the connection closed), whatever it does.
//! - **Requests per connection**: at most [`MAX_REQUESTS_PER_CONNECTION`]; the last one's
//!   answer says `Connection: close`. With hyper's bounded read buffer (pipelined requests not
//!   yet answered wait there, at most [`READ_BUFFER_BYTES`]), a pipelining client costs a bounded
//!   amount of memory and time.
//! - **Connections**: at most `max_connections` open. At the bound a new client closes the
//!   connection that has waited longest for a request head (idle, kept alive between requests,
//!   or sending its head slowly), as the health listener does: a flood of idle connections no
//!   longer keeps an honest request waiting until the header deadline sheds it (issue 35: 4.1 s
//!   behind 1,500 idle connections). A connection whose request is being read or answered is
//!   never closed to make room: with every connection busy so, the accept loop takes no more until
//!   one ends or waits for a head again, and further clients wait in the kernel's listen
//!   backlog, costing this process no descriptor. The bound is kept below the descriptor limit
//!   with room left for storage and the logic ([`connection_bound`]). The trade-off: a flood that
//!   opens connections faster than honest clients use theirs closes their kept-alive idle
//!   connections too (they reconnect), instead of the process running out of descriptors; runs
//!   in progress keep their storage connections.
//! - **Health**: with a health port set ([`serve_health`]), the liveness probe has a listener
//!   of its own that a flood of the main port cannot starve, and whose slots go to the newest
//!   connections (a flood of the health port itself has to open 64 connections within the
//!   milliseconds a probe takes; keep the port to the node, e.g. with a NetworkPolicy).
//! - **Shutdown**: connections are told to finish; any still open after `shutdown_timeout` are
//!   closed.

use std::collections::{HashMap, VecDeque};
use std::convert::Infallible;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::http::{HeaderValue, Request, header};
use tower::ServiceExt;

use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpListener;
use tokio::sync::Notify;
use tokio::task::{AbortHandle, JoinSet};
use tokio::time::Sleep;
use tokio_util::sync::CancellationToken;

/// Largest request head (request line and headers) accepted; a larger one is answered 431.
/// Dataverse's and the Functions host's heads are a few KiB.
pub const MAX_HEADER_BYTES: usize = 16 * 1024;

/// Most header fields in a request head (more: 431).
const MAX_HEADERS: usize = 64;

/// hyper's read buffer per connection (the head must fit in it; body chunks pass through it;
/// pipelined requests wait in it).
pub const READ_BUFFER_BYTES: usize = 64 * 1024;

/// Descriptors kept for everything but HTTP connections whatever the concurrency: the listener,
/// the runtime's, logs, the queue consumer's and the storage clients' own connections.
const RESERVED_DESCRIPTORS: u64 = 64;

/// Descriptors kept per run in progress: its storage connections (lease renewal, markers,
/// queue) and its logic (a supervisor process's pipes, or a connection to the logic URL).
const DESCRIPTORS_PER_RUN: u64 = 16;

/// Fewest connections the bound goes down to, even under a tiny descriptor limit.
const MIN_CONNECTIONS: usize = 8;

/// Most requests one connection may make; the answer to the last says `Connection: close`.
/// Honest clients (the Functions host, Dataverse, a browser) reconnect without a fuss.
pub const MAX_REQUESTS_PER_CONNECTION: usize = 1000;

/// Longest a connection is kept ([`HttpOptions::max_age`]'s default): past it, it finishes the
/// request it is answering and closes. A client that sends a request now and then and never
/// reads (its answers fitting in the socket buffers, so the write deadline never starts) held a
/// slot for up to [`MAX_REQUESTS_PER_CONNECTION`] × the header deadline, hours; honest clients
/// reconnect.
pub const MAX_CONNECTION_AGE: Duration = Duration::from_secs(300);

/// Connections the health listener keeps open at once; a newer one closes the oldest. Enough
/// that a flood would have to open this many within the few milliseconds a probe takes.
const HEALTH_CONNECTIONS: usize = 64;

/// The health listener's deadline for a request head and for its answer to be taken.
const HEALTH_TIMEOUT: Duration = Duration::from_secs(2);

/// The limits of the HTTP side, from the `LEASEHOLD_HTTP_*` settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpOptions {
    /// A request head must arrive within this; a connection that sends none (idle, or kept
    /// alive between requests) is closed after it.
    pub header_timeout: Duration,
    /// A request body must arrive, all of it, within this (408 otherwise).
    pub body_timeout: Duration,
    /// Once a write cannot complete at once, the client must take everything there is to send
    /// within this, else the connection is closed.
    pub write_timeout: Duration,
    /// On shutdown, connections still open after this are closed.
    pub shutdown_timeout: Duration,
    /// A connection older than this finishes the request it is answering and closes
    /// ([`MAX_CONNECTION_AGE`]; not a setting).
    pub max_age: Duration,
    /// Most connections open at once (before [`connection_bound`] caps it to the descriptors).
    pub max_connections: usize,
}

impl Default for HttpOptions {
    fn default() -> Self {
        Self {
            header_timeout: Duration::from_secs(10),
            body_timeout: Duration::from_secs(30),
            write_timeout: Duration::from_secs(30),
            shutdown_timeout: Duration::from_secs(10),
            max_age: MAX_CONNECTION_AGE,
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
    let open = Arc::new(Open::default());
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(options.header_timeout)
        .max_header_size(MAX_HEADER_BYTES)
        .max_headers(MAX_HEADERS)
        .max_buf_size(READ_BUFFER_BYTES);
    let mut connections = JoinSet::new();
    loop {
        // Room first: a free slot, or a connection waiting for a head to close for one. With
        // every connection answering a request, further clients wait in the listen backlog.
        if !open.room(options.max_connections, &stop, false).await {
            break;
        }
        let Some(stream) = accept(&listener, &stop).await else {
            break;
        };
        while connections.try_join_next().is_some() {}
        // At the bound: close the connection that has waited longest for a head (or, if every
        // one got a request meanwhile, wait for one to end, this client's descriptor in hand).
        if !open.room(options.max_connections, &stop, true).await {
            break;
        }
        let id = open.admit();
        let conn = ConnRef::new(&open, id);
        let io = TokioIo::new(Deadlined::new(stream, options.write_timeout).telling(conn.clone()));
        let connection = http.serve_connection(io, counted(router.clone(), conn));
        let stop = stop.clone();
        let max_age = options.max_age;
        let slot = Tracked::new(&open, id);
        let task = connections.spawn(async move {
            let mut connection = std::pin::pin!(connection);
            // At shutdown or at its age limit, the connection finishes the request it is
            // answering (a Worker invocation's run included) and closes.
            let ended = tokio::select! {
                ended = connection.as_mut() => Some(ended),
                () = stop.cancelled() => None,
                () = tokio::time::sleep(max_age) => None,
            };
            let ended = match ended {
                Some(ended) => ended,
                None => {
                    connection.as_mut().graceful_shutdown();
                    connection.await
                }
            };
            if let Err(e) = ended {
                tracing::debug!(error = %e, "http: connection closed with an error");
            }
            drop(slot);
        });
        open.started(id, task);
    }
    // Stop accepting: from here new connections are refused.
    drop(listener);
    let open = connections.len();
    let drained = tokio::time::timeout(options.shutdown_timeout, async {
        while connections.join_next().await.is_some() {}
    })
    .await;
    match drained {
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

/// The next connection, or `None` once `stop` fires. A failed accept (out of descriptors or
/// memory, or the client gave up) pauses a little, so a persistent error does not spin.
async fn accept(listener: &TcpListener, stop: &CancellationToken) -> Option<tokio::net::TcpStream> {
    loop {
        tokio::select! {
            () = stop.cancelled() => return None,
            accepted = listener.accept() => match accepted {
                Ok((stream, _peer)) => {
                    let _ = stream.set_nodelay(true);
                    return Some(stream);
                }
                Err(e) => {
                    tracing::warn!(error = %e, "http: accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            },
        }
    }
}

/// `router` as one connection's service: the answer to its
/// [`MAX_REQUESTS_PER_CONNECTION`]th request says `Connection: close`, and hyper closes the
/// connection once it is written. It tells `conn` when a request arrives (its head has been
/// read) and when its answer has been sent (hyper drops the answer's body then): from then on
/// the connection waits for a head again, and may be closed to make room.
fn counted(
    router: axum::Router,
    conn: ConnRef,
) -> impl hyper::service::Service<
    Request<hyper::body::Incoming>,
    Response = axum::response::Response,
    Error = Infallible,
    Future = impl Future<Output = Result<axum::response::Response, Infallible>> + Send,
> + Clone {
    let served = Arc::new(AtomicUsize::new(0));
    hyper::service::service_fn(move |request: Request<hyper::body::Incoming>| {
        let last = served.fetch_add(1, Ordering::Relaxed) + 1 >= MAX_REQUESTS_PER_CONNECTION;
        let router = router.clone();
        // Busy until the answer is sent (or this request is dropped); `None`: the connection was
        // just closed to make room (its task is being aborted), so nothing is started for it.
        let busy = conn.busy();
        async move {
            let Some(busy) = busy else {
                let mut response = axum::response::Response::new(axum::body::Body::empty());
                *response.status_mut() = axum::http::StatusCode::SERVICE_UNAVAILABLE;
                response
                    .headers_mut()
                    .insert(header::CONNECTION, HeaderValue::from_static("close"));
                return Ok(response);
            };
            let mut response = router.oneshot(request).await?;
            if last {
                response
                    .headers_mut()
                    .insert(header::CONNECTION, HeaderValue::from_static("close"));
            }
            // The answer's body holds `busy`: hyper drops it once it is written.
            Ok(response.map(|inner| axum::body::Body::new(Answer { inner, _busy: busy })))
        }
    })
}

/// The connections [`serve`] has open, and which of them wait for a request head (since when),
/// to make room at the bound by closing the one that has waited longest.
#[derive(Debug, Default)]
struct Open {
    state: Mutex<OpenState>,
    /// Told when a connection ends or starts waiting for a head again.
    changed: Notify,
}

#[derive(Debug, Default)]
struct OpenState {
    connections: HashMap<u64, Connection>,
    /// Ids of connections, and the order in which they started waiting for a head.
    seq: u64,
}

#[derive(Debug)]
struct Connection {
    /// A request is being read or answered: its head arrived, and its answer's body has not
    /// been dropped by hyper yet.
    busy: bool,
    /// Output the client has not taken yet: a write could not complete at once, and no flush
    /// has completed since ([`Deadlined`]). An answer still going out is not closed for room.
    unsent: bool,
    /// When it last became free of a request (or was opened): the `n`th event of
    /// [`OpenState::seq`]; a smaller `n` has waited longer.
    since: u64,
    /// Its task, once spawned.
    task: Option<AbortHandle>,
}

impl Connection {
    /// Waiting for a request head: idle, kept alive, or sending a head.
    fn waiting(&self) -> bool {
        !self.busy && !self.unsent
    }
}

impl OpenState {
    fn next(&mut self) -> u64 {
        self.seq += 1;
        self.seq
    }
}

impl Open {
    fn lock(&self) -> std::sync::MutexGuard<'_, OpenState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Waits until there is room for one more connection under `max`: a free slot, or (then
    /// closing it with `evict`) a connection waiting for a head. `false` once `stop` fires.
    async fn room(&self, max: usize, stop: &CancellationToken, evict: bool) -> bool {
        loop {
            let changed = self.changed.notified();
            let mut changed = std::pin::pin!(changed);
            changed.as_mut().enable();
            {
                let mut state = self.lock();
                if state.connections.len() < max {
                    return true;
                }
                let longest = state
                    .connections
                    .iter()
                    .filter(|(_, c)| c.waiting())
                    .map(|(id, c)| (c.since, *id))
                    .min();
                if let Some((_, id)) = longest {
                    if !evict {
                        return true;
                    }
                    if let Some(task) = state.connections.remove(&id).and_then(|c| c.task) {
                        task.abort();
                    }
                    tracing::debug!(
                        open = state.connections.len() + 1,
                        max,
                        "http: at the connection bound, closed the connection waiting longest for a request head"
                    );
                    return true;
                }
            }
            tokio::select! {
                () = stop.cancelled() => return false,
                () = changed => {}
            }
        }
    }

    /// A new connection, waiting for its first head: its id.
    fn admit(&self) -> u64 {
        let mut state = self.lock();
        let id = state.next();
        state.connections.insert(
            id,
            Connection {
                busy: false,
                unsent: false,
                since: id,
                task: None,
            },
        );
        id
    }

    /// Connection `id`'s task (to abort it to make room), unless it has ended already.
    fn started(&self, id: u64, task: AbortHandle) {
        if let Some(c) = self.lock().connections.get_mut(&id) {
            c.task = Some(task);
        }
    }

    /// Connection `id` ended (or was closed to make room).
    fn closed(&self, id: u64) {
        self.lock().connections.remove(&id);
        self.changed.notify_waiters();
    }

    /// A request arrived on connection `id`: `false` if it was closed to make room.
    fn request(&self, id: u64) -> bool {
        match self.lock().connections.get_mut(&id) {
            Some(c) => {
                c.busy = true;
                true
            }
            None => false,
        }
    }

    /// Connection `id`'s answer was sent (its body taken by hyper): it waits for a head again,
    /// once the client has taken what there is to send.
    fn answered(&self, id: u64) {
        {
            let mut state = self.lock();
            let since = state.next();
            if let Some(c) = state.connections.get_mut(&id) {
                c.busy = false;
                c.since = since;
            }
        }
        self.changed.notify_waiters();
    }

    /// Connection `id` has output the client has not taken (`true`), or it took it all.
    fn unsent(&self, id: u64, unsent: bool) {
        if let Some(c) = self.lock().connections.get_mut(&id) {
            c.unsent = unsent;
        }
        if !unsent {
            self.changed.notify_waiters();
        }
    }
}

/// One connection of [`Open`], held by its task: dropped (the task ended or was aborted), the
/// connection is closed there.
struct Tracked(ConnRef);

impl Tracked {
    fn new(open: &Arc<Open>, id: u64) -> Self {
        Self(ConnRef::new(open, id))
    }
}

impl Drop for Tracked {
    fn drop(&mut self) {
        self.0.open.closed(self.0.id);
    }
}

/// One connection of [`Open`], as its service and its stream see it.
#[derive(Debug, Clone)]
struct ConnRef {
    open: Arc<Open>,
    id: u64,
}

impl ConnRef {
    fn new(open: &Arc<Open>, id: u64) -> Self {
        Self {
            open: open.clone(),
            id,
        }
    }

    /// A request arrived: busy until the returned guard is dropped; `None` if the connection was
    /// closed to make room.
    fn busy(&self) -> Option<Busy> {
        self.open.request(self.id).then(|| Busy {
            open: self.open.clone(),
            id: self.id,
        })
    }
}

/// An answer's body holding its connection [`Busy`] until hyper drops it, once it is written
/// (or the connection ends); its size and end are the body's own.
struct Answer {
    inner: axum::body::Body,
    _busy: Busy,
}

impl hyper::body::Body for Answer {
    type Data = <axum::body::Body as hyper::body::Body>::Data;
    type Error = <axum::body::Body as hyper::body::Body>::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<hyper::body::Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.get_mut().inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.inner.size_hint()
    }
}

/// A request being read or answered on a connection of [`Open`].
struct Busy {
    open: Arc<Open>,
    id: u64,
}

impl Drop for Busy {
    fn drop(&mut self) {
        self.open.answered(self.id);
    }
}

/// Serves `GET /healthz` (`{"status":"ok"}`) on a listener of its own until `stop` fires: the
/// liveness probe's, which a flood of the main listener cannot starve. It keeps at most
/// [`HEALTH_CONNECTIONS`] connections, closing the oldest when a new one arrives (so a client
/// holding connections open cannot keep the probe out: it would have to open that many faster
/// than the probe is answered), each with a 2 s deadline on its request head and on its answer,
/// and one request per connection.
pub async fn serve_health(listener: TcpListener, stop: CancellationToken) {
    let router = axum::Router::new().route(
        "/healthz",
        axum::routing::get(|| async { axum::Json(serde_json::json!({ "status": "ok" })) }),
    );
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(HEALTH_TIMEOUT)
        .keep_alive(false)
        .max_header_size(MAX_HEADER_BYTES)
        .max_headers(MAX_HEADERS);
    let mut open: VecDeque<tokio::task::AbortHandle> = VecDeque::new();
    let mut connections = JoinSet::new();
    while let Some(stream) = accept(&listener, &stop).await {
        while connections.try_join_next().is_some() {}
        open.retain(|c| !c.is_finished());
        while open.len() >= HEALTH_CONNECTIONS {
            if let Some(oldest) = open.pop_front() {
                oldest.abort();
            }
        }
        let io = TokioIo::new(Deadlined::new(stream, HEALTH_TIMEOUT));
        let connection = http.serve_connection(io, TowerToHyperService::new(router.clone()));
        open.push_back(connections.spawn(async move {
            let _ = tokio::time::timeout(HEALTH_TIMEOUT * 2, connection).await;
        }));
    }
    connections.abort_all();
    while connections.join_next().await.is_some() {}
}

/// A connection's stream with a deadline on its output: once a write cannot complete at once
/// (the client's window is full), everything the server has to send must be taken within
/// `deadline`, counted from that first blocked write until the output is flushed; past it, every
/// write fails with [`io::ErrorKind::TimedOut`] and hyper closes the connection.
///
/// hyper flushes the stream (`poll_flush`) only once its own buffer is empty, so a completed
/// flush means every byte of every answer so far was taken: that disarms the deadline.
#[derive(Debug)]
pub struct Deadlined<S> {
    inner: S,
    deadline: Duration,
    /// Armed while output waits for the client.
    stalled: Option<Pin<Box<Sleep>>>,
    /// Told when output starts and stops waiting for the client ([`serve`]'s connections: one
    /// whose answer is still going out is not closed to make room).
    tell: Option<ConnRef>,
}

impl<S> Deadlined<S> {
    pub fn new(inner: S, deadline: Duration) -> Self {
        Self {
            inner,
            deadline,
            stalled: None,
            tell: None,
        }
    }

    /// This, telling `conn` when output starts and stops waiting for the client.
    fn telling(mut self, conn: ConnRef) -> Self {
        self.tell = Some(conn);
        self
    }

    /// Arms the deadline if it is not armed yet.
    fn waiting(&mut self) {
        if self.stalled.is_none() {
            self.stalled = Some(Box::pin(tokio::time::sleep(self.deadline)));
            if let Some(conn) = &self.tell {
                conn.open.unsent(conn.id, true);
            }
        }
    }

    /// Disarms the deadline: every byte so far was taken.
    fn taken(&mut self) {
        if self.stalled.take().is_some()
            && let Some(conn) = &self.tell
        {
            conn.open.unsent(conn.id, false);
        }
    }

    /// `Err` once the armed deadline has passed (and registers for its wake-up otherwise).
    fn check(&mut self, cx: &mut Context<'_>) -> io::Result<()> {
        let expired = match &mut self.stalled {
            Some(sleep) => sleep.as_mut().poll(cx).is_ready(),
            None => false,
        };
        if expired {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("the client did not take the answer within {:?}", self.deadline),
            ));
        }
        Ok(())
    }

    /// After a write of `offered` bytes answered `result`.
    fn wrote(
        &mut self,
        cx: &mut Context<'_>,
        offered: usize,
        result: Poll<io::Result<usize>>,
    ) -> Poll<io::Result<usize>> {
        match result {
            Poll::Ready(Ok(n)) => {
                if n < offered {
                    self.waiting();
                }
                Poll::Ready(Ok(n))
            }
            Poll::Pending => {
                self.waiting();
                match self.check(cx) {
                    Ok(()) => Poll::Pending,
                    Err(e) => Poll::Ready(Err(e)),
                }
            }
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Deadlined<S> {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Deadlined<S> {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if let Err(e) = this.check(cx) {
            return Poll::Ready(Err(e));
        }
        let result = Pin::new(&mut this.inner).poll_write(cx, buf);
        this.wrote(cx, buf.len(), result)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if let Err(e) = this.check(cx) {
            return Poll::Ready(Err(e));
        }
        let offered = bufs.iter().map(|b| b.len()).sum();
        let result = Pin::new(&mut this.inner).poll_write_vectored(cx, bufs);
        this.wrote(cx, offered, result)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if let Err(e) = this.check(cx) {
            return Poll::Ready(Err(e));
        }
        match Pin::new(&mut this.inner).poll_flush(cx) {
            Poll::Ready(Ok(())) => {
                this.taken();
                Poll::Ready(Ok(()))
            }
            Poll::Pending => {
                this.waiting();
                match this.check(cx) {
                    Ok(()) => Poll::Pending,
                    Err(e) => Poll::Ready(Err(e)),
                }
            }
            other => other,
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A server-side stream whose client (the other end, 64 bytes of buffer) reads nothing.
    fn stalled_pair(deadline: Duration) -> (Deadlined<tokio::io::DuplexStream>, tokio::io::DuplexStream) {
        let (server, client) = tokio::io::duplex(64);
        (Deadlined::new(server, deadline), client)
    }

    #[tokio::test(start_paused = true)]
    async fn a_client_that_reads_nothing_fails_the_write_at_the_deadline() {
        let (mut server, _client) = stalled_pair(Duration::from_secs(5));
        let from = tokio::time::Instant::now();
        let e = server.write_all(&[b'x'; 1000]).await.unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::TimedOut);
        assert_eq!(from.elapsed(), Duration::from_secs(5));
    }

    #[tokio::test(start_paused = true)]
    async fn a_client_that_reads_a_byte_at_a_time_fails_the_write_at_the_deadline_too() {
        let (mut server, mut client) = stalled_pair(Duration::from_secs(5));
        let trickle = tokio::spawn(async move {
            let mut byte = [0u8; 1];
            while client.read(&mut byte).await.unwrap_or(0) == 1 {
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        });
        let from = tokio::time::Instant::now();
        // Progress every 0.5 s, but 1,000 bytes would take 8 minutes.
        let e = server.write_all(&[b'x'; 1000]).await.unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::TimedOut);
        assert_eq!(from.elapsed(), Duration::from_secs(5));
        drop(server);
        trickle.await.unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn output_that_is_taken_in_time_disarms_the_deadline() {
        let (mut server, mut client) = stalled_pair(Duration::from_secs(5));
        let reader = tokio::spawn(async move {
            let mut buf = vec![0u8; 100];
            let mut total = 0;
            loop {
                // A client that takes 4 s per answer: each within the deadline.
                tokio::time::sleep(Duration::from_secs(4)).await;
                match client.read(&mut buf).await.unwrap() {
                    0 => return total,
                    n => total += n,
                }
            }
        });
        for _ in 0..5 {
            // 100 bytes: 64 fit, the rest wait for the reader's next read, 4 s later.
            server.write_all(&[b'x'; 100]).await.unwrap();
            server.flush().await.unwrap();
            // Then the next answer's output waits again: a fresh deadline, not the first's.
            tokio::time::sleep(Duration::from_secs(4)).await;
        }
        server.shutdown().await.unwrap();
        drop(server);
        assert_eq!(reader.await.unwrap(), 500);
    }

    /// A client that sends a request every 200 ms, reading nothing, is closed at the age limit
    /// (here 1 s), after its answers: without the limit it held its slot for as long as it kept
    /// sending (the header deadline never fires, the answers fit in the socket buffers).
    #[tokio::test]
    async fn a_connection_is_closed_at_its_age_limit_whatever_it_does() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let router = axum::Router::new().route("/healthz", axum::routing::get(|| async { "ok" }));
        let options = HttpOptions {
            max_age: Duration::from_secs(1),
            ..HttpOptions::default()
        };
        let stop = CancellationToken::new();
        let server = tokio::spawn({
            let stop = stop.clone();
            async move { serve(listener, router, &options, stop).await }
        });
        let stream = tokio::net::TcpStream::connect(("127.0.0.1", port)).await.unwrap();
        let (mut read, mut write) = stream.into_split();
        let sender = tokio::spawn(async move {
            while write
                .write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
                .await
                .is_ok()
            {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        });
        let opened = std::time::Instant::now();
        let mut answers = Vec::new();
        tokio::time::timeout(Duration::from_secs(10), read.read_to_end(&mut answers))
            .await
            .expect("the connection is closed at its age limit")
            .ok();
        let answered = String::from_utf8_lossy(&answers).matches("200 OK").count();
        assert!(
            opened.elapsed() >= Duration::from_millis(900) && answered >= 3,
            "closed after {:?} and {answered} answers",
            opened.elapsed()
        );
        sender.abort();
        stop.cancel();
        server.await.unwrap();
    }

    /// At the bound, a connection whose answer is still going out (its client has not taken it
    /// yet) is not closed to make room, though hyper already waits for its next head: a new
    /// client waits until the write deadline closes it.
    #[tokio::test]
    async fn at_the_bound_an_answer_still_going_out_is_not_closed_for_a_new_client() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let big = axum::body::Bytes::from(vec![b'x'; 16 << 20]);
        let router = axum::Router::new()
            .route(
                "/big",
                axum::routing::get(move || std::future::ready(big.clone())),
            )
            .route("/healthz", axum::routing::get(|| async { "ok" }));
        let options = HttpOptions {
            max_connections: 1,
            header_timeout: Duration::from_secs(60),
            write_timeout: Duration::from_secs(3),
            ..HttpOptions::default()
        };
        let stop = CancellationToken::new();
        let server = tokio::spawn({
            let stop = stop.clone();
            async move { serve(listener, router, &options, stop).await }
        });
        // A client that asks for 16 MiB and takes only the first bytes: once it has them, the
        // server's write of the rest has blocked.
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.set_recv_buffer_size(4096).unwrap();
        let mut slow = socket.connect(([127, 0, 0, 1], port).into()).await.unwrap();
        slow.write_all(b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        let mut first = [0u8; 12];
        slow.read_exact(&mut first).await.unwrap();
        assert_eq!(&first, b"HTTP/1.1 200");
        let opened = std::time::Instant::now();
        let mut next = tokio::net::TcpStream::connect(("127.0.0.1", port)).await.unwrap();
        next.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .await
            .unwrap();
        let mut answer = Vec::new();
        let early = tokio::time::timeout(Duration::from_secs(1), next.read_to_end(&mut answer)).await;
        assert!(
            early.is_err(),
            "answered while the other's answer was going out: {:?}",
            String::from_utf8_lossy(&answer)
        );
        tokio::time::timeout(Duration::from_secs(10), next.read_to_end(&mut answer))
            .await
            .expect("answered once the write deadline closed the other")
            .unwrap();
        assert!(String::from_utf8_lossy(&answer).starts_with("HTTP/1.1 200"));
        assert!(
            opened.elapsed() >= Duration::from_secs(2),
            "{:?}",
            opened.elapsed()
        );
        drop(slow);
        stop.cancel();
        server.await.unwrap();
    }

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
