//! History tables' names: a period's length and first day (`<prefix>p<days>d<yyyymmdd>`),
//! or the first layout's date alone, and what a sweep and a read make of them.

use std::time::Duration;

use super::table::DAY;

/// The longest period a history table covers, in days (the longest `LEASEHOLD_HISTORY_DAYS`).
pub const MAX_HISTORY_DAYS: u64 = 366;

/// What a history table's name says it holds: the entries of the days
/// `[start_day, start_day + days)` (days since 1970-01-01, UTC).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct TableSpan {
    pub(crate) start_day: u64,
    /// `None`: a table of the first layout, `<prefix><yyyymmdd>`, whose length (the days kept by
    /// the deployment that wrote it, up to [`MAX_HISTORY_DAYS`]) is not in its name.
    pub(crate) days: Option<u64>,
}

impl TableSpan {
    /// The table `<prefix>p<days>d<yyyymmdd>` of the period of `days` days starting `start_day`.
    pub(crate) fn name(prefix: &str, start_day: u64, days: u64) -> String {
        let (y, m, d) = civil_from_days(start_day as i64);
        format!("{prefix}p{days}d{y:04}{m:02}{d:02}")
    }

    /// What `name` holds, if it is a history table of `prefix` (of either layout); `None` for
    /// any other name (another prefix's that starts the same, a date that is not one).
    pub(crate) fn parse(prefix: &str, name: &str) -> Option<TableSpan> {
        let rest = name.strip_prefix(prefix)?;
        let (days, date) = match rest.strip_prefix('p') {
            Some(rest) => {
                let (days, date) = rest.split_once('d')?;
                let valid = (1..=3).contains(&days.len())
                    && !days.starts_with('0')
                    && days.chars().all(|c| c.is_ascii_digit());
                (Some(days.parse::<u64>().ok().filter(|_| valid)?), date)
            }
            None => (None, rest),
        };
        if date.len() != 8 || !date.chars().all(|c| c.is_ascii_digit()) {
            return None;
        }
        let (y, m, d): (i64, u32, u32) = (
            date[..4].parse().ok()?,
            date[4..6].parse().ok()?,
            date[6..].parse().ok()?,
        );
        let day = days_from_civil(y, m, d);
        if day < 0 || civil_from_days(day) != (y, m, d) {
            return None;
        }
        Some(TableSpan {
            start_day: day as u64,
            days,
        })
    }

    /// Whether a sweep keeping history for `keep` may drop this table at `now_ms`. A table of
    /// `P` days holds entries up to its period's end; the deployment that wrote it keeps them
    /// `P` days (its period is its days kept), the sweeping one `keep`: it is dropped once its
    /// period ended more than the longer of the two ago, so a change of
    /// `LEASEHOLD_HISTORY_DAYS` either way loses no entry younger than the longer setting. (The
    /// sweep passes as `keep` the longest period of any table on the prefix too, so two
    /// deployments with other days on one prefix keep each other's entries as long as the
    /// longer of them.) A table of the first layout is taken to be [`MAX_HISTORY_DAYS`] long
    /// and kept as long (its length is not in its name): dropped two years after its date.
    pub(crate) fn droppable(self, keep: Duration, now_ms: u64) -> bool {
        let day = DAY.as_millis() as u64;
        let days = self.days.unwrap_or(MAX_HISTORY_DAYS);
        let end = (self.start_day + days) * day;
        let hold = (keep.as_millis() as u64).max(days * day);
        end.saturating_add(hold) < now_ms
    }

    /// The times `[start, end)` (Unix ms) whose entries the table may hold, for a read. A table
    /// of the first layout is read up to `next_day` (the next such table's first day: that
    /// layout's tables follow one another), the newest of them for `own_days` (this history's
    /// period, as the code before read every one of them): not longer, or a year-old table
    /// would be scanned by every read of recent runs until it is dropped.
    pub(crate) fn read_window(self, next_day: Option<u64>, own_days: u64) -> (u64, u64) {
        let day = DAY.as_millis() as u64;
        let end = match (self.days, next_day) {
            (Some(days), _) => self.start_day + days,
            (None, Some(next)) => next.max(self.start_day + 1),
            (None, None) => self.start_day + own_days,
        };
        (self.start_day * day, end * day)
    }
}

/// The civil date (proleptic Gregorian, UTC) of `days` since 1970-01-01 (H. Hinnant's).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

