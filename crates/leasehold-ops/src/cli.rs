//! The operator's commands (`leasehold enqueue | status | history | runs | budget | poison | break`):
//! their definitions (clap) beside the code they drive. The `leasehold` binary flattens [`Command`]
//! into its own subcommands and calls [`run`].

use anyhow::{Result, bail};
use clap::Subcommand;
use leasehold_runtime::{Lane, RecordId, Scope};
use tokio_util::sync::CancellationToken;

use crate::Operator;
use crate::wiring::StorageSettings;

/// The operator's subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Put a trigger for a record on the queue (as Start would).
    #[command(
        after_help = "Examples:\n  leasehold enqueue --scope account 8f9c1d2e-0000-4000-8000-000000000001\n  \
        leasehold enqueue --scope account --priority low 8f9c1d2e-0000-4000-8000-000000000001"
    )]
    Enqueue {
        /// Scope of the record (e.g. a Dataverse table name).
        #[arg(long, default_value = "default")]
        scope: Scope,
        record_id: RecordId,
        /// The lane: high (a person's save, the default) or low (bulk traffic, `<queue>-low`).
        #[arg(long, default_value = "high")]
        priority: Lane,
    },
    /// The system at a glance: held records (holder, since, fencing generation, lease state),
    /// records with a retrigger pending, queue and poison depths and the age of the oldest
    /// message. With a record: that record's lease and retrigger marker.
    ///
    /// Without a record it lists the lock blobs with their lease state and metadata, the
    /// retrigger markers and the wait markers (debounce): one storage request per 5,000 records
    /// that ever ran (use --scope to narrow it), plus four queue requests per lane.
    #[command(
        after_help = "Examples:\n  leasehold status\n  leasehold status --scope account --limit 20\n  \
        leasehold status --scope account 8f9c1d2e-0000-4000-8000-000000000001\n  leasehold status --json | jq .heldCount"
    )]
    Status {
        /// Only this scope (with a record: the record's scope; default "default").
        #[arg(long)]
        scope: Option<Scope>,
        /// Omit to see the whole system.
        record_id: Option<RecordId>,
        /// Show at most this many held records and pending retriggers.
        #[arg(long, default_value_t = 100)]
        limit: usize,
        /// Show held records after this scope/record (the `--after` a previous page printed).
        #[arg(long)]
        after: Option<String>,
        /// Print JSON (RFC 3339 times) instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Look at and act on a poison queue: triggers given up, with the reason. Each lane has its
    /// own: `<queue>-poison` (high, the default) and `<queue>-low-poison` (--lane low); a
    /// requeue puts a trigger back on its lane's queue.
    Poison {
        /// Whose poison queue: high (the default) or low.
        #[arg(long, default_value = "high", global = true)]
        lane: Lane,
        #[command(subcommand)]
        command: PoisonCommand,
    },
    /// Break a record's lease: its run is told at its next renewal and stops; the record is free
    /// once that run released it or its lease would have expired (or at once with --now).
    #[command(
        after_help = "Example:\n  leasehold break --scope account 8f9c1d2e-0000-4000-8000-000000000001 --reason \"stuck on a dead VM\""
    )]
    Break {
        #[arg(long, default_value = "default")]
        scope: Scope,
        record_id: RecordId,
        /// Why (logged).
        #[arg(long)]
        reason: String,
        /// Free the record at once instead of when the broken lease would have expired. Only
        /// for a holder known to be dead: a live one may still be running when the next starts.
        #[arg(long)]
        now: bool,
    },
    /// What happened to a record, newest first, as every instance wrote it: runs started and
    /// ended (with their fencing token, instance and run time), triggers coalesced onto a run,
    /// waits, runs put off (until when, and why), triggers held by a budget's pause, give-ups,
    /// and operators' actions. Two storage requests.
    #[command(
        after_help = "Examples:\n  leasehold history --scope account 8f9c1d2e-0000-4000-8000-000000000001\n  \
        leasehold history --scope account 8f9c1d2e-0000-4000-8000-000000000001 --limit 5 --json"
    )]
    History {
        /// Scope of the record (e.g. a Dataverse table name).
        #[arg(long, default_value = "default")]
        scope: Scope,
        record_id: RecordId,
        /// Show at most this many entries (1–1000).
        #[arg(long, default_value_t = 50)]
        limit: usize,
        /// Print JSON (RFC 3339 times) instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Recent runs across the deployment, newest first, from the run history: each run's
    /// record, outcome, run time, fencing token, instance and reason. Runs are the entries that
    /// end one (completed, retriggered, failed, lease_lost, deferred, superseded, poisoned).
    /// A read across records, bounded (20 requests, 10,000 stored writes, 10 s): when it stops
    /// at the bound it says the list is partial; a scope or a narrower window reads less.
    #[command(
        after_help = "Examples:\n  leasehold runs\n  leasehold runs --scope account --outcome failed --since 24h\n  \
        leasehold runs --since 15m --limit 20 --json"
    )]
    Runs {
        /// Only this scope's records.
        #[arg(long)]
        scope: Option<Scope>,
        /// Only runs with this outcome (repeat it for several).
        #[arg(long)]
        outcome: Vec<String>,
        /// How far back: seconds, or with a unit (15m, 1h, 24h, 7d); at most the days history
        /// is kept.
        #[arg(long, default_value = "1h")]
        since: String,
        /// Show at most this many runs (1–1000).
        #[arg(long, default_value_t = 100)]
        limit: usize,
        /// Print JSON (RFC 3339 times) instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Downstream budgets: see a budget's pause (set when the downstream answered "too many")
    /// and end it.
    Budget {
        #[command(subcommand)]
        command: BudgetCommand,
    },
}

