//! The watchdog message of a delivery in Functions mode (see the runner's module docs): put
//! hidden before the delivery touches the lease, pushed a lease ahead just before each renewal, and
//! deleted when the delivery ends — or rewritten into the delivery's retry or recheck.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use leasehold_lock::{RetryOptions, StoreError, StoreErrorKind};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::message::TriggerMessage;
use crate::queue::TriggerQueue;

/// A hidden message standing in for a delivery until the delivery ends.
#[derive(Debug)]
pub(crate) struct Watchdog {
    queue: Arc<dyn TriggerQueue>,
    retry: RetryOptions,
    id: String,
    /// The body the message has now (an update must send one).
    body: Mutex<String>,
    /// The latest pop receipt; each update returns a new one.
    receipt: Mutex<String>,
}

impl Watchdog {
    /// Puts `message`, visible only after `visibility`.
    pub(crate) async fn arm(
        queue: Arc<dyn TriggerQueue>,
        retry: &RetryOptions,
        message: &TriggerMessage,
        visibility: Duration,
    ) -> Result<Self, StoreError> {
        let body = message.encode();
        let put = retry.run("put watchdog", || queue.put(&body, visibility)).await?;
        Ok(Self {
            queue,
            retry: retry.clone(),
            id: put.id,
            body: Mutex::new(body),
            receipt: Mutex::new(put.pop_receipt),
        })
    }

    fn receipt(&self) -> String {
        self.receipt.lock().expect("watchdog mutex").clone()
    }

    /// One update: new body and visibility from now. `NotFound` means someone took the message
    /// (it surfaced): it is theirs now, and they carry its duty.
    async fn update(&self, body: &str, visibility: Duration) -> Result<(), StoreError> {
        let receipt = self.receipt();
        let fresh = self
            .queue
            .set_visibility(&self.id, &receipt, body, visibility)
            .await?;
        *self.receipt.lock().expect("watchdog mutex") = fresh;
        *self.body.lock().expect("watchdog mutex") = body.to_string();
        Ok(())
    }

    /// Turns the watchdog into `message`, visible after `after` (a retry or a recheck).
    pub(crate) async fn rearm(&self, message: &TriggerMessage, after: Duration) -> Result<(), StoreError> {
        let body = message.encode();
        // A retried update whose first answer was lost finds a stale receipt (NotFound): the
        // message then keeps its previous body and visibility, and still surfaces.
        self.retry
            .run("reschedule watchdog", || {
                self.update(&body, after.max(Duration::from_secs(1)))
            })
            .await
    }

    /// Deletes the watchdog: the delivery ended and needs no stand-in. A failure is logged: the
    /// watchdog then surfaces and makes one redundant run.
    pub(crate) async fn disarm(&self) {
        let result = self
            .retry
            .run("delete watchdog", || {
                let receipt = self.receipt();
                async move { self.queue.delete(&self.id, &receipt).await }
            })
            .await;
        match result {
            Ok(()) => {}
            Err(e) if e.kind() == StoreErrorKind::NotFound => {
                tracing::debug!("the watchdog was taken before the delivery ended; its taker carries it")
            }
            Err(e) => {
                tracing::warn!(error = %e, "could not delete the watchdog; it will make one redundant run")
            }
        }
    }

    /// Pushes the watchdog to `visibility` from now just before each lease renewal, until
    /// [`Follower::finish`] (or drop): the work to run before each renewal
    /// ([`leasehold_lock::LeaseGuard::before_each_renewal`]) asks the follower to push, and waits
    /// until it has. Pushed before the renewal, the watchdog surfaces `visibility` after the
    /// holder's last push, whenever the holder dies, and the lease renewed after that push has
    /// expired by then if `visibility` is the lease plus a margin for the push's flight.
    pub(crate) fn follow(
        self: &Arc<Self>,
        visibility: Duration,
    ) -> (Follower, leasehold_lock::BeforeRenewal) {
        let this = self.clone();
        let stop = CancellationToken::new();
        let stopped = stop.clone();
        let (before, mut pushes) = push_before_renewal();
        let follower = Follower(
            tokio::spawn(async move {
                // A failed push is tried once more a second later: the margin over the lease
                // covers a push's flight, not a renewal interval without one.
                let mut again: Option<tokio::time::Instant> = None;
                loop {
                    // Stop only between pushes: a push cut off in flight may land without its new
                    // receipt being recorded, and the delete at the end would then miss.
                    // Answered (dropped) once this push is done, however it ends.
                    let asked = tokio::select! {
                        biased;
                        _ = stopped.cancelled() => return,
                        ask = pushes.recv() => match ask {
                            Some(done) => Some(done),
                            None => return,
                        },
                        _ = tokio::time::sleep_until(again.unwrap_or_else(tokio::time::Instant::now)), if again.is_some() => None,
                    };
                    let retry = asked.is_none();
                    again = None;
                    let body = this.body.lock().expect("watchdog mutex").clone();
                    match this.update(&body, visibility).await {
                        Ok(()) => {}
                        Err(e) if e.kind() == StoreErrorKind::NotFound => {
                            tracing::warn!(
                                "the watchdog surfaced while the run still holds its lease; its taker looks again later"
                            );
                            return;
                        }
                        // Meanwhile the watchdog may surface early and find the lease held, which
                        // only makes it look again later.
                        Err(e) => {
                            tracing::warn!(error = %e, "could not push the watchdog ahead");
                            if !retry {
                                again = Some(tokio::time::Instant::now() + Duration::from_secs(1));
                            }
                        }
                    }
                    drop(asked);
                }
            }
            // Its events belong to the delivery it follows.
            .instrument(tracing::Span::current())),
            stop,
        );
        (follower, before)
    }
}

/// Pushes a watchdog ahead while a lease is renewed. [`finish`](Self::finish) stops it after
/// any push in flight has landed and its receipt is recorded; dropping it stops it at once.
#[derive(Debug)]
pub(crate) struct Follower(JoinHandle<()>, CancellationToken);

impl Follower {
    /// Stops following, waiting for a push in flight (one request) to complete.
    pub(crate) async fn finish(mut self) {
        self.1.cancel();
        let _ = (&mut self.0).await;
    }
}

impl Drop for Follower {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Asks a carrier's pusher (the message's renewer standalone, the watchdog's follower under
/// Functions) to push now; the pusher answers by dropping the sender once the push is done.
pub(crate) type PushRequests = tokio::sync::mpsc::Receiver<tokio::sync::oneshot::Sender<()>>;

/// The work a lease runs before each renewal to have its carrier pushed
/// ([`leasehold_lock::LeaseGuard::before_each_renewal`]), and the requests it sends the pusher:
/// each asks for a push and waits until the pusher has done it.
pub(crate) fn push_before_renewal() -> (leasehold_lock::BeforeRenewal, PushRequests) {
    let (push_now, requests) = tokio::sync::mpsc::channel(1);
    let before: leasehold_lock::BeforeRenewal = Arc::new(move || {
        let push_now = push_now.clone();
        Box::pin(async move {
            let (done, pushed) = tokio::sync::oneshot::channel();
            if push_now.send(done).await.is_ok() {
                let _ = pushed.await;
            }
        })
    });
    (before, requests)
}
