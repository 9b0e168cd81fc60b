//! Settings from the environment, with the app-setting names Azure Functions users know.
//! Every setting is documented in the configuration reference (docs/configuration.md) and in `local.settings.example.json`.

use std::time::Duration;

use anyhow::{Context, Result, bail};
use leasehold_functions::start::{Secret, StartPolicy};
use leasehold_lock::{LeaseDuration, LeaseOptions};
use leasehold_runtime::{
    BudgetOptions, ConsumerOptions, Debounce, MAX_HISTORY_DAYS, PerScope, RunPolicy, RunnerOptions, Scope,
    TableHistory, check_budget_name,
};
use leasehold_storage::StorageAccount;
use serde::Deserialize;

use crate::server::HttpOptions;

/// One setting as users see it: its environment name and the default docs/configuration.md and
/// `local.settings.example.json` show (`None`: no default). The parsing below takes its defaults
/// from the libraries' `Default`s; a test checks they are what this table says, and that the
/// settings table of docs/configuration.md and the example settings file list exactly these.
#[derive(Debug, Clone, Copy)]
pub struct SettingInfo {
    pub name: &'static str,
    pub default: Option<&'static str>,
}

/// The most `LEASEHOLD_MAX_DEFERRAL_SECONDS` may be: 7 days, the longest a queue message can stay
/// hidden.
const MAX_DEFERRAL_LIMIT: u64 = 604_800;

/// The longest `LEASEHOLD_DEBOUNCE_SECONDS` may be: an hour (a quiet period longer than that is
/// a schedule, not a debounce).
const MAX_DEBOUNCE_QUIET: u64 = 3_600;
/// The longest `LEASEHOLD_DEBOUNCE_MAX_SECONDS` may be: a day.
const MAX_DEBOUNCE_LONGEST: u64 = 86_400;

/// Reads `LEASEHOLD_DEBOUNCE_SECONDS` (Q, default 0: off) and `LEASEHOLD_DEBOUNCE_MAX_SECONDS` (M,
/// default 60), each `<default>[,<scope>=<seconds>]…`, into each scope's window; M below Q in a
/// scope that debounces is refused.
fn debounce(quiet: Option<&str>, longest: Option<&str>) -> anyhow::Result<PerScope<Option<Debounce>>> {
    let seconds =
        |name: &'static str, text: Option<&str>, default: u64, range: std::ops::RangeInclusive<u64>| {
            match text {
                None => Ok(PerScope::new(default)),
                Some(text) => PerScope::parse(text, default, |v| {
                    let n: u64 = v
                        .parse()
                        .map_err(|_| "not a whole number of seconds".to_string())?;
                    if !range.contains(&n) {
                        return Err(format!("must be {}–{} seconds", range.start(), range.end()));
                    }
                    Ok(n)
                })
                .map_err(|e| anyhow::anyhow!("{name}: {e}")),
            }
        };
    let quiet = seconds("LEASEHOLD_DEBOUNCE_SECONDS", quiet, 0, 0..=MAX_DEBOUNCE_QUIET)?;
    let longest = seconds(
        "LEASEHOLD_DEBOUNCE_MAX_SECONDS",
        longest,
        60,
        1..=MAX_DEBOUNCE_LONGEST,
    )?;
    let window = |scope: Option<&Scope>| -> anyhow::Result<Option<Debounce>> {
        let (q, m) = match scope {
            None => (*quiet.default_value(), *longest.default_value()),
            Some(s) => (*quiet.get(s), *longest.get(s)),
        };
        if q > 0 && m < q {
            let within = scope.map_or(String::new(), |s| format!(" for scope {s}"));
            bail!(
                "LEASEHOLD_DEBOUNCE_MAX_SECONDS: {m} s is below LEASEHOLD_DEBOUNCE_SECONDS ({q} s){within}: the longest wait must be at least the quiet period"
            );
        }
        Ok(Debounce::new(Duration::from_secs(q), Duration::from_secs(m)))
    };
    let mut windows = PerScope::new(window(None)?);
    for scope in quiet
        .overrides()
        .chain(longest.overrides())
        .map(|(s, _)| s.clone())
    {
        let w = window(Some(&scope))?;
        windows = windows.with(scope, w);
    }
    Ok(windows)
}

/// The longest a throttle may pause a downstream budget: a day.
const MAX_THROTTLE_PAUSE_LIMIT: u64 = 86_400;

/// The budget settings as read.
struct BudgetRaw<'a> {
    leasehold_budget: &'a Option<String>,
    leasehold_adaptive_concurrency: &'a Option<String>,
    leasehold_throttle_pause_seconds: &'a Option<String>,
    leasehold_max_throttle_pause_seconds: &'a Option<String>,
}

/// Reads the downstream budget settings; `concurrency` is where the adaptive limit starts.
fn budget_options(raw: BudgetRaw<'_>, concurrency: usize) -> anyhow::Result<BudgetOptions> {
    let defaults = BudgetOptions::default();
    let names = match raw.leasehold_budget {
        None => defaults.names.clone(),
        Some(text) => PerScope::parse(text, defaults.names.default_value().clone(), |v| {
            check_budget_name(v).map(|()| v.to_ascii_lowercase())
        })
        .map_err(|e| anyhow::anyhow!("LEASEHOLD_BUDGET: {e}"))?,
    };
    let pause = |name: &str, value: &Option<String>, default: Duration| -> anyhow::Result<Duration> {
        let seconds: u64 = number(name, value, default.as_secs())?;
        if !(1..=MAX_THROTTLE_PAUSE_LIMIT).contains(&seconds) {
            bail!("{name} must be 1–{MAX_THROTTLE_PAUSE_LIMIT} seconds");
        }
        Ok(Duration::from_secs(seconds))
    };
    let default_pause = pause(
        "LEASEHOLD_THROTTLE_PAUSE_SECONDS",
        raw.leasehold_throttle_pause_seconds,
        defaults.default_pause,
    )?;
    let max_pause = pause(
        "LEASEHOLD_MAX_THROTTLE_PAUSE_SECONDS",
        raw.leasehold_max_throttle_pause_seconds,
        defaults.max_pause,
    )?;
    if max_pause < default_pause {
        bail!(
            "LEASEHOLD_MAX_THROTTLE_PAUSE_SECONDS ({} s) is below LEASEHOLD_THROTTLE_PAUSE_SECONDS ({} s)",
            max_pause.as_secs(),
            default_pause.as_secs()
        );
    }
    Ok(BudgetOptions {
        names,
        max_concurrency: concurrency,
        adaptive: flag(
            "LEASEHOLD_ADAPTIVE_CONCURRENCY",
            raw.leasehold_adaptive_concurrency,
            defaults.adaptive,
        )?,
        default_pause,
        max_pause,
        ..defaults
    })
}

const fn setting(name: &'static str, default: Option<&'static str>) -> SettingInfo {
    SettingInfo { name, default }
}