#[derive(Debug, Subcommand)]
pub enum BudgetCommand {
    /// Each budget's pause as storage holds it: paused or not, until when, when it was last
    /// written, and the limit (runs at once) its writer had cut to. Without a name, every
    /// budget ever paused in this deployment. The live limits of a running process are on its
    /// dashboard.
    #[command(after_help = "Examples:\n  leasehold budget status\n  leasehold budget status default --json")]
    Status {
        /// A budget's name (`LEASEHOLD_BUDGET`; `default` unless set).
        name: Option<String>,
        /// Print JSON (RFC 3339 times) instead of text.
        #[arg(long)]
        json: bool,
    },
    /// End a budget's pause now: every worker starts runs of it again within 3 s of its next
    /// look. The downstream may still refuse; a run it refuses pauses the budget again.
    #[command(after_help = "Example:\n  leasehold budget resume default")]
    Resume {
        /// The budget's name.
        name: String,
    },
}

/// Runs `command` on the storage `settings` name: prints what it found or did, and answers
/// the status the process should exit with (0 done; 3 incomplete, 4 a record named with no
/// entry in its scope and 130 interrupted for a poison requeue or purge; see
/// [`EXIT_INCOMPLETE`], [`EXIT_RECORD_NOT_FOUND`], [`EXIT_INTERRUPTED`]).
pub async fn run(command: Command, settings: &StorageSettings) -> Result<i32> {
    match command {
        Command::Enqueue {
            scope,
            record_id,
            priority,
        } => {
            let operator = Operator::new(settings)?.lane(priority);
            operator.enqueue(&scope, &record_id).await?;
            println!("enqueued {scope}/{record_id} on {}", operator.queue_name());
            Ok(0)
        }
        Command::Status {
            scope,
            record_id,
            limit,
            after,
            json,
        } => {
            println!(
                "{}",
                status(settings, scope, record_id, limit, after, json).await?
            );
            Ok(0)
        }
        Command::Poison { lane, command } => {
            let (out, status) = poison(settings, lane, command).await?;
            if !out.is_empty() {
                println!("{out}");
            }
            Ok(status)
        }
        Command::Break {
            scope,
            record_id,
            reason,
            now,
        } => {
            let operator = Operator::new(settings)?;
            println!(
                "{}",
                operator.break_lease(&scope, &record_id, &reason, now).await?
            );
            Ok(0)
        }
        Command::History {
            scope,
            record_id,
            limit,
            json,
        } => {
            let operator = Operator::new(settings)?;
            let entries = operator.history(&scope, &record_id, limit).await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&entries)?);
            } else if entries.is_empty() {
                println!(
                    "no history for {scope}/{record_id} (nothing happened to it within the history's days, or it was written with history off)"
                );
            } else {
                for entry in &entries {
                    println!("{}", entry.line());
                }
            }
            Ok(0)
        }
        Command::Runs {
            scope,
            outcome,
            since,
            limit,
            json,
        } => {
            let operator = Operator::new(settings)?;
            let query = crate::RunQuery {
                scope,
                outcomes: outcome,
                window: crate::parse_window(&since)?,
                limit,
            };
            let list = operator.runs(&query).await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&list)?);
            } else {
                if list.runs.is_empty() {
                    println!(
                        "no run ended within the last {}",
                        crate::clock::span(query.window)
                    );
                }
                for run in &list.runs {
                    println!("{}", run.line());
                }
                if list.partial {
                    println!(
                        "partial: the read stopped at its bound after {} stored writes; runs may be missing (a scope or a shorter --since reads less)",
                        list.scanned
                    );
                }
            }
            Ok(0)
        }
        Command::Budget { command } => {
            let operator = Operator::new(settings)?;
            match command {
                BudgetCommand::Status { name, json } => {
                    let budgets = operator.budget_status(name.as_deref()).await?;
                    if json {
                        println!("{}", serde_json::to_string_pretty(&budgets)?);
                    } else if budgets.is_empty() {
                        println!("no budget was ever paused in this deployment");
                    } else {
                        for b in &budgets {
                            println!("{}", b.line());
                        }
                    }
                }
                BudgetCommand::Resume { name } => {
                    let was = operator.budget_resume(&name).await?;
                    if was {
                        println!(
                            "resumed budget {name}: workers start its runs again within 3 s of their next look"
                        );
                    } else {
                        println!("budget {name} was not paused; nothing to end");
                    }
                }
            }
            Ok(0)
        }
    }
}

