//! The operations' results as people read them: aligned columns, instants with their age.

use std::fmt::Write;
use std::time::SystemTime;

use super::clock::{readable, span};
use super::{Overview, PoisonEntry, PoisonList, PurgeReport, QueueView, RecordView, RequeueReport, Skipped};

fn when(at: Option<SystemTime>, now: SystemTime) -> String {
    at.map_or_else(|| "-".into(), |at| readable(at, now))
}

fn queue_line(label: &str, q: &QueueView, now: SystemTime) -> String {
    let oldest = match q.oldest_visible_at {
        Some(at) => format!(", oldest visible put {}", readable(at, now)),
        None => String::new(),
    };
    format!(
        "{label:<12}{}: about {} messages{oldest}",
        q.name, q.approximate_messages
    )
}

/// Lines in columns: the width of each column is its widest cell.
fn table(header: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    let line = |cells: Vec<&str>, out: &mut String| {
        let mut text = String::new();
        for (i, (cell, w)) in cells.iter().zip(&widths).enumerate() {
            if i + 1 == cells.len() {
                text.push_str(cell);
            } else {
                let _ = write!(text, "{cell:<w$}  ");
            }
        }
        out.push_str(text.trim_end());
        out.push('\n');
    };
    line(header.to_vec(), &mut out);
    for row in rows {
        line(row.iter().map(String::as_str).collect(), &mut out);
    }
    out.trim_end().to_string()
}

/// `leasehold status` with no record.
pub fn overview(o: &Overview) -> String {
    let now = o.at;
    let mut out = vec![
        queue_line("queue", &o.queue, now),
        queue_line("poison", &o.poison, now),
    ];
    if let (Some(q), Some(p)) = (&o.low_queue, &o.low_poison) {
        out.push(queue_line("low", q, now));
        out.push(queue_line("low poison", p, now));
    }
    out.extend([format!(
        "records     {} held, {} with a retrigger pending, {} known{}",
        o.held_count,
        o.pending_count,
        o.records_seen,
        o.scope
            .as_ref()
            .map(|s| format!(" (scope {s})"))
            .unwrap_or_default()
    )]);
    if o.waiting_count > 0 {
        let shown: Vec<String> = o
            .waiting
            .iter()
            .map(|w| match w.last_trigger_age_seconds {
                Some(age) => format!("{}/{} ({age:.0} s since a trigger)", w.scope, w.record_id),
                None => format!("{}/{}", w.scope, w.record_id),
            })
            .collect();
        out.push(format!(
            "waiting     {} record(s) wait for their burst of triggers to end: {}",
            o.waiting_count,
            shown.join(", ")
        ));
    }
    if !o.held.is_empty() {
        let rows: Vec<Vec<String>> = o
            .held
            .iter()
            .map(|h| {
                vec![
                    format!("{}/{}", h.scope, h.record_id),
                    h.lease_state.clone(),
                    h.holder.clone().unwrap_or_else(|| "-".into()),
                    when(h.since, now),
                    h.generation.to_string(),
                    if h.retrigger_pending { "pending" } else { "-" }.into(),
                ]
            })
            .collect();
        out.push(String::new());
        out.push(table(
            &[
                "HELD RECORD",
                "LEASE",
                "HOLDER",
                "SINCE",
                "GENERATION",
                "RETRIGGER",
            ],
            &rows,
        ));
    }
    let unheld_pending: Vec<_> = o
        .pending
        .iter()
        .filter(|p| {
            !o.held
                .iter()
                .any(|h| h.scope == p.scope && h.record_id == p.record_id)
        })
        .collect();
    if !unheld_pending.is_empty() {
        out.push(String::new());
        out.push("retrigger pending, not held (its retrigger is being put or runs next):".into());
        for p in unheld_pending {
            out.push(format!("  {}/{}", p.scope, p.record_id));
        }
    }
    if let Some(next) = &o.next {
        out.push(String::new());
        out.push(format!(
            "more held records: pass --after {next} (showing {})",
            o.held.len()
        ));
    }
    out.push(String::new());
    out.push(format!("({} storage requests)", o.requests));
    out.join("\n")
}

