//! Counts of storage round trips by kind. Azure bills per transaction and each one is a round trip
//! on the critical path, so every store counts what it sends; tests and benchmarks read the counts.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// One kind of storage round trip.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum Op {
    ContainerCreate,
    BlobCreate,
    BlobProperties,
    BlobSetMetadata,
    /// Set Blob Properties with `x-ms-sequence-number-action: increment` on a page blob: the
    /// lock's fencing token in one round trip.
    BlobSequenceIncrement,
    LeaseAcquire,
    LeaseRenew,
    LeaseRelease,
    LeaseBreak,
    FlagPut,
    FlagDelete,
    WaitPut,
    WaitTouch,
    WaitHead,
    WaitDelete,
    BudgetRead,
    BudgetWrite,
    QueueCreate,
    QueuePut,
    QueueGet,
    QueueDelete,
    QueueUpdate,
    QueuePeek,
    QueueProperties,
    BlobList,
    /// An entity written to a run-history table (Insert Entity).
    HistoryWrite,
    /// A page of run-history entities read (Query Entities).
    HistoryRead,
    /// A run-history table created, deleted or listed (the Table service's table operations).
    HistoryTable,
}

impl Op {
    /// Every kind, in display order.
    pub const ALL: [Op; 28] = [
        Op::ContainerCreate,
        Op::BlobCreate,
        Op::BlobProperties,
        Op::BlobSetMetadata,
        Op::BlobSequenceIncrement,
        Op::LeaseAcquire,
        Op::LeaseRenew,
        Op::LeaseRelease,
        Op::LeaseBreak,
        Op::FlagPut,
        Op::FlagDelete,
        Op::WaitPut,
        Op::WaitTouch,
        Op::WaitHead,
        Op::WaitDelete,
        Op::BudgetRead,
        Op::BudgetWrite,
        Op::QueueCreate,
        Op::QueuePut,
        Op::QueueGet,
        Op::QueueDelete,
        Op::QueueUpdate,
        Op::QueuePeek,
        Op::QueueProperties,
        Op::BlobList,
        Op::HistoryWrite,
        Op::HistoryRead,
        Op::HistoryTable,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Op::ContainerCreate => "container create",
            Op::BlobCreate => "blob create",
            Op::BlobProperties => "blob properties",
            Op::BlobSetMetadata => "blob set metadata",
            Op::BlobSequenceIncrement => "blob sequence increment",
            Op::LeaseAcquire => "lease acquire",
            Op::LeaseRenew => "lease renew",
            Op::LeaseRelease => "lease release",
            Op::LeaseBreak => "lease break",
            Op::FlagPut => "flag put",
            Op::FlagDelete => "flag delete",
            Op::WaitPut => "wait put",
            Op::WaitTouch => "wait touch",
            Op::WaitHead => "wait head",
            Op::WaitDelete => "wait delete",
            Op::BudgetRead => "budget read",
            Op::BudgetWrite => "budget write",
            Op::QueueCreate => "queue create",
            Op::QueuePut => "queue put",
            Op::QueueGet => "queue get",
            Op::QueueDelete => "queue delete",
            Op::QueueUpdate => "queue update",
            Op::QueuePeek => "queue peek",
            Op::QueueProperties => "queue properties",
            Op::BlobList => "blob list",
            Op::HistoryWrite => "history write",
            Op::HistoryRead => "history read",
            Op::HistoryTable => "history table",
        }
    }

    /// [`Op::name`] with underscores for spaces: the `op` label of the storage metrics.
    pub fn label(self) -> &'static str {
        match self {
            Op::ContainerCreate => "container_create",
            Op::BlobCreate => "blob_create",
            Op::BlobProperties => "blob_properties",
            Op::BlobSetMetadata => "blob_set_metadata",
            Op::BlobSequenceIncrement => "blob_sequence_increment",
            Op::LeaseAcquire => "lease_acquire",
            Op::LeaseRenew => "lease_renew",
            Op::LeaseRelease => "lease_release",
            Op::LeaseBreak => "lease_break",
            Op::FlagPut => "flag_put",
            Op::FlagDelete => "flag_delete",
            Op::WaitPut => "wait_put",
            Op::WaitTouch => "wait_touch",
            Op::WaitHead => "wait_head",
            Op::WaitDelete => "wait_delete",
            Op::BudgetRead => "budget_read",
            Op::BudgetWrite => "budget_write",
            Op::QueueCreate => "queue_create",
            Op::QueuePut => "queue_put",
            Op::QueueGet => "queue_get",
            Op::QueueDelete => "queue_delete",
            Op::QueueUpdate => "queue_update",
            Op::QueuePeek => "queue_peek",
            Op::QueueProperties => "queue_properties",
            Op::BlobList => "blob_list",
            Op::HistoryWrite => "history_write",
            Op::HistoryRead => "history_read",
            Op::HistoryTable => "history_table",
        }
    }

    /// Whether this is a Table service operation (run history).
    pub fn is_table(self) -> bool {
        matches!(self, Op::HistoryWrite | Op::HistoryRead | Op::HistoryTable)
    }

    /// Whether this is a queue operation (the rest are blob or table operations).
    pub fn is_queue(self) -> bool {
        matches!(
            self,
            Op::QueueCreate
                | Op::QueuePut
                | Op::QueueGet
                | Op::QueueDelete
                | Op::QueueUpdate
                | Op::QueuePeek
                | Op::QueueProperties
        )
    }

    fn index(self) -> usize {
        Op::ALL
            .iter()
            .position(|o| *o == self)
            .expect("every Op is in ALL")
    }
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Shared, lock-free counters of round trips sent. Cheap to clone (an `Arc`); hand the same
/// counters to the blob store and the queue to count a whole trigger.
#[derive(Debug, Clone, Default)]
pub struct OpCounters {
    counts: Arc<[AtomicU64; Op::ALL.len()]>,
}