#[derive(Debug, Subcommand)]
pub enum PoisonCommand {
    /// List poison entries, oldest first: record, reason, attempts, when given up; and per
    /// record the first and last time it was given up.
    ///
    /// Up to 32 entries are peeked, with no side effect. More (--limit over 32) are scanned:
    /// taken 32 at a time and put back at the end, hidden from other readers meanwhile (30 s at
    /// a time, hidden again while the scan runs: if it dies, they are back within 30 s; Ctrl-C
    /// puts them back at once). A scan holds at most 10,000 entries.
    ///
    /// Reasons and bodies are printed with control characters escaped (`\u{1b}`); --json
    /// carries them exactly. A listing holds the first 512 bytes of each reason; `show` prints
    /// it whole.
    #[command(after_help = "Examples:\n  leasehold poison list\n  leasehold poison list --limit 500 --json")]
    List {
        /// Show at most this many entries (at most 10,000).
        #[arg(long, default_value_t = 32)]
        limit: usize,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Show one entry in full.
    #[command(after_help = "Example:\n  leasehold poison show 7c0e9a4e-1f52-4c2b-9d43-3f0d6f0e2a11")]
    Show {
        /// The entry's id (from `poison list`).
        id: String,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Requeue entries as fresh triggers (a new chain with no attempts behind it): the trigger
    /// is put on the queue first and the entry removed only after, so an interruption leaves
    /// it in both places, never in neither.
    ///
    /// It ends by comparing the poison queue's approximate count (hidden entries included) with
    /// what it left there: if entries remain that it could not see (another scan holds them), it
    /// says "incomplete: N hidden, run again after T" and exits with status 3. Ctrl-C stops it
    /// between entries and puts back what it holds (exit status 130).
    ///
    /// A record (--record) with no entry in its scope (--scope, else "default") is said, with
    /// the scopes its entries are in and the command for them, and exits with status 4.
    #[command(
        after_help = "Examples:\n  leasehold poison requeue 7c0e9a4e-1f52-4c2b-9d43-3f0d6f0e2a11\n  \
        leasehold poison requeue --scope account\n  leasehold poison requeue --scope account --record 42\n  \
        leasehold poison requeue --record 42          # the record 42 of the scope \"default\"\n  \
        leasehold poison requeue --all\n\n\
        Exit status: 0 done, 1 error, 3 incomplete (run it again when it says), 4 the record named has no entry \
        in its scope (it says which scopes have), 130 interrupted."
    )]
    Requeue {
        #[command(flatten)]
        select: Select,
        /// Print JSON (what was done to each entry) instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Remove entries for good (needs --yes).
    ///
    /// Like requeue, it says "incomplete: N hidden, run again after T" (exit status 3) when the
    /// queue holds entries it could not see, a record with no entry in its scope (4, with the
    /// scopes its entries are in), and Ctrl-C puts back what it holds (130).
    #[command(
        after_help = "Examples:\n  leasehold poison purge 7c0e9a4e-1f52-4c2b-9d43-3f0d6f0e2a11 --yes\n  \
        leasehold poison purge --all --yes\n\n\
        Exit status: 0 done, 1 error, 3 incomplete (run it again when it says), 4 the record named has no entry \
        in its scope (it says which scopes have), 130 interrupted."
    )]
    Purge {
        #[command(flatten)]
        select: Select,
        /// Confirm: the entries are gone for good.
        #[arg(long)]
        yes: bool,
        /// Print JSON (what was done to each entry) instead of text.
        #[arg(long)]
        json: bool,
    },
}