/// `leasehold status RECORD`.
pub fn record(r: &RecordView, queue: Option<(&QueueView, &QueueView)>) -> String {
    let now = r.at;
    let mut out = vec![format!("record      {}/{}", r.scope, r.record_id)];
    let held = if r.held { "held" } else { "free" };
    out.push(format!(
        "lease       {held} ({})",
        r.lease_state.as_deref().unwrap_or("never used")
    ));
    if let Some(holder) = &r.holder {
        out.push(format!(
            "holder      {holder} (last fenced grant {})",
            when(r.since, now)
        ));
    }
    if !r.sharers.is_empty() {
        out.push(format!("sharers     {}", r.sharers.join(", ")));
    }
    out.push(format!("generation  {}", r.generation));
    if let Some((runs, seconds)) = r.superseded_in_a_row {
        out.push(format!(
            "superseded  {runs} run(s) in a row, {seconds:.0} s of run time (a run is let finish after 3)"
        ));
    }
    out.push(format!(
        "retrigger   {}",
        if r.retrigger_pending { "pending" } else { "none" }
    ));
    if r.waiting {
        out.push("waiting     triggers wait for the record's burst to end (debounce)".into());
    }
    if let Some((queue, poison)) = queue {
        out.push(queue_line("queue", queue, now));
        out.push(queue_line("poison", poison, now));
    }
    out.join("\n")
}

/// `leasehold poison list`.
pub fn poison_list(list: &PoisonList) -> String {
    let now = list.at;
    let mut out = vec![queue_line("poison", &list.poison, now)];
    if list.entries.is_empty() {
        out.push("no entries visible".into());
        return out.join("\n");
    }
    let rows: Vec<Vec<String>> = list
        .entries
        .iter()
        .map(|e| {
            vec![
                printable(&e.id, false),
                record_name(e),
                e.attempts.to_string(),
                when(e.inserted_at, now),
                printable(&one_line(&e.reason, 100), false),
            ]
        })
        .collect();
    out.push(String::new());
    out.push(table(&["ID", "RECORD", "ATTEMPTS", "GIVEN UP", "REASON"], &rows));
    if list.records.len() > 1 || list.records.first().is_some_and(|r| r.entries > 1) {
        let rows: Vec<Vec<String>> = list
            .records
            .iter()
            .map(|r| {
                vec![
                    format!("{}/{}", r.scope, r.record_id),
                    r.entries.to_string(),
                    r.attempts.to_string(),
                    when(r.first_seen, now),
                    when(r.last_seen, now),
                ]
            })
            .collect();
        out.push(String::new());
        out.push(table(
            &["RECORD", "ENTRIES", "ATTEMPTS", "FIRST SEEN", "LAST SEEN"],
            &rows,
        ));
    }
    let mut notes = Vec::new();
    if list.capped {
        notes.push(format!(
            "showing the first {}: the most one scan holds at once (requeue and purge act on any number)",
            list.entries.len()
        ));
    } else if !list.complete {
        notes.push(format!(
            "showing the first {}; pass --limit N for more (over 32 takes the entries briefly and puts them back)",
            list.entries.len()
        ));
    }
    if list.hidden > 0 {
        notes.push(format!(
            "{} more hidden: another scan holds them (a scan's entries come back within {} of its end)",
            list.hidden,
            span(super::SCAN_HIDE)
        ));
    }
    if list.not_put_back > 0 {
        notes.push(format!(
            "{} could not be put back: they come back by themselves within {}",
            list.not_put_back,
            span(super::SCAN_HIDE)
        ));
    }
    if !notes.is_empty() {
        out.push(String::new());
        out.extend(notes);
    }
    out.join("\n")
}