impl OpCounters {
    pub fn new() -> Self {
        Self::default()
    }

    /// Records one round trip of `op` (sent, whatever its answer).
    pub fn record(&self, op: Op) {
        self.counts[op.index()].fetch_add(1, Ordering::Relaxed);
    }

    /// A copy of the counts now.
    pub fn snapshot(&self) -> OpCounts {
        OpCounts(std::array::from_fn(|i| self.counts[i].load(Ordering::Relaxed)))
    }
}

/// A snapshot of [`OpCounters`]; subtract two to count what happened in between.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct OpCounts([u64; Op::ALL.len()]);

impl OpCounts {
    pub fn get(&self, op: Op) -> u64 {
        self.0[op.index()]
    }

    pub fn total(&self) -> u64 {
        self.0.iter().sum()
    }

    pub fn blob_total(&self) -> u64 {
        Op::ALL
            .iter()
            .filter(|o| !o.is_queue() && !o.is_table())
            .map(|o| self.get(*o))
            .sum()
    }

    pub fn table_total(&self) -> u64 {
        Op::ALL
            .iter()
            .filter(|o| o.is_table())
            .map(|o| self.get(*o))
            .sum()
    }

    pub fn queue_total(&self) -> u64 {
        Op::ALL
            .iter()
            .filter(|o| o.is_queue())
            .map(|o| self.get(*o))
            .sum()
    }

    /// Counts since `earlier`.
    pub fn since(&self, earlier: &OpCounts) -> OpCounts {
        OpCounts(std::array::from_fn(|i| self.0[i] - earlier.0[i]))
    }
}

impl fmt::Display for OpCounts {
    /// `total 5: lease acquire 1, lease release 1, ...` listing only the kinds that occurred.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "total {}", self.total())?;
        let mut sep = ": ";
        for op in Op::ALL {
            let n = self.get(op);
            if n > 0 {
                write!(f, "{sep}{op} {n}")?;
                sep = ", ";
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metric_labels_are_the_names_with_underscores() {
        for op in Op::ALL {
            assert_eq!(op.label(), op.name().replace(' ', "_"), "{op:?}");
        }
    }

    #[test]
    fn every_op_is_listed_once_and_counted_under_one_service() {
        for (i, op) in Op::ALL.iter().enumerate() {
            assert_eq!(op.index(), i, "{op:?} is listed twice");
            assert!(!(op.is_queue() && op.is_table()), "{op:?}");
        }
        let counters = OpCounters::new();
        for op in [
            Op::BlobList,
            Op::QueuePut,
            Op::HistoryWrite,
            Op::HistoryRead,
            Op::HistoryTable,
        ] {
            counters.record(op);
        }
        let counts = counters.snapshot();
        assert_eq!(
            (counts.blob_total(), counts.queue_total(), counts.table_total()),
            (1, 1, 3)
        );
        assert_eq!(counts.total(), 5);
    }
}