/// Which poison entries: ids, a scope and/or record, or all.
#[derive(Debug, clap::Args)]
#[group(required = true, multiple = true)]
pub struct Select {
    /// Entry ids (from `poison list`).
    #[arg(conflicts_with_all = ["scope", "record", "all"])]
    ids: Vec<String>,
    /// Every entry of this scope (with --record, of that record only).
    #[arg(long, conflicts_with = "all")]
    scope: Option<Scope>,
    /// Every entry of this record: of --scope, or of the scope "default" without one (as in
    /// `enqueue`, `status` and `break`).
    #[arg(long, conflicts_with = "all")]
    record: Option<RecordId>,
    /// Every entry.
    #[arg(long)]
    all: bool,
}

impl Select {
    fn selection(self) -> crate::PoisonSelection {
        if self.all {
            crate::PoisonSelection::all()
        } else if !self.ids.is_empty() {
            crate::PoisonSelection::ids(self.ids)
        } else {
            crate::PoisonSelection::matching(self.scope, self.record)
        }
    }
}

fn to_json(value: &impl serde::Serialize) -> Result<String> {
    Ok(serde_json::to_string_pretty(value)?)
}

async fn status(
    settings: &StorageSettings,
    scope: Option<Scope>,
    record_id: Option<RecordId>,
    limit: usize,
    after: Option<String>,
    json: bool,
) -> Result<String> {
    let operator = Operator::new(settings)?;
    let Some(record_id) = record_id else {
        let overview = operator
            .overview(&crate::OverviewQuery {
                scope,
                limit: Some(limit),
                after,
            })
            .await?;
        return if json {
            to_json(&overview)
        } else {
            Ok(crate::text::overview(&overview))
        };
    };
    let scope = scope.unwrap_or_default();
    let (record, queue, poison, history) = tokio::join!(
        operator.record(&scope, &record_id),
        operator.queue_view_of(false),
        operator.queue_view_of(true),
        operator.history(&scope, &record_id, RECORD_HISTORY_SHOWN),
    );
    let (record, queue, poison) = (record?, queue?, poison?);
    // History off, or unreadable: the state from the lease and markers alone, and why not more.
    let (history, history_note) = match history {
        Ok(h) => (h, None),
        Err(e) => (Vec::new(), Some(e.to_string())),
    };
    // The state names the queue of the lane the record's newest entry came by.
    let lane_queue = match history.first().and_then(|e| e.lane.as_deref()) {
        Some("low") if operator.lane_of() != Lane::Low => {
            Some(operator.clone().lane(Lane::Low).queue_view_of(false).await?)
        }
        _ => None,
    };
    let state = crate::RecordState::of(
        &record,
        &history,
        Some(lane_queue.as_ref().unwrap_or(&queue)),
        std::time::SystemTime::now(),
    );
    let state = match &history_note {
        Some(why) => state.history_unreadable(why),
        None => state,
    };
    if json {
        return to_json(&serde_json::json!({
            "state": state.state,
            "until": state.until.map(crate::clock::rfc3339),
            "reason": state.reason,
            "record": record,
            "history": history,
            "historyUnavailable": history_note,
            "queue": queue,
            "poison": poison,
        }));
    }
    let mut out = format!("state       {}: {}\n", state.state, state.reason);
    out.push_str(&crate::text::record(&record, Some((&queue, &poison))));
    match history_note {
        Some(note) => out.push_str(&format!("\nhistory     unavailable: {note}")),
        None if history.is_empty() => out.push_str("\nhistory     none within the days kept"),
        None => {
            out.push_str(&format!(
                "\nhistory     newest first (leasehold history --scope {scope} {record_id} for more):"
            ));
            for entry in &history {
                out.push_str(&format!("\n  {}", entry.line()));
            }
        }
    }
    Ok(out)
}

