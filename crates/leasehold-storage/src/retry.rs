//! Retrying transient storage failures with exponential backoff and jitter (`backon`). Definitive
//! answers (lease present, lease lost, not found, precondition failed, rejected) are returned at once.

use std::future::Future;
use std::time::Duration;

use backon::{ExponentialBuilder, Retryable};

use crate::error::StoreResult;

/// How transient storage failures are retried.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RetryOptions {
    /// Retries after the first attempt (0 = no retry).
    pub retries: usize,
    pub min_delay: Duration,
    pub max_delay: Duration,
    /// Seed for the jitter, so a simulation replays the same delays; `None` seeds from entropy.
    pub jitter_seed: Option<u64>,
    /// How long a request that got no answer (a time-out) may still take effect after the
    /// caller gave up on it. The retry after a time-out waits at least this long, so the first
    /// request has landed (or never will) before the retry answers: otherwise a late DELETE
    /// could remove a marker set after the retry, or a late acquire leave a lease nobody
    /// holds. Default 5 s.
    pub late_window: Duration,
}

impl Default for RetryOptions {
    /// Four retries from 200 ms doubling to at most 2 s with jitter: rides out about 4–6 s of
    /// trouble, well inside a 30 s lease, before the failure is surfaced.
    fn default() -> Self {
        Self {
            retries: 4,
            min_delay: Duration::from_millis(200),
            max_delay: Duration::from_secs(2),
            jitter_seed: None,
            late_window: Duration::from_secs(5),
        }
    }
}

impl RetryOptions {
    /// No retries at all.
    pub fn none() -> Self {
        Self {
            retries: 0,
            ..Self::default()
        }
    }

    fn backoff(&self) -> ExponentialBuilder {
        let builder = ExponentialBuilder::default()
            .with_min_delay(self.min_delay)
            .with_max_delay(self.max_delay)
            .with_max_times(self.retries);
        match self.jitter_seed {
            Some(seed) => builder.with_jitter_seed(seed).with_jitter(),
            None => builder.with_jitter(),
        }
    }

    /// Runs `attempt` until it succeeds, answers definitively, or the retries are spent. Each
    /// transient failure is logged (redacted) with the delay before the next try.
    pub async fn run<T, F, Fut>(&self, what: &str, attempt: F) -> StoreResult<T>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = StoreResult<T>>,
    {
        attempt
            .retry(self.backoff())
            .sleep(tokio::time::sleep)
            .when(|e| e.is_transient())
            .adjust(|e, delay| match delay {
                Some(d) if e.is_timeout() => Some(d.max(self.late_window)),
                other => other,
            })
            .notify(
                |e, delay| tracing::warn!(error = %e, ?delay, "{what}: transient storage failure, retrying"),
            )
            .await
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;
    use crate::counters::Op;
    use crate::error::{StoreError, StoreErrorKind};

    /// After a time-out the request may still land: the retry waits the late window, so the late
    /// request lands (or never will) before the retry answers. A plain transient error is retried
    /// after the usual short pause.
    #[tokio::test(start_paused = true)]
    async fn the_retry_after_a_time_out_waits_the_late_window() {
        let retry = RetryOptions {
            jitter_seed: Some(1),
            ..RetryOptions::default()
        };
        for (first, at_least, at_most) in [
            (
                StoreError::timeout(Op::FlagDelete, Duration::from_secs(10)),
                5_000,
                6_000,
            ),
            (
                StoreError::new(StoreErrorKind::Transient, Op::FlagDelete, "busy"),
                0,
                1_000,
            ),
        ] {
            let calls = Mutex::new(Vec::new());
            let start = tokio::time::Instant::now();
            let first = Mutex::new(Some(first));
            let result = retry
                .run("delete", || {
                    calls.lock().unwrap().push(start.elapsed());
                    let err = first.lock().unwrap().take();
                    async move { err.map_or(Ok(()), Err) }
                })
                .await;
            assert!(result.is_ok());
            let second = calls.lock().unwrap()[1].as_millis() as u64;
            assert!(
                (at_least..=at_most).contains(&second),
                "retried after {second} ms"
            );
        }
    }
}