/// Every setting, in the order docs/configuration.md lists them.
pub const SETTINGS: &[SettingInfo] = &[
    setting("AzureWebJobsStorage", None),
    setting("AzureWebJobsStorage__accountName", None),
    setting("AzureWebJobsStorage__blobServiceUri", None),
    setting("AzureWebJobsStorage__queueServiceUri", None),
    setting("AzureWebJobsStorage__tableServiceUri", None),
    setting("AzureWebJobsStorage__credential", None),
    setting("AzureWebJobsStorage__clientId", None),
    setting("LEASEHOLD_QUEUE", Some("leasehold-triggers")),
    setting("LEASEHOLD_CONTAINER", Some("leasehold-locks")),
    setting("LEASEHOLD_LOGIC_COMMAND", None),
    setting("LEASEHOLD_LOGIC_ENV", None),
    setting("LEASEHOLD_LOGIC_URL", None),
    setting("LEASEHOLD_DEMO_SECONDS", None),
    setting("LEASEHOLD_API_KEY", None),
    setting("LEASEHOLD_INSECURE_NO_START_KEY", Some("false")),
    setting("LEASEHOLD_ADMIN_KEY", None),
    setting("LEASEHOLD_ALLOWED_ORGANIZATIONS", None),
    setting("LEASEHOLD_INTEGRATION_USER_IDS", None),
    setting("LEASEHOLD_LOW_PRIORITY_USER_IDS", None),
    setting("LEASEHOLD_MAX_DEPTH", None),
    setting("LEASEHOLD_LEASE_SECONDS", Some("30")),
    setting("LEASEHOLD_FENCING", Some("true")),
    setting("LEASEHOLD_RUN_TIMEOUT_SECONDS", Some("540")),
    setting("LEASEHOLD_CONCURRENCY", Some("8")),
    setting("LEASEHOLD_MAX_DEQUEUE_COUNT", Some("5")),
    setting("LEASEHOLD_MAX_DEFERRAL_SECONDS", Some("86400")),
    setting("LEASEHOLD_RUN_POLICY", Some("coalesce")),
    setting("LEASEHOLD_DEBOUNCE_SECONDS", Some("0")),
    setting("LEASEHOLD_DEBOUNCE_MAX_SECONDS", Some("60")),
    setting("LEASEHOLD_BUDGET", Some("default")),
    setting("LEASEHOLD_ADAPTIVE_CONCURRENCY", Some("true")),
    setting("LEASEHOLD_THROTTLE_PAUSE_SECONDS", Some("10")),
    setting("LEASEHOLD_MAX_THROTTLE_PAUSE_SECONDS", Some("300")),
    setting("LEASEHOLD_HISTORY", Some("true")),
    setting("LEASEHOLD_HISTORY_DAYS", Some("7")),
    setting("LEASEHOLD_HISTORY_TABLE", None),
    setting("LEASEHOLD_POLL_MAX_SECONDS", Some("2")),
    setting("LEASEHOLD_SHUTDOWN_GRACE_SECONDS", Some("30")),
    setting("LEASEHOLD_PORT", Some("7071")),
    setting("LEASEHOLD_BIND", Some("127.0.0.1")),
    setting("LEASEHOLD_HEALTH_PORT", None),
    setting("LEASEHOLD_HTTP_HEADER_TIMEOUT_SECONDS", Some("10")),
    setting("LEASEHOLD_HTTP_BODY_TIMEOUT_SECONDS", Some("30")),
    setting("LEASEHOLD_HTTP_WRITE_TIMEOUT_SECONDS", Some("30")),
    setting("LEASEHOLD_HTTP_SHUTDOWN_SECONDS", Some("10")),
    setting("LEASEHOLD_HTTP_MAX_CONNECTIONS", Some("1024")),
    setting("LEASEHOLD_METRICS_INTERVAL_SECONDS", Some("60")),
    setting("LEASEHOLD_LOG_FORMAT", Some("text")),
    setting("FUNCTIONS_CUSTOMHANDLER_PORT", None),
];

/// The environment as read (all text; parsed and checked by [`Settings::from_env`]).
#[derive(Deserialize, Default)]
struct Raw {
    #[serde(rename = "azurewebjobsstorage")]
    storage: Option<String>,
    #[serde(rename = "azurewebjobsstorage__accountname")]
    storage_account_name: Option<String>,
    #[serde(rename = "azurewebjobsstorage__blobserviceuri")]
    storage_blob_service_uri: Option<String>,
    #[serde(rename = "azurewebjobsstorage__queueserviceuri")]
    storage_queue_service_uri: Option<String>,
    #[serde(rename = "azurewebjobsstorage__tableserviceuri")]
    storage_table_service_uri: Option<String>,
    #[serde(rename = "azurewebjobsstorage__credential")]
    storage_credential: Option<String>,
    #[serde(rename = "azurewebjobsstorage__clientid")]
    storage_client_id: Option<String>,
    leasehold_queue: Option<String>,
    leasehold_container: Option<String>,
    leasehold_logic_command: Option<String>,
    leasehold_logic_url: Option<String>,
    leasehold_logic_env: Option<String>,
    leasehold_api_key: Option<String>,
    leasehold_insecure_no_start_key: Option<String>,
    leasehold_admin_key: Option<String>,
    leasehold_http_header_timeout_seconds: Option<String>,
    leasehold_http_body_timeout_seconds: Option<String>,
    leasehold_http_write_timeout_seconds: Option<String>,
    leasehold_http_shutdown_seconds: Option<String>,
    leasehold_health_port: Option<String>,
    leasehold_http_max_connections: Option<String>,
    leasehold_metrics_interval_seconds: Option<String>,
    leasehold_port: Option<String>,
    leasehold_bind: Option<String>,
    leasehold_concurrency: Option<String>,
    leasehold_lease_seconds: Option<String>,
    leasehold_fencing: Option<String>,
    leasehold_run_timeout_seconds: Option<String>,
    leasehold_max_dequeue_count: Option<String>,
    leasehold_max_deferral_seconds: Option<String>,
    leasehold_run_policy: Option<String>,
    leasehold_debounce_seconds: Option<String>,
    leasehold_debounce_max_seconds: Option<String>,
    leasehold_budget: Option<String>,
    leasehold_adaptive_concurrency: Option<String>,
    leasehold_throttle_pause_seconds: Option<String>,
    leasehold_max_throttle_pause_seconds: Option<String>,
    leasehold_history: Option<String>,
    leasehold_history_days: Option<String>,
    leasehold_history_table: Option<String>,
    leasehold_poll_max_seconds: Option<String>,
    leasehold_shutdown_grace_seconds: Option<String>,
    leasehold_allowed_organizations: Option<String>,
    leasehold_integration_user_ids: Option<String>,
    leasehold_low_priority_user_ids: Option<String>,
    leasehold_max_depth: Option<String>,
    leasehold_demo_seconds: Option<String>,
    functions_customhandler_port: Option<String>,
    functions_httpworker_port: Option<String>,
}

/// Which logic runs per record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LogicSetting {
    Command(String),
    Url(String),
    Demo(Duration),
    Unset,
}