/// How many history entries `leasehold status` shows for a record.
const RECORD_HISTORY_SHOWN: usize = 10;

/// Exit status of a requeue or purge that could not reach every entry (run it again).
pub const EXIT_INCOMPLETE: i32 = 3;
/// Exit status of a requeue or purge of a record (`--record`) that has no entry in the scope
/// selected (`--scope`, else `default`): nothing was done; it says which scopes have its entries.
pub const EXIT_RECORD_NOT_FOUND: i32 = 4;
/// Exit status after Ctrl-C (128 + SIGINT).
pub const EXIT_INTERRUPTED: i32 = 130;

/// The status a requeue or purge exits with. An incomplete one whose record was not found may
/// find it when run again: it says so (3), not that the record has no entry.
fn report_status(complete: bool, interrupted: bool, record_not_found: bool) -> i32 {
    if interrupted {
        EXIT_INTERRUPTED
    } else if !complete {
        EXIT_INCOMPLETE
    } else if record_not_found {
        EXIT_RECORD_NOT_FOUND
    } else {
        0
    }
}

/// For a record named (`record`) with entries in other scopes: the command for each of them
/// (`command` is `requeue` or `purge`), one a line.
fn other_scopes_hint(
    command: &str,
    lane: Lane,
    record: Option<&RecordId>,
    other_scopes: &std::collections::BTreeMap<Scope, usize>,
) -> String {
    let Some(record) = record else {
        return String::new();
    };
    let lane = match lane {
        Lane::High => "",
        Lane::Low => " --lane low",
    };
    let yes = if command == "purge" { " --yes" } else { "" };
    other_scopes
        .iter()
        .map(|(scope, n)| {
            let entries = if *n == 1 { "entry" } else { "entries" };
            format!(
                "\n{n} {entries} of the record {record} in the scope {scope}: \
                 leasehold poison {command}{lane} --scope {scope} --record {record}{yes}"
            )
        })
        .collect()
}

