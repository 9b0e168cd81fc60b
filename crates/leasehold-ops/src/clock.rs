//! Times as people read them (`12:04:31Z, 3 m 12 s ago`) and as scripts read them (RFC 3339).

use std::time::{Duration, SystemTime};

use serde::Serializer;
use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;

/// RFC 3339 in UTC with milliseconds (`2026-11-23T12:04:31.123Z`).
pub fn rfc3339(at: SystemTime) -> String {
    let at = OffsetDateTime::from(at);
    let at = at
        .replace_nanosecond(at.millisecond() as u32 * 1_000_000)
        .unwrap_or(at);
    at.format(&Rfc3339).unwrap_or_else(|_| "?".into())
}

/// Serialises an optional instant as an RFC 3339 string (or `null`).
pub fn serialize_opt<S: Serializer>(at: &Option<SystemTime>, s: S) -> Result<S::Ok, S::Error> {
    match at {
        Some(at) => s.serialize_str(&rfc3339(*at)),
        None => s.serialize_none(),
    }
}

/// Serialises an instant as an RFC 3339 string.
pub fn serialize<S: Serializer>(at: &SystemTime, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&rfc3339(*at))
}

/// A duration as a person reads it: `42 s`, `3 m 12 s`, `2 h 5 m`, `3 d 4 h`.
pub fn span(d: Duration) -> String {
    let s = d.as_secs();
    match s {
        0..60 => format!("{s} s"),
        60..3600 => format!("{} m {} s", s / 60, s % 60),
        3600..86_400 => format!("{} h {} m", s / 3600, s % 3600 / 60),
        _ => format!("{} d {} h", s / 86_400, s % 86_400 / 3600),
    }
}

/// An instant as a person reads it beside `now`: `12:04:31Z, 3 m 12 s ago` (the date too when
/// it is not `now`'s day; `in …` for an instant ahead of `now`, as a skewed clock may give).
pub fn readable(at: SystemTime, now: SystemTime) -> String {
    let when = OffsetDateTime::from(at);
    let today = OffsetDateTime::from(now).date();
    let clock = format!("{:02}:{:02}:{:02}Z", when.hour(), when.minute(), when.second());
    let stamp = if when.date() == today {
        clock
    } else {
        format!("{} {clock}", when.date())
    };
    match now.duration_since(at) {
        Ok(ago) => format!("{stamp}, {} ago", span(ago)),
        Err(ahead) => format!("{stamp}, in {}", span(ahead.duration())),
    }
}

/// Seconds from `at` to `now` (0 for an instant ahead of `now`), with millisecond precision.
pub fn age_seconds(at: SystemTime, now: SystemTime) -> f64 {
    let d = now.duration_since(at).unwrap_or_default();
    (d.as_millis() as f64) / 1000.0
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::UNIX_EPOCH;

    #[test]
    fn times_read_as_instants_and_ages() {
        // 2026-11-23T12:04:31Z
        let at = UNIX_EPOCH + Duration::from_secs(1_795_435_471);
        assert_eq!(
            rfc3339(at + Duration::from_millis(123)),
            "2026-11-23T12:04:31.123Z"
        );
        let now = at + Duration::from_secs(192);
        assert_eq!(readable(at, now), "12:04:31Z, 3 m 12 s ago");
        assert_eq!(
            readable(at, at + Duration::from_secs(2 * 86_400)),
            "2026-11-23 12:04:31Z, 2 d 0 h ago"
        );
        assert_eq!(readable(now, at), "12:07:43Z, in 3 m 12 s");
        assert_eq!(span(Duration::from_secs(59)), "59 s");
        assert_eq!(span(Duration::from_secs(3_600 + 5 * 60 + 9)), "1 h 5 m");
        assert_eq!(age_seconds(at, now), 192.0);
        assert_eq!(age_seconds(now, at), 0.0);
    }
}