/// Checked settings.
pub struct Settings {
    pub account: StorageAccount,
    pub queue: String,
    pub container: String,
    pub logic: LogicSetting,
    /// `LEASEHOLD_LOGIC_ENV`: the worker's environment variables a logic command gets besides
    /// its run's and the base ones (`leasehold_functions::logic::COMMAND_BASE_ENV`).
    pub logic_env: Vec<String>,
    pub policy: StartPolicy,
    pub port: u16,
    pub bind: String,
    /// `LEASEHOLD_HEALTH_PORT`: `serve` also answers `GET /healthz` on this port of
    /// `LEASEHOLD_BIND`, a listener of its own that a flood of Start's port cannot starve (for a
    /// liveness probe). Unset: none (`/healthz` is on Start's port either way).
    pub health_port: Option<u16>,
    /// `LEASEHOLD_INSECURE_NO_START_KEY` (or `serve --insecure-no-start-key`): serve Start on a
    /// non-loopback address without `LEASEHOLD_API_KEY`. Without it, `serve` refuses to.
    pub insecure_no_start_key: bool,
    /// `LEASEHOLD_ADMIN_KEY`: the key of the operator dashboard's JSON API in both modes (sent
    /// as the `x-leasehold-admin-key` header; under Functions the handler checks it in the
    /// forwarded headers). Unset: no dashboard API. Never the Start key; at least
    /// [`crate::admin::MIN_KEY_CHARS`] characters.
    pub admin_key: Option<Secret>,
    /// Deadlines and the connection bound of the HTTP side (`LEASEHOLD_HTTP_*`).
    pub http: HttpOptions,
    pub handler_port: Option<u16>,
    /// `LEASEHOLD_METRICS_INTERVAL_SECONDS`: how often the queue gauges are sampled and, in
    /// handler mode, the metrics event is logged.
    pub metrics_interval: Duration,
    pub lease: LeaseOptions,
    pub runner: RunnerOptions,
    pub consumer: ConsumerOptions,
    /// `LEASEHOLD_BUDGET`, `LEASEHOLD_ADAPTIVE_CONCURRENCY`, `LEASEHOLD_THROTTLE_PAUSE_SECONDS`
    /// and `LEASEHOLD_MAX_THROTTLE_PAUSE_SECONDS`: the downstream budgets runs draw on.
    pub budget: BudgetOptions,
    /// `LEASEHOLD_HISTORY`, `LEASEHOLD_HISTORY_DAYS` and `LEASEHOLD_HISTORY_TABLE`: where run
    /// history is kept and for how long (`None`: history is off).
    pub history: Option<leasehold_ops::wiring::HistorySettings>,
    /// Why run history is off though `LEASEHOLD_HISTORY` left it on (the storage settings give
    /// no Table endpoint): logged as a warning at the start.
    pub history_off: Option<String>,
}

impl std::fmt::Debug for Settings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Settings")
            .field("account", &self.account)
            .field("queue", &self.queue)
            .field("container", &self.container)
            .field(
                "logic",
                &match &self.logic {
                    LogicSetting::Url(_) => "url".to_string(),
                    other => format!("{other:?}"),
                },
            )
            .field("policy", &self.policy)
            .finish_non_exhaustive()
    }
}

fn number<T: std::str::FromStr>(name: &str, value: &Option<String>, default: T) -> Result<T> {
    match value.as_deref().map(str::trim) {
        None | Some("") => Ok(default),
        Some(v) => v
            .parse()
            .map_err(|_| anyhow::anyhow!("{name} must be a whole number, not {v:?}")),
    }
}

fn flag(name: &str, value: &Option<String>, default: bool) -> Result<bool> {
    match value.as_deref().map(|v| v.trim().to_ascii_lowercase()).as_deref() {
        None | Some("") => Ok(default),
        Some("true" | "1" | "yes" | "on") => Ok(true),
        Some("false" | "0" | "no" | "off") => Ok(false),
        Some(v) => bail!("{name} must be true or false, not {v:?}"),
    }
}

fn list(value: &Option<String>) -> Vec<String> {
    value
        .as_deref()
        .unwrap_or("")
        .split([',', ';'])
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::to_string)
        .collect()
}

fn name(setting: &str, value: Option<String>, default: &str) -> Result<String> {
    let v = value
        .map(|v| v.trim().to_string())
        .filter(|v| !v.is_empty())
        .unwrap_or_else(|| default.to_string());
    let ok = (3..=63).contains(&v.len())
        && v.chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
        && !v.starts_with('-')
        && !v.ends_with('-')
        && !v.contains("--");
    if !ok {
        bail!(
            "{setting} {v:?} is not a valid Azure queue/container name (3-63 lower-case letters, digits and single hyphens)"
        );
    }
    Ok(v)
}

impl Settings {
    /// The storage these settings name (account, queues, container, lease): what the operator
    /// ([`leasehold_ops::Operator`]) and the wiring need.
    pub fn storage(&self) -> leasehold_ops::wiring::StorageSettings {
        leasehold_ops::wiring::StorageSettings {
            account: self.account.clone(),
            queue: self.queue.clone(),
            container: self.container.clone(),
            lease: self.lease.clone(),
            history: self.history.clone(),
        }
    }

    /// Reads and checks the environment.
    pub fn from_env() -> Result<Self> {
        let raw: Raw = envy::from_env().context("reading settings from the environment")?;
        Self::from_raw(raw)
    }

    /// Reads and checks settings from name/value pairs named as in the environment (for
    /// embedding, and for tests that run the application in-process).
    pub fn from_vars<I, K, V>(vars: I) -> Result<Self>
    where
        I: IntoIterator<Item = (K, V)>,
        K: Into<String>,
        V: Into<String>,
    {
        let raw: Raw = envy::from_iter(vars.into_iter().map(|(k, v)| (k.into(), v.into())))
            .context("reading settings")?;
        Self::from_raw(raw)
    }