/// What a poison command prints, and the status it exits with.
async fn poison(settings: &StorageSettings, lane: Lane, command: PoisonCommand) -> Result<(String, i32)> {
    // Ctrl-C (or SIGTERM) stops a scan, which puts back what it holds; a second one quits at
    // once (what the scan holds then comes back by itself within its hiding).
    let operator = Operator::new(settings)?
        .lane(lane)
        .with_interrupt(interrupt_signal()?);
    let interrupted = |e: &crate::OpsError| matches!(e, crate::OpsError::Interrupted(_));
    match command {
        PoisonCommand::List { limit, json } => {
            let list = match operator
                .poison_list(&crate::PoisonQuery { limit: Some(limit) })
                .await
            {
                Err(e) if interrupted(&e) => {
                    eprintln!("leasehold: {e}");
                    return Ok((String::new(), EXIT_INTERRUPTED));
                }
                other => other?,
            };
            let out = if json {
                to_json(&list)?
            } else {
                crate::text::poison_list(&list)
            };
            Ok((out, 0))
        }
        PoisonCommand::Show { id, json } => {
            let entry = match operator.poison_show(&id).await {
                Err(e) if interrupted(&e) => {
                    eprintln!("leasehold: {e}");
                    return Ok((String::new(), EXIT_INTERRUPTED));
                }
                other => other?,
            };
            let out = if json {
                to_json(&entry)?
            } else {
                crate::text::poison_entry(&entry)
            };
            Ok((out, 0))
        }
        PoisonCommand::Requeue { select, json } => {
            use std::io::IsTerminal;
            let interactive = std::io::stderr().is_terminal();
            let progress = move |p: &crate::Progress| {
                // Every 100 entries (and on a terminal, as it goes).
                if p.scanned.is_multiple_of(100) || (interactive && p.scanned.is_multiple_of(10)) {
                    eprintln!(
                        "… {} scanned, {} requeued (about {} in the queue)",
                        p.scanned, p.done, p.total
                    );
                }
            };
            let record = select.record.clone();
            let report = operator.poison_requeue(&select.selection(), &progress).await?;
            let status = report_status(report.complete, report.interrupted, report.record_not_found);
            let out = if json {
                to_json(&report)?
            } else {
                crate::text::requeue(&report)
                    + &other_scopes_hint("requeue", lane, record.as_ref(), &report.other_scopes)
            };
            Ok((out, status))
        }
        PoisonCommand::Purge { select, yes, json } => {
            if !yes {
                bail!(
                    "purge removes poison entries for good: add --yes to confirm (or look first: leasehold poison list)"
                );
            }
            let record = select.record.clone();
            let report = operator.poison_purge(&select.selection()).await?;
            let status = report_status(report.complete, report.interrupted, report.record_not_found);
            let out = if json {
                to_json(&report)?
            } else {
                crate::text::purge(&report)
                    + &other_scopes_hint("purge", lane, record.as_ref(), &report.other_scopes)
            };
            Ok((out, status))
        }
    }
}

/// Cancelled on the first SIGINT or SIGTERM (the handlers are in place when this returns); the
/// second quits at once with status 130.
fn interrupt_signal() -> Result<CancellationToken> {
    let token = CancellationToken::new();
    let t = token.clone();
    let hide = crate::SCAN_HIDE.as_secs();
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let mut int = signal(SignalKind::interrupt())?;
        let mut term = signal(SignalKind::terminate())?;
        tokio::spawn(async move {
            tokio::select! {
                _ = int.recv() => {}
                _ = term.recv() => {}
            }
            eprintln!(
                "leasehold: interrupted: putting back what the scan holds (again to quit at once: it then comes back \
                 by itself within {hide} s)"
            );
            t.cancel();
            tokio::select! {
                _ = int.recv() => {}
                _ = term.recv() => {}
            }
            eprintln!("leasehold: quit; what the scan held comes back by itself within {hide} s");
            std::process::exit(EXIT_INTERRUPTED);
        });
    }
    #[cfg(not(unix))]
    tokio::spawn(async move {
        if tokio::signal::ctrl_c().await.is_ok() {
            eprintln!("leasehold: interrupted: putting back what the scan holds (again to quit at once)");
            t.cancel();
        }
        if tokio::signal::ctrl_c().await.is_ok() {
            eprintln!("leasehold: quit; what the scan held comes back by itself within {hide} s");
            std::process::exit(EXIT_INTERRUPTED);
        }
    });
    Ok(token)
}