/// Days since 1970-01-01 of the civil date `y-m-d`.
fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = if m > 2 { m - 3 } else { m + 9 } as i64;
    let doy = (153 * mp + 2) / 5 + d as i64 - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::history::MAX_HISTORY_PREFIX_LEN;

    const DAY_MS: u64 = 24 * 3600 * 1000;

    /// A table's name holds its period's length and first day, and reads back; names that are
    /// not this prefix's history tables (another prefix that starts the same, a bad date, a
    /// length with a leading zero) are not read as its.
    #[test]
    fn a_table_name_holds_its_period_and_reads_back() {
        let day = days_from_civil(2026, 11, 28) as u64;
        assert_eq!(TableSpan::name("history", day, 7), "historyp7d20261128");
        assert_eq!(TableSpan::name("h1", day, 366), "h1p366d20261128");
        for days in [1, 7, 30, 366] {
            let name = TableSpan::name("history", day, days);
            assert_eq!(
                TableSpan::parse("history", &name),
                Some(TableSpan {
                    start_day: day,
                    days: Some(days)
                })
            );
        }
        assert_eq!(
            TableSpan::parse("history", "history20261128"),
            Some(TableSpan {
                start_day: day,
                days: None
            }),
            "the first layout"
        );
        for other in [
            "historyp7d2026112",
            "historyp07d20261128",
            "historyp1234d20261128",
            "historyp7d20261399",
            "historypd20261128",
            "historyx20261128",
            "history120261128",
            "historyp1d20261128p7d20261128",
            "history1p7d20261128",
            "other20261128",
        ] {
            assert_eq!(TableSpan::parse("history", other), None, "{other}");
        }
        // The longest name fits the service's 63 characters.
        let longest = TableSpan::name(&"h".repeat(MAX_HISTORY_PREFIX_LEN), day, MAX_HISTORY_DAYS);
        assert_eq!(longest.len(), 63);
    }

    /// Issue 44: a sweep drops a table once its own period ended more than the longer of the
    /// days kept and its own length ago: after 7 → 1 days, a 7-day table is kept as a 7-day
    /// deployment keeps it (the old rule read it as a 1-day one and dropped entries 74 s old);
    /// after 1 → 7, a 1-day table is kept 7 days; a table of the first layout two years.
    #[test]
    fn a_sweep_drops_a_table_by_its_own_period_and_the_longer_setting() {
        let start = 20_000;
        let at = |days_after_start: f64| ((start as f64 + days_after_start) * DAY_MS as f64) as u64;
        let days = |n: u64| Duration::from_secs(n * 24 * 3600);
        let seven = TableSpan {
            start_day: start,
            days: Some(7),
        };
        // Its period ends on day 7; a 7-day deployment keeps it to day 14.
        for keep in [days(1), days(7)] {
            assert!(
                !seven.droppable(keep, at(7.0) + 74_000),
                "{keep:?}: its last entry is 74 s old"
            );
            assert!(!seven.droppable(keep, at(13.9)), "{keep:?}");
            assert!(seven.droppable(keep, at(14.01)), "{keep:?}");
        }
        assert!(
            !seven.droppable(days(30), at(36.9)),
            "kept for the longer setting"
        );
        assert!(seven.droppable(days(30), at(37.01)));
        let one = TableSpan {
            start_day: start,
            days: Some(1),
        };
        assert!(!one.droppable(days(1), at(1.99)));
        assert!(one.droppable(days(1), at(2.01)));
        assert!(
            !one.droppable(days(7), at(7.99)),
            "after 1 -> 7 it is kept 7 days"
        );
        assert!(one.droppable(days(7), at(8.01)));
        let first_layout = TableSpan {
            start_day: start,
            days: None,
        };
        assert!(!first_layout.droppable(days(1), at(731.9)));
        assert!(first_layout.droppable(days(1), at(732.01)));
    }

    /// A read's tables: a table of the first layout holds entries up to the next one's first
    /// day, the newest of them for the reader's own period; one that names its length, its
    /// period.
    #[test]
    fn a_tables_read_window_is_its_period_or_up_to_the_next_first_layout_table() {
        let span = |days| TableSpan { start_day: 10, days };
        assert_eq!(span(Some(7)).read_window(None, 1), (10 * DAY_MS, 17 * DAY_MS));
        assert_eq!(span(None).read_window(Some(17), 1), (10 * DAY_MS, 17 * DAY_MS));
        assert_eq!(span(None).read_window(None, 3), (10 * DAY_MS, 13 * DAY_MS));
    }
}