    fn from_raw(raw: Raw) -> Result<Self> {
        let account = match raw.storage.as_deref().map(str::trim).filter(|s| !s.is_empty()) {
            Some(connection_string) => StorageAccount::from_connection_string(connection_string)
                .map_err(|e| anyhow::anyhow!("AzureWebJobsStorage: {e}"))?,
            None => {
                let identity = |name: &str| match name {
                    "AzureWebJobsStorage__accountName" => raw.storage_account_name.clone(),
                    "AzureWebJobsStorage__blobServiceUri" => raw.storage_blob_service_uri.clone(),
                    "AzureWebJobsStorage__queueServiceUri" => raw.storage_queue_service_uri.clone(),
                    "AzureWebJobsStorage__tableServiceUri" => raw.storage_table_service_uri.clone(),
                    "AzureWebJobsStorage__credential" => raw.storage_credential.clone(),
                    "AzureWebJobsStorage__clientId" => raw.storage_client_id.clone(),
                    _ => None,
                };
                StorageAccount::from_identity_settings("AzureWebJobsStorage", identity)
                    .ok_or_else(|| {
                        anyhow::anyhow!(
                            "AzureWebJobsStorage is not set: set it to a storage connection string \
                             (UseDevelopmentStorage=true for Azurite), or set AzureWebJobsStorage__accountName \
                             for identity-based access"
                        )
                    })?
                    .map_err(anyhow::Error::new)?
            }
        };

        let logic = match (
            raw.leasehold_logic_command.filter(|s| !s.trim().is_empty()),
            raw.leasehold_logic_url.filter(|s| !s.trim().is_empty()),
        ) {
            (Some(_), Some(_)) => bail!("set LEASEHOLD_LOGIC_COMMAND or LEASEHOLD_LOGIC_URL, not both"),
            (Some(c), None) => LogicSetting::Command(c),
            (None, Some(u)) => LogicSetting::Url(u),
            (None, None) => LogicSetting::Unset,
        };
        let demo = Duration::from_secs(number(
            "LEASEHOLD_DEMO_SECONDS",
            &raw.leasehold_demo_seconds,
            2u64,
        )?);
        let logic = match logic {
            LogicSetting::Unset
                if raw
                    .leasehold_demo_seconds
                    .as_deref()
                    .is_some_and(|v| !v.trim().is_empty()) =>
            {
                LogicSetting::Demo(demo)
            }
            other => other,
        };

        let lease_seconds: u64 = number(
            "LEASEHOLD_LEASE_SECONDS",
            &raw.leasehold_lease_seconds,
            u64::from(LeaseOptions::default().duration.secs()),
        )?;
        let Ok(duration) = LeaseDuration::from_secs(lease_seconds) else {
            bail!(
                "LEASEHOLD_LEASE_SECONDS must be from {} to {} (Azure's lease limits), not {lease_seconds}",
                LeaseDuration::MIN_SECS,
                LeaseDuration::MAX_SECS
            );
        };
        let lease = LeaseOptions {
            fencing: flag("LEASEHOLD_FENCING", &raw.leasehold_fencing, true)?,
            // Renewed every third of the duration, declared lost a third before it could expire.
            ..LeaseOptions::with_duration(duration)
        };
        let run_timeout = number(
            "LEASEHOLD_RUN_TIMEOUT_SECONDS",
            &raw.leasehold_run_timeout_seconds,
            RunnerOptions::default().run_timeout.as_secs(),
        )?;
        if run_timeout == 0 {
            bail!("LEASEHOLD_RUN_TIMEOUT_SECONDS must be at least 1");
        }
        let defaults = RunnerOptions::default();
        let runner = RunnerOptions {
            run_timeout: Duration::from_secs(run_timeout),
            // Logic told of a lost lease must be gone 2 s before storage can hand the lease on.
            stop_grace: defaults
                .stop_grace
                .min(lease.safety_margin.saturating_sub(Duration::from_secs(2)))
                .max(Duration::from_secs(1)),
            ..defaults
        };
        let consumer_defaults = ConsumerOptions::default();
        let concurrency: usize = number(
            "LEASEHOLD_CONCURRENCY",
            &raw.leasehold_concurrency,
            consumer_defaults.concurrency,
        )?;
        if concurrency == 0 {
            bail!("LEASEHOLD_CONCURRENCY must be at least 1");
        }
        let max_dequeue_count = number(
            "LEASEHOLD_MAX_DEQUEUE_COUNT",
            &raw.leasehold_max_dequeue_count,
            defaults.max_attempts,
        )?;
        if max_dequeue_count == 0 {
            bail!("LEASEHOLD_MAX_DEQUEUE_COUNT must be at least 1");
        }
        let max_deferral = match &raw.leasehold_max_deferral_seconds {
            None => runner.max_deferral.clone(),
            Some(text) => PerScope::parse(text, runner.max_deferral.default_value().as_secs(), |v| {
                let seconds: u64 = v
                    .parse()
                    .map_err(|_| "not a whole number of seconds".to_string())?;
                if !(1..=MAX_DEFERRAL_LIMIT).contains(&seconds) {
                    return Err(format!(
                        "must be 1–{MAX_DEFERRAL_LIMIT} seconds (7 days, the longest a queue message can stay hidden)"
                    ));
                }
                Ok(seconds)
            })
            .map_err(|e| anyhow::anyhow!("LEASEHOLD_MAX_DEFERRAL_SECONDS: {e}"))?
            .map(Duration::from_secs),
        };
        let run_policy = match &raw.leasehold_run_policy {
            None => runner.run_policy.clone(),
            Some(text) => PerScope::parse(text, RunPolicy::default(), |v| v.parse())
                .map_err(|e| anyhow::anyhow!("LEASEHOLD_RUN_POLICY: {e}"))?,
        };
        if !lease.fencing && run_policy.values().any(|p| *p == RunPolicy::Supersede) {
            bail!(
                "LEASEHOLD_RUN_POLICY: supersede needs LEASEHOLD_FENCING=true (a record's streak of stopped runs is kept with its fencing generation)"
            );
        }
        let debounce = debounce(
            raw.leasehold_debounce_seconds.as_deref(),
            raw.leasehold_debounce_max_seconds.as_deref(),
        )?;
        let runner = RunnerOptions {
            debounce,
            // Under Functions the handler gives a trigger up itself (the host would drop the reason).
            max_attempts: max_dequeue_count,
            max_deferral,
            run_policy,
            ..runner
        };
        let consumer = ConsumerOptions {
            concurrency,
            batch_size: concurrency.min(32) as u32,
            // Visibility of a taken message after each push (just before each lease renewal):
            // lease + a margin, so a dead worker's message reappears only after its lease has
            // expired.
            visibility: lease.duration.as_duration() + leasehold_runtime::CARRIER_MARGIN,
            visibility_renew_every: lease.renew_every,
            max_dequeue_count,
            poll_max: Duration::from_secs(
                number(
                    "LEASEHOLD_POLL_MAX_SECONDS",
                    &raw.leasehold_poll_max_seconds,
                    consumer_defaults.poll_max.as_secs(),
                )?
                .max(1),
            ),
            shutdown_grace: Duration::from_secs(number(
                "LEASEHOLD_SHUTDOWN_GRACE_SECONDS",
                &raw.leasehold_shutdown_grace_seconds,
                consumer_defaults.shutdown_grace.as_secs(),
            )?),
            ..consumer_defaults
        };

        let budget = budget_options(
            BudgetRaw {
                leasehold_budget: &raw.leasehold_budget,
                leasehold_adaptive_concurrency: &raw.leasehold_adaptive_concurrency,
                leasehold_throttle_pause_seconds: &raw.leasehold_throttle_pause_seconds,
                leasehold_max_throttle_pause_seconds: &raw.leasehold_max_throttle_pause_seconds,
            },
            concurrency,
        )?;

        let mut integration_user_ids = Vec::new();
        for id in list(&raw.leasehold_integration_user_ids) {
            let guid = uuid::Uuid::try_parse(id.trim_matches(['{', '}']))
                .map_err(|_| anyhow::anyhow!("LEASEHOLD_INTEGRATION_USER_IDS: {id:?} is not a GUID"))?;
            integration_user_ids.push(guid);
        }
        let mut low_priority_user_ids = Vec::new();
        for id in list(&raw.leasehold_low_priority_user_ids) {
            let guid = uuid::Uuid::try_parse(id.trim_matches(['{', '}']))
                .map_err(|_| anyhow::anyhow!("LEASEHOLD_LOW_PRIORITY_USER_IDS: {id:?} is not a GUID"))?;
            low_priority_user_ids.push(guid);
        }
        let max_depth = match raw.leasehold_max_depth.as_deref().map(str::trim) {
            None | Some("") => None,
            Some(_) => Some(number("LEASEHOLD_MAX_DEPTH", &raw.leasehold_max_depth, 0u64)?),
        };
        let policy = StartPolicy {
            api_key: raw.leasehold_api_key.filter(|k| !k.is_empty()).map(Secret::new),
            allowed_organizations: list(&raw.leasehold_allowed_organizations),
            integration_user_ids,
            max_depth,
            low_priority_user_ids,
            // The safe side until the application knows where it listens (it lowers it off
            // loopback: a front end that authenticates callers answers there).
            refuse_web_pages: true,
        };
        let admin_key = raw.leasehold_admin_key.filter(|k| !k.is_empty()).map(Secret::new);
        if let (Some(admin), Some(start)) = (&admin_key, &policy.api_key)
            && admin.matches(Some(start.expose()))
        {
            bail!(
                "LEASEHOLD_ADMIN_KEY is the same as LEASEHOLD_API_KEY: the dashboard's key must be its own, \
                 so that whoever may trigger runs (Dataverse, a webhook) cannot also requeue and purge the poison queue"
            );
        }
        if let Some(admin) = &admin_key {
            let chars = admin.expose().chars().count();
            if chars < crate::admin::MIN_KEY_CHARS {
                bail!(
                    "LEASEHOLD_ADMIN_KEY is {chars} characters: it opens requeue and purge of the poison queue, \
                     so it must be at least {} random characters (make one with `openssl rand -base64 32`)",
                    crate::admin::MIN_KEY_CHARS
                );
            }
        }
        let http_defaults = HttpOptions::default();
        let seconds = |name: &str, value: &Option<String>, default: Duration| -> Result<Duration> {
            let secs = number(name, value, default.as_secs())?;
            if secs == 0 {
                bail!("{name} must be at least 1");
            }
            Ok(Duration::from_secs(secs))
        };
        let http = HttpOptions {
            header_timeout: seconds(
                "LEASEHOLD_HTTP_HEADER_TIMEOUT_SECONDS",
                &raw.leasehold_http_header_timeout_seconds,
                http_defaults.header_timeout,
            )?,
            body_timeout: seconds(
                "LEASEHOLD_HTTP_BODY_TIMEOUT_SECONDS",
                &raw.leasehold_http_body_timeout_seconds,
                http_defaults.body_timeout,
            )?,
            write_timeout: seconds(
                "LEASEHOLD_HTTP_WRITE_TIMEOUT_SECONDS",
                &raw.leasehold_http_write_timeout_seconds,
                http_defaults.write_timeout,
            )?,
            shutdown_timeout: seconds(
                "LEASEHOLD_HTTP_SHUTDOWN_SECONDS",
                &raw.leasehold_http_shutdown_seconds,
                http_defaults.shutdown_timeout,
            )?,
            max_connections: number(
                "LEASEHOLD_HTTP_MAX_CONNECTIONS",
                &raw.leasehold_http_max_connections,
                http_defaults.max_connections,
            )?,
            max_age: http_defaults.max_age,
        };
        if http.max_connections == 0 {
            bail!("LEASEHOLD_HTTP_MAX_CONNECTIONS must be at least 1");
        }
        let metrics_interval = seconds(
            "LEASEHOLD_METRICS_INTERVAL_SECONDS",
            &raw.leasehold_metrics_interval_seconds,
            crate::telemetry::DEFAULT_INTERVAL,
        )?;
        let container = name("LEASEHOLD_CONTAINER", raw.leasehold_container, "leasehold-locks")?;
        let history = history_settings(
            &raw.leasehold_history,
            &raw.leasehold_history_days,
            &raw.leasehold_history_table,
            &container,
        )?;
        // History needs the Table service, which is never guessed beside explicit Blob or Queue
        // endpoints (behind a private endpoint it would be the account's public one).
        let (history, history_off) = match history {
            Some(_) if !account.has_table_endpoint() => (None, Some(NO_TABLE_ENDPOINT.to_string())),
            history => (history, None),
        };
        let handler_port = match raw.functions_customhandler_port.or(raw.functions_httpworker_port) {
            Some(p) => Some(number("FUNCTIONS_CUSTOMHANDLER_PORT", &Some(p), 0u16)?),
            None => None,
        };
        Ok(Self {
            account,
            queue: {
                let queue = name("LEASEHOLD_QUEUE", raw.leasehold_queue, "leasehold-triggers")?;
                // The low lane's poison queue, `<queue>-low-poison`, must be a name too.
                if queue.len() > 52 {
                    bail!(
                        "LEASEHOLD_QUEUE {queue:?} is {} characters: at most 52, so that the low lane's poison queue ({queue}-low-poison) is a valid queue name (63 at most)",
                        queue.len()
                    );
                }
                queue
            },
            container,
            logic,
            logic_env: list(&raw.leasehold_logic_env),
            policy,
            port: number("LEASEHOLD_PORT", &raw.leasehold_port, 7071u16)?,
            health_port: match raw.leasehold_health_port.as_deref().map(str::trim) {
                None | Some("") => None,
                Some(_) => Some(number("LEASEHOLD_HEALTH_PORT", &raw.leasehold_health_port, 0u16)?),
            },
            bind: raw
                .leasehold_bind
                .filter(|b| !b.trim().is_empty())
                .unwrap_or_else(|| "127.0.0.1".into()),
            insecure_no_start_key: flag(
                "LEASEHOLD_INSECURE_NO_START_KEY",
                &raw.leasehold_insecure_no_start_key,
                false,
            )?,
            admin_key,
            http,
            handler_port,
            metrics_interval,
            lease,
            runner,
            consumer,
            budget,
            history,
            history_off,
        })
    }
}