/// `leasehold poison show ID`.
pub fn poison_entry(e: &PoisonEntry) -> String {
    let now = SystemTime::now();
    let id = printable(&e.id, false);
    let mut out = vec![
        format!("id           {id}"),
        format!("record       {}", record_name(e)),
        format!(
            "kind         {}",
            printable(e.kind.as_deref().unwrap_or("-"), false)
        ),
        format!("given up     {}", when(e.inserted_at, now)),
        format!("attempts     {}", e.attempts),
        format!(
            "correlation  {}",
            printable(e.correlation_id.as_deref().unwrap_or("-"), false)
        ),
        format!("reason       {}", printable(&e.reason, true)),
    ];
    if let Some(body) = &e.body {
        out.push(format!("body         {}", printable(body, true)));
    }
    out.push(String::new());
    out.push(if e.is_trigger {
        format!("requeue it: leasehold poison requeue {id}")
    } else {
        format!("it holds no trigger; remove it: leasehold poison purge {id} --yes")
    });
    out.join("\n")
}

/// `leasehold poison requeue`.
pub fn requeue(r: &RequeueReport) -> String {
    let mut out = Vec::new();
    for q in &r.requeued {
        out.push(format!(
            "requeued {}/{} (entry {})",
            q.scope,
            q.record_id,
            printable(&q.id, false)
        ));
    }
    for s in &r.skipped {
        out.push(format!(
            "skipped {}: {}",
            printable(&s.id, false),
            printable(&s.why, false)
        ));
    }
    outcome_lines(&mut out, &r.failed, &r.not_found, &r.message);
    out.join("\n")
}

/// `leasehold poison purge`.
pub fn purge(r: &PurgeReport) -> String {
    let mut out = Vec::new();
    outcome_lines(&mut out, &r.failed, &r.not_found, &r.message);
    out.join("\n")
}

/// The lines both reports end with: what failed, what was not found, and the summary.
fn outcome_lines(out: &mut Vec<String>, failed: &[Skipped], not_found: &[String], message: &str) {
    for f in failed {
        out.push(format!(
            "failed {}: {}",
            printable(&f.id, false),
            printable(&f.why, false)
        ));
    }
    for id in not_found {
        out.push(format!("not found: {}", printable(id, false)));
    }
    out.push(printable(message, false));
}

fn record_name(e: &PoisonEntry) -> String {
    match (&e.scope, &e.record_id) {
        (Some(s), Some(r)) => printable(&format!("{s}/{r}"), false),
        _ => "(no trigger)".into(),
    }
}

/// `text` safe to print on a terminal: control characters (escape sequences, carriage returns,
/// backspaces, C1 controls) and the invisible characters that reorder or hide text (bidi
/// overrides and isolates, zero-width marks) are written as `\u{1b}`, so what a logic wrote
/// to its stderr cannot move the cursor, recolour, retitle or rewrite the operator's screen.
/// Line breaks are kept with `newlines` (else written `\n`), tabs always. The JSON output
/// carries the text exactly.
pub fn printable(text: &str, newlines: bool) -> String {
    let unsafe_char = |c: char| {
        (c.is_control() && c != '\t' && !(newlines && c == '\n'))
            || matches!(c, '\u{200b}'..='\u{200f}' | '\u{2028}'..='\u{202e}' | '\u{2066}'..='\u{2069}' | '\u{feff}')
    };
    if !text.chars().any(unsafe_char) {
        return text.to_string();
    }
    let mut out = String::with_capacity(text.len() + 16);
    for c in text.chars() {
        if c == '\n' && !newlines {
            out.push_str("\\n");
        } else if unsafe_char(c) {
            let _ = write!(out, "\\u{{{:x}}}", c as u32);
        } else {
            out.push(c);
        }
    }
    out
}

fn one_line(text: &str, max: usize) -> String {
    let line = text.lines().next().unwrap_or("");
    if line.chars().count() > max || text.lines().nth(1).is_some() {
        let cut: String = line.chars().take(max).collect();
        format!("{cut}…")
    } else {
        line.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_align_their_columns() {
        let t = table(
            &["A", "LONGER"],
            &[vec!["xxxx".into(), "1".into()], vec!["y".into(), "22".into()]],
        );
        assert_eq!(t, "A     LONGER\nxxxx  1\ny     22");
        assert_eq!(one_line("first\nsecond", 100), "first…");
        assert_eq!(one_line("short", 100), "short");
    }
}
