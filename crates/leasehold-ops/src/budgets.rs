//! Downstream budgets as storage holds them: `leasehold budget status [NAME]` and
//! `leasehold budget resume NAME` (and the admin API's budget view).

use std::time::{Duration, SystemTime};

use leasehold_runtime::{AzureBudgets, BudgetStore, check_budget_name};
use serde::Serialize;

use crate::{Operator, OpsError};

/// One budget's pause as storage holds it (every worker honours it, capped at its own
/// `LEASEHOLD_MAX_THROTTLE_PAUSE_SECONDS`).
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct BudgetStatus {
    pub name: String,
    /// Whether it is paused now.
    pub paused: bool,
    /// When the pause ends (RFC 3339; `None` when not paused). Measured on storage's clock,
    /// shown on this machine's.
    #[serde(serialize_with = "crate::clock::serialize_opt")]
    pub until: Option<SystemTime>,
    /// How much longer, in seconds.
    pub paused_for_seconds: u64,
    /// When the pause was last written (a throttle, or a resume), by storage's clock.
    #[serde(serialize_with = "crate::clock::serialize_opt")]
    pub set_at: Option<SystemTime>,
    /// The adaptive limit the worker that paused it had cut to (runs at once on that worker).
    pub limit: Option<u32>,
    /// Whether an operator ended its last pause.
    pub resumed: bool,
}

impl BudgetStatus {
    /// One line a person reads.
    pub fn line(&self) -> String {
        let state = match self.until {
            Some(until) if self.paused => format!(
                "paused for {} more (until {})",
                crate::clock::span(Duration::from_secs(self.paused_for_seconds)),
                crate::clock::rfc3339(until)
            ),
            _ if self.resumed => "running (resumed by an operator)".to_string(),
            _ => "running (not paused)".to_string(),
        };
        let set = self
            .set_at
            .map(|at| format!(", last written {}", crate::clock::rfc3339(at)))
            .unwrap_or_default();
        let limit = self
            .limit
            .map(|l| format!(", its last throttle cut a worker to {l} at once"))
            .unwrap_or_default();
        format!("{}: {state}{set}{limit}", self.name)
    }
}

impl Operator {
    fn budgets(&self) -> AzureBudgets {
        AzureBudgets::in_container(self.inner.container.clone())
    }

    /// The budget `name`'s pause, or every budget ever paused in this deployment's container
    /// (`None`): one request per budget, and one to list them.
    pub async fn budget_status(&self, name: Option<&str>) -> Result<Vec<BudgetStatus>, OpsError> {
        let store = self.budgets();
        let names = match name {
            Some(name) => {
                check_budget_name(name).map_err(|e| OpsError::BadRequest(e.to_string()))?;
                vec![name.to_ascii_lowercase()]
            }
            None => store
                .names()
                .await
                .map_err(|e| OpsError::storage("list the budgets", e))?,
        };
        let mut out = Vec::with_capacity(names.len());
        for name in names {
            let read = store
                .read(&name)
                .await
                .map_err(|e| OpsError::storage("read the budget", e))?;
            let status = match read {
                Some(p) => BudgetStatus {
                    paused: !p.left.is_zero(),
                    until: (!p.left.is_zero()).then(|| SystemTime::now() + p.left),
                    paused_for_seconds: p.left.as_secs_f64().ceil() as u64,
                    set_at: p.set_at,
                    limit: p.limit,
                    resumed: p.resumed,
                    name,
                },
                None => BudgetStatus {
                    name,
                    paused: false,
                    until: None,
                    paused_for_seconds: 0,
                    set_at: None,
                    limit: None,
                    resumed: false,
                },
            };
            out.push(status);
        }
        Ok(out)
    }

    /// Ends the budget `name`'s pause: every worker starts its runs again within its refresh
    /// interval (3 s) of its next look. Says whether it was paused; a budget never paused is
    /// not found.
    pub async fn budget_resume(&self, name: &str) -> Result<bool, OpsError> {
        check_budget_name(name).map_err(|e| OpsError::BadRequest(e.to_string()))?;
        let name = name.to_ascii_lowercase();
        let store = self.budgets();
        if store
            .read(&name)
            .await
            .map_err(|e| OpsError::storage("read the budget", e))?
            .is_none()
        {
            return Err(OpsError::NotFound(format!(
                "no budget {name:?} was ever paused in this deployment (see `leasehold budget status`)"
            )));
        }
        let was = store
            .resume(&name)
            .await
            .map_err(|e| OpsError::storage("resume the budget", e))?;
        tracing::info!(budget = %name, was_paused = was, "budget resumed by an operator");
        Ok(was)
    }
}