/// The warning when history is off for want of a Table endpoint.
const NO_TABLE_ENDPOINT: &str = "run history is off: the storage settings give BlobEndpoint or QueueEndpoint but no TableEndpoint \
     (AzureWebJobsStorage__tableServiceUri with an identity), and a Table endpoint is never derived beside explicit ones \
     (behind a private endpoint it would be the account's public one). Add TableEndpoint=<the account's Table endpoint> \
     to AzureWebJobsStorage to keep history, or set LEASEHOLD_HISTORY=false to say it is meant to be off";

/// Reads the run history settings (`None`: `LEASEHOLD_HISTORY=false`).
fn history_settings(
    enabled: &Option<String>,
    days: &Option<String>,
    table: &Option<String>,
    container: &str,
) -> Result<Option<leasehold_ops::wiring::HistorySettings>> {
    let days: u64 = number("LEASEHOLD_HISTORY_DAYS", days, 7)?;
    if !(1..=MAX_HISTORY_DAYS).contains(&days) {
        bail!("LEASEHOLD_HISTORY_DAYS must be 1–{MAX_HISTORY_DAYS} days, not {days}");
    }
    let prefix = match table.as_deref().map(str::trim) {
        None | Some("") => TableHistory::default_prefix(container),
        Some(prefix) => prefix.to_string(),
    };
    // Checked as the store checks it, so a bad name stops the start, not the first write.
    if let Err(e) = TableHistory::check_prefix(&prefix) {
        bail!("LEASEHOLD_HISTORY_TABLE: {e}");
    }
    if !flag("LEASEHOLD_HISTORY", enabled, true)? {
        return Ok(None);
    }
    Ok(Some(leasehold_ops::wiring::HistorySettings {
        table_prefix: prefix,
        keep: Duration::from_secs(days * 24 * 3600),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn raw() -> Raw {
        Raw {
            storage: Some("UseDevelopmentStorage=true".into()),
            ..Raw::default()
        }
    }

    #[test]
    fn settings_from_name_value_pairs_use_the_environment_names() {
        let s = Settings::from_vars([
            ("AzureWebJobsStorage", "UseDevelopmentStorage=true"),
            ("LEASEHOLD_QUEUE", "my-queue"),
            ("LEASEHOLD_PORT", "0"),
        ])
        .unwrap();
        assert_eq!((s.queue.as_str(), s.port), ("my-queue", 0));
        let err = Settings::from_vars([("LEASEHOLD_QUEUE", "q1")]).unwrap_err();
        assert!(
            err.to_string().contains("AzureWebJobsStorage is not set"),
            "{err}"
        );
    }

    #[test]
    fn the_admin_key_must_be_at_least_32_characters_and_is_never_shown() {
        let with_key = |key: &str| {
            Settings::from_vars([
                ("AzureWebJobsStorage", "UseDevelopmentStorage=true"),
                ("LEASEHOLD_ADMIN_KEY", key),
            ])
        };
        let short = format!("{:#}", with_key("hunter2-hunter2").unwrap_err());
        assert!(
            short.contains("LEASEHOLD_ADMIN_KEY is 15 characters") && short.contains("at least 32"),
            "{short}"
        );
        assert!(!short.contains("hunter2"), "the key is never shown: {short}");
        let long = "k".repeat(31) + "€";
        assert!(
            with_key(&long).unwrap().admin_key.is_some(),
            "32 characters (not bytes) do"
        );
        assert!(with_key("").unwrap().admin_key.is_none(), "empty: off");
    }

    /// The defaults the table documents are the ones parsing applies.
    #[test]
    fn the_settings_table_states_the_defaults_parsing_applies() {
        let s = Settings::from_raw(raw()).unwrap();
        let applied = |name: &str| -> Option<String> {
            Some(match name {
                "LEASEHOLD_QUEUE" => s.queue.clone(),
                "LEASEHOLD_CONTAINER" => s.container.clone(),
                "LEASEHOLD_LEASE_SECONDS" => s.lease.duration.secs().to_string(),
                "LEASEHOLD_FENCING" => s.lease.fencing.to_string(),
                "LEASEHOLD_RUN_TIMEOUT_SECONDS" => s.runner.run_timeout.as_secs().to_string(),
                "LEASEHOLD_CONCURRENCY" => s.consumer.concurrency.to_string(),
                "LEASEHOLD_MAX_DEQUEUE_COUNT" => s.consumer.max_dequeue_count.to_string(),
                "LEASEHOLD_MAX_DEFERRAL_SECONDS" => {
                    s.runner.max_deferral.clone().map(|d| d.as_secs()).to_string()
                }
                "LEASEHOLD_RUN_POLICY" => s.runner.run_policy.to_string(),
                "LEASEHOLD_DEBOUNCE_SECONDS" => {
                    let window = s.runner.debounce.default_value();
                    window.map_or(0, |w| w.quiet.as_secs()).to_string()
                }
                // Only meaningful once debounce is on; the default applies then.
                "LEASEHOLD_DEBOUNCE_MAX_SECONDS" => debounce(Some("1"), None)
                    .unwrap()
                    .default_value()
                    .unwrap()
                    .longest
                    .as_secs()
                    .to_string(),
                "LEASEHOLD_BUDGET" => s.budget.names.to_string(),
                "LEASEHOLD_ADAPTIVE_CONCURRENCY" => s.budget.adaptive.to_string(),
                "LEASEHOLD_THROTTLE_PAUSE_SECONDS" => s.budget.default_pause.as_secs().to_string(),
                "LEASEHOLD_MAX_THROTTLE_PAUSE_SECONDS" => s.budget.max_pause.as_secs().to_string(),
                "LEASEHOLD_POLL_MAX_SECONDS" => s.consumer.poll_max.as_secs().to_string(),
                "LEASEHOLD_SHUTDOWN_GRACE_SECONDS" => s.consumer.shutdown_grace.as_secs().to_string(),
                "LEASEHOLD_PORT" => s.port.to_string(),
                "LEASEHOLD_BIND" => s.bind.clone(),
                "LEASEHOLD_INSECURE_NO_START_KEY" => s.insecure_no_start_key.to_string(),
                "LEASEHOLD_HTTP_HEADER_TIMEOUT_SECONDS" => s.http.header_timeout.as_secs().to_string(),
                "LEASEHOLD_HTTP_BODY_TIMEOUT_SECONDS" => s.http.body_timeout.as_secs().to_string(),
                "LEASEHOLD_HTTP_WRITE_TIMEOUT_SECONDS" => s.http.write_timeout.as_secs().to_string(),
                "LEASEHOLD_HTTP_SHUTDOWN_SECONDS" => s.http.shutdown_timeout.as_secs().to_string(),
                "LEASEHOLD_HTTP_MAX_CONNECTIONS" => s.http.max_connections.to_string(),
                "LEASEHOLD_METRICS_INTERVAL_SECONDS" => s.metrics_interval.as_secs().to_string(),
                "LEASEHOLD_HISTORY" => s.history.is_some().to_string(),
                "LEASEHOLD_HISTORY_DAYS" => (s.history.as_ref().unwrap().keep.as_secs() / 86_400).to_string(),
                // Read by the command line (clap), whose default is the same text.
                "LEASEHOLD_LOG_FORMAT" => "text".into(),
                _ => return None,
            })
        };
        for info in SETTINGS {
            assert_eq!(applied(info.name).as_deref(), info.default, "{}", info.name);
        }
        assert_eq!(s.runner.max_attempts, s.consumer.max_dequeue_count);
    }

    /// The configuration reference's settings table (`docs/configuration.md`, section
    /// "Settings") and `local.settings.example.json` list exactly the settings of [`SETTINGS`],
    /// with its defaults.
    #[test]
    fn the_configuration_reference_and_the_example_settings_list_every_setting_with_its_default() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let reference = std::fs::read_to_string(root.join("docs/configuration.md")).unwrap();
        let section = reference
            .split("\n## Settings\n")
            .nth(1)
            .expect("a Settings section in docs/configuration.md")
            .split("\n## ")
            .next()
            .unwrap();
        let rows: Vec<(String, String)> = section
            .lines()
            .filter(|l| l.starts_with("| `"))
            .map(|l| {
                let cells: Vec<&str> = l.split(" | ").collect();
                (
                    cells[0].trim_start_matches("| ").trim_matches('`').to_string(),
                    cells[1].to_string(),
                )
            })
            .collect();
        let names: Vec<&str> = rows.iter().map(|(n, _)| n.as_str()).collect();
        let documented: Vec<&str> = SETTINGS.iter().map(|i| i.name).collect();
        assert_eq!(names, documented, "the settings table of docs/configuration.md");
        for ((name, default), info) in rows.iter().zip(SETTINGS) {
            match info.default {
                Some(d) => assert_eq!(
                    default,
                    &format!("`{d}`"),
                    "docs/configuration.md default of {name}"
                ),
                None => assert!(
                    !default.starts_with('`'),
                    "docs/configuration.md shows a default for {name}"
                ),
            }
        }

        let example: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(root.join("local.settings.example.json")).unwrap())
                .unwrap();
        let values = example["Values"].as_object().unwrap();
        for info in SETTINGS {
            if info.name == "FUNCTIONS_CUSTOMHANDLER_PORT" {
                assert!(!values.contains_key(info.name), "the host sets {}", info.name);
                continue;
            }
            let value = values
                .get(info.name)
                .unwrap_or_else(|| panic!("{} missing from local.settings.example.json", info.name));
            if let Some(d) = info.default {
                assert_eq!(value, d, "example value of {}", info.name);
            }
        }
        for key in values.keys() {
            assert!(
                key == "FUNCTIONS_WORKER_RUNTIME" || SETTINGS.iter().any(|i| i.name == key),
                "{key} in local.settings.example.json is not a setting"
            );
        }
    }

    #[test]
    fn defaults_are_sane() {
        let s = Settings::from_raw(raw()).unwrap();
        assert_eq!(
            (s.queue.as_str(), s.container.as_str(), s.port),
            ("leasehold-triggers", "leasehold-locks", 7071)
        );
        assert_eq!(s.lease.duration.as_duration(), Duration::from_secs(30));
        assert_eq!(s.consumer.visibility, Duration::from_secs(35));
        assert_eq!(s.logic, LogicSetting::Unset);
        assert!(s.lease.fencing);
        assert_eq!(
            s.runner.run_timeout,
            RunnerOptions::default().run_timeout,
            "one source of defaults"
        );
        assert_eq!(s.runner.max_attempts, 5);
        assert!(s.lease.validate().is_ok());
        assert!(s.runner.stop_grace + Duration::from_secs(2) <= s.lease.safety_margin);
    }

    #[test]
    fn every_lease_duration_gives_consistent_margins() {
        for secs in [15, 16, 20, 30, 45, 60] {
            let s = Settings::from_raw(Raw {
                leasehold_lease_seconds: Some(secs.to_string()),
                ..raw()
            })
            .unwrap();
            assert!(s.lease.validate().is_ok(), "{secs}");
            assert!(
                s.runner.stop_grace + Duration::from_secs(2) <= s.lease.safety_margin,
                "{secs}: logic must be gone before the lease can be handed on"
            );
            assert_eq!(
                s.consumer.visibility,
                s.lease.duration.as_duration() + leasehold_runtime::CARRIER_MARGIN
            );
            // The renewer's own timer (half an interval late while the lease asks for pushes)
            // still pushes well before the message would surface.
            assert!(
                s.consumer.visibility > s.consumer.visibility_renew_every * 3 / 2 + Duration::from_secs(5),
                "{secs}"
            );
        }
    }

    #[test]
    fn empty_settings_mean_unset() {
        // Infrastructure sets every setting, unused ones to "": that must not switch anything on.
        let empty = || Some(String::new());
        let s = Settings::from_raw(Raw {
            leasehold_logic_command: empty(),
            leasehold_logic_url: empty(),
            leasehold_demo_seconds: empty(),
            leasehold_api_key: empty(),
            leasehold_admin_key: empty(),
            leasehold_port: empty(),
            leasehold_bind: empty(),
            leasehold_max_depth: empty(),
            leasehold_concurrency: empty(),
            leasehold_allowed_organizations: empty(),
            ..raw()
        })
        .unwrap();
        assert_eq!(s.logic, LogicSetting::Unset);
        assert!(
            s.policy.api_key.is_none()
                && s.admin_key.is_none()
                && s.policy.max_depth.is_none()
                && s.policy.allowed_organizations.is_empty()
        );
        assert_eq!(
            (s.port, s.bind.as_str(), s.consumer.concurrency),
            (7071, "127.0.0.1", 8)
        );
    }

    /// `LEASEHOLD_RUN_POLICY` takes a default and per-scope policies; supersede needs fencing.
    #[test]
    fn the_run_policy_is_read_per_scope_and_supersede_needs_fencing() {
        let s = Settings::from_raw(Raw {
            leasehold_run_policy: Some("coalesce,account=Supersede".into()),
            ..raw()
        })
        .unwrap();
        let get = |scope: &str| *s.runner.run_policy.get(&scope.parse().unwrap());
        assert_eq!(
            (get("account"), get("contact")),
            (RunPolicy::Supersede, RunPolicy::Coalesce)
        );
        for (policy, fencing, wants) in [
            ("restart", None, "unknown policy \"restart\""),
            (
                "coalesce,account=supersede",
                Some("false"),
                "supersede needs LEASEHOLD_FENCING=true",
            ),
        ] {
            let e = Settings::from_raw(Raw {
                leasehold_run_policy: Some(policy.into()),
                leasehold_fencing: fencing.map(Into::into),
                ..raw()
            })
            .unwrap_err()
            .to_string();
            assert!(
                e.starts_with("LEASEHOLD_RUN_POLICY: ") && e.contains(wants),
                "{policy}: {e}"
            );
        }
    }

    /// `LEASEHOLD_DEBOUNCE_SECONDS` and `LEASEHOLD_DEBOUNCE_MAX_SECONDS` give each scope its
    /// window, per scope; off by default; M below Q, or a bad value, stops start-up naming the
    /// setting.
    #[test]
    fn debounce_is_read_per_scope_and_the_longest_wait_is_at_least_the_quiet_period() {
        let s = Settings::from_raw(raw()).unwrap();
        assert_eq!(*s.runner.debounce.default_value(), None);
        let s = Settings::from_raw(Raw {
            leasehold_debounce_seconds: Some("0,account=5, contact=10".into()),
            leasehold_debounce_max_seconds: Some("120,contact=30".into()),
            ..raw()
        })
        .unwrap();
        let get = |scope: &str| *s.runner.debounce.get(&scope.parse().unwrap());
        let window = |q, m| Debounce::new(Duration::from_secs(q), Duration::from_secs(m));
        assert_eq!(get("lead"), None);
        assert_eq!(get("account"), window(5, 120));
        assert_eq!(get("contact"), window(10, 30));
        for (q, m, wants) in [
            ("10", "5", "5 s is below LEASEHOLD_DEBOUNCE_SECONDS (10 s)"),
            (
                "0,account=90",
                "60",
                "60 s is below LEASEHOLD_DEBOUNCE_SECONDS (90 s) for scope account",
            ),
            (
                "-1",
                "60",
                "LEASEHOLD_DEBOUNCE_SECONDS: \"-1\": not a whole number",
            ),
            (
                "3601",
                "86400",
                "LEASEHOLD_DEBOUNCE_SECONDS: \"3601\": must be 0–3600",
            ),
            ("5", "0", "LEASEHOLD_DEBOUNCE_MAX_SECONDS: \"0\": must be 1–86400"),
            ("5,account=x", "60", "LEASEHOLD_DEBOUNCE_SECONDS"),
        ] {
            let e = Settings::from_raw(Raw {
                leasehold_debounce_seconds: Some(q.into()),
                leasehold_debounce_max_seconds: Some(m.into()),
                ..raw()
            })
            .unwrap_err()
            .to_string();
            assert!(e.contains(wants), "{q} / {m}: {e}");
        }
    }

    /// `LEASEHOLD_MAX_DEFERRAL_SECONDS` takes a default and per-scope values.
    #[test]
    fn the_deferral_budget_is_read_per_scope() {
        let s = Settings::from_raw(Raw {
            leasehold_max_deferral_seconds: Some("3600, account=604800,Contact=60".into()),
            ..raw()
        })
        .unwrap();
        let get = |scope: &str| s.runner.max_deferral.get(&scope.parse().unwrap()).as_secs();
        assert_eq!((get("lead"), get("account"), get("contact")), (3600, 604_800, 60));
        for (value, wants) in [
            ("0", "\"0\": must be 1–604800 seconds"),
            ("86400,account=604801", "account=604801"),
            ("1h", "not a whole number"),
            ("60,account=5,account=6", "given twice"),
            ("60,70", "a second value without a scope"),
        ] {
            let e = Settings::from_raw(Raw {
                leasehold_max_deferral_seconds: Some(value.into()),
                ..raw()
            })
            .unwrap_err()
            .to_string();
            assert!(
                e.starts_with("LEASEHOLD_MAX_DEFERRAL_SECONDS: ") && e.contains(wants),
                "{value}: {e}"
            );
        }
    }

    #[test]
    fn bad_settings_name_the_variable_and_hide_secrets() {
        let cases: Vec<(Raw, &str)> = vec![
            (Raw::default(), "AzureWebJobsStorage is not set"),
            (
                Raw {
                    storage: Some("AccountName=a;AccountKey=SECRET;Bogus".into()),
                    ..Raw::default()
                },
                "AzureWebJobsStorage",
            ),
            (
                Raw {
                    leasehold_port: Some("http".into()),
                    ..raw()
                },
                "LEASEHOLD_PORT",
            ),
            (
                Raw {
                    leasehold_lease_seconds: Some("90".into()),
                    ..raw()
                },
                "LEASEHOLD_LEASE_SECONDS",
            ),
            (
                Raw {
                    leasehold_queue: Some("Bad_Name".into()),
                    ..raw()
                },
                "LEASEHOLD_QUEUE",
            ),
            (
                Raw {
                    leasehold_queue: Some("q".repeat(53)),
                    ..raw()
                },
                "the low lane's poison queue",
            ),
            (
                Raw {
                    leasehold_low_priority_user_ids: Some("not-a-guid".into()),
                    ..raw()
                },
                "LEASEHOLD_LOW_PRIORITY_USER_IDS",
            ),
            (
                Raw {
                    leasehold_budget: Some("default,account=no/slash".into()),
                    ..raw()
                },
                "LEASEHOLD_BUDGET",
            ),
            (
                Raw {
                    leasehold_throttle_pause_seconds: Some("600".into()),
                    leasehold_max_throttle_pause_seconds: Some("60".into()),
                    ..raw()
                },
                "LEASEHOLD_MAX_THROTTLE_PAUSE_SECONDS",
            ),
            (
                Raw {
                    leasehold_fencing: Some("maybe".into()),
                    ..raw()
                },
                "LEASEHOLD_FENCING",
            ),
            (
                Raw {
                    leasehold_insecure_no_start_key: Some("sure".into()),
                    ..raw()
                },
                "LEASEHOLD_INSECURE_NO_START_KEY",
            ),
            (
                Raw {
                    leasehold_http_header_timeout_seconds: Some("0".into()),
                    ..raw()
                },
                "LEASEHOLD_HTTP_HEADER_TIMEOUT_SECONDS must be at least 1",
            ),
            (
                Raw {
                    leasehold_http_max_connections: Some("0".into()),
                    ..raw()
                },
                "LEASEHOLD_HTTP_MAX_CONNECTIONS must be at least 1",
            ),
            (
                Raw {
                    leasehold_metrics_interval_seconds: Some("0".into()),
                    ..raw()
                },
                "LEASEHOLD_METRICS_INTERVAL_SECONDS must be at least 1",
            ),
            (
                Raw {
                    leasehold_metrics_interval_seconds: Some("a minute".into()),
                    ..raw()
                },
                "LEASEHOLD_METRICS_INTERVAL_SECONDS must be a whole number",
            ),
            (
                Raw {
                    leasehold_integration_user_ids: Some("not-a-guid".into()),
                    ..raw()
                },
                "LEASEHOLD_INTEGRATION_USER_IDS",
            ),
            (
                Raw {
                    leasehold_logic_command: Some("true".into()),
                    leasehold_logic_url: Some("http://x".into()),
                    ..raw()
                },
                "not both",
            ),
            (
                Raw {
                    leasehold_api_key: Some("SECRET".into()),
                    leasehold_admin_key: Some("SECRET".into()),
                    ..raw()
                },
                "LEASEHOLD_ADMIN_KEY is the same as LEASEHOLD_API_KEY",
            ),
        ];
        for (raw, expect) in cases {
            let e = format!("{:#}", Settings::from_raw(raw).unwrap_err());
            assert!(e.contains(expect), "expected {expect:?} in {e}");
            assert!(!e.contains("SECRET"), "{e}");
        }
    }

    /// Issue 44: with Blob and Queue endpoints but no Table endpoint, history is off and says
    /// why (naming TableEndpoint), and the wiring builds no Table client: no request goes to a
    /// derived `<account>.table.core.windows.net` (the account's public host behind a private
    /// endpoint, in plain HTTP here). With a Table endpoint, or history turned off, as before.
    #[test]
    fn no_table_endpoint_turns_history_off_with_a_warning_and_wires_no_table_client() {
        let explicit = "DefaultEndpointsProtocol=http;AccountName=acct;AccountKey=c2VjcmV0;\
                        BlobEndpoint=http://10.0.0.4/acct;QueueEndpoint=http://10.0.0.5/acct";
        let settings = |storage: String, history: Option<&str>| {
            Settings::from_raw(Raw {
                storage: Some(storage),
                leasehold_history: history.map(str::to_string),
                ..Raw::default()
            })
            .unwrap()
        };
        let off = settings(explicit.to_string(), None);
        assert!(off.history.is_none());
        let why = off.history_off.as_deref().unwrap();
        assert!(why.contains("TableEndpoint"), "{why}");
        assert!(!why.contains("c2VjcmV0"), "{why}");
        let wiring = leasehold_ops::wiring::wire(&off.storage()).unwrap();
        assert!(wiring.history.is_none(), "no history store, so no Table request");

        let on = settings(format!("{explicit};TableEndpoint=http://10.0.0.6/acct"), None);
        assert!(on.history.is_some() && on.history_off.is_none());
        assert_eq!(
            on.account.table_endpoint().as_deref(),
            Some("http://10.0.0.6/acct")
        );
        assert!(
            leasehold_ops::wiring::wire(&on.storage())
                .unwrap()
                .history
                .is_some()
        );

        let meant = settings(explicit.to_string(), Some("false"));
        assert!(
            meant.history.is_none() && meant.history_off.is_none(),
            "turned off: no warning"
        );
    }
}
