//! The `leasehold dataverse …` command line (clap), kept here so `main.rs` only names it.

use std::io::{BufRead, IsTerminal, Write};
use std::path::PathBuf;

use anyhow::{Result, bail};
use clap::{Args, Subcommand};

use crate::{
    Credential, RegisterSpec, RetryPolicy, StartKey, WebApi, client, list, plan_register, plan_unregister,
    plan_unregister_live, register, text_list, text_plan, text_register, text_unregister,
    text_unregister_plan, unregister,
};

macro_rules! credentials {
    () => {
        "Credentials, in this order: a bearer token in DATAVERSE_ACCESS_TOKEN; a client secret \
(AZURE_TENANT_ID, AZURE_CLIENT_ID, AZURE_CLIENT_SECRET) of an app registration that has an application \
user in the environment; else the Azure CLI login (az login). The token's scope is \
<environment-url>/.default. The identity needs a security role with Create, Read, Write and Delete on \
Service Endpoint and SDK Message Processing Step (System Customizer or System Administrator)."
    };
}

macro_rules! register_examples {
    () => {
        "Examples:\n  export LEASEHOLD_START_KEY=$(az functionapp function keys list -g rg-leasehold-dev -n func-leaseholddev --function-name Start --query default -o tsv)\n  \
leasehold dataverse register --environment-url https://contoso-dev.crm4.dynamics.com \\\n      \
--start-url https://func-leaseholddev.azurewebsites.net/api/start --table account --messages Create,Update \\\n      \
--filtering-attributes name,statuscode\n  \
leasehold dataverse register ... --table account --messages Create,Update --priority low   # bulk steps to the low lane\n  \
leasehold dataverse register ... --dry-run      # print the requests (key redacted), send nothing"
    };
}

/// Wire a Dataverse (Dynamics 365) environment to Leasehold's Start function: a webhook service
/// endpoint and one asynchronous post-operation step per table and message.
#[derive(Debug, Subcommand)]
pub enum DataverseCommand {
    /// Create or update the webhook endpoint (URL, key) and its steps. Idempotent: a second run
    /// changes nothing and says so; a rotated key updates only the endpoint.
    ///
    /// The Start key comes from LEASEHOLD_START_KEY or --start-key-file, never from the command
    /// line (it would land in shell history). Dataverse sends it as ?code=<key> (WebhookKey),
    /// which is what Functions keys expect. The key cannot be read back from Dataverse, so the
    /// endpoint's description holds a fingerprint of it (16 hex digits of a SHA-256) to see a
    /// rotation. For the tables named, the endpoint's steps become exactly the messages named
    /// (a step for a message no longer named is removed, a disabled one is enabled); steps for
    /// other tables are left alone.
    ///
    /// The description also carries a marker line, `[leasehold-managed endpoint=<name>] …`: an
    /// endpoint of that name without it is not Leasehold's and is refused (it says whose it
    /// looks like), unless --adopt. Two registers at once converge to one endpoint (the oldest
    /// is kept); duplicates left by an earlier run are repaired the same way.
    #[command(after_help = register_examples!(), after_long_help = concat!(register_examples!(), "\n\n", credentials!()))]
    Register(RegisterArgs),
    /// Show the webhook endpoints named leasehold… and their steps, and which of them are
    /// Leasehold's (carry the marker `register` writes).
    #[command(
        after_help = "Examples:\n  leasehold dataverse list --environment-url https://contoso-dev.crm4.dynamics.com\n  \
        leasehold dataverse list --environment-url https://contoso-dev.crm4.dynamics.com --json",
        after_long_help = concat!("Examples:\n  leasehold dataverse list --environment-url https://contoso-dev.crm4.dynamics.com\n  \
        leasehold dataverse list --environment-url https://contoso-dev.crm4.dynamics.com --json", "\n\n", credentials!())
    )]
    List(ListArgs),
    /// Remove a webhook endpoint; Dataverse removes its steps with it. Without --name, the
    /// Leasehold endpoint there is (several: say which with --name). Only an endpoint carrying
    /// the marker `register` writes is Leasehold's: any other is refused (left alone without
    /// --name) unless --force. Lists the endpoints and steps it deletes and asks first; without a
    /// terminal to ask on it refuses unless --yes.
    #[command(
        after_help = "Examples:\n  leasehold dataverse unregister --environment-url https://contoso-dev.crm4.dynamics.com --dry-run\n  \
        leasehold dataverse unregister --environment-url https://contoso-dev.crm4.dynamics.com   # lists, asks\n  \
        leasehold dataverse unregister --environment-url https://contoso-dev.crm4.dynamics.com --name leasehold-func-leaseholddev.azurewebsites.net --yes",
        after_long_help = concat!("Examples:\n  leasehold dataverse unregister --environment-url https://contoso-dev.crm4.dynamics.com --dry-run\n  \
        leasehold dataverse unregister --environment-url https://contoso-dev.crm4.dynamics.com   # lists, asks\n  \
        leasehold dataverse unregister --environment-url https://contoso-dev.crm4.dynamics.com --name leasehold-func-leaseholddev.azurewebsites.net --yes", "\n\n", credentials!())
    )]
    Unregister(UnregisterArgs),
}

/// The environment and how to talk to it.
#[derive(Debug, Args)]
pub struct Environment {
    /// The Dataverse environment, like https://contoso.crm4.dynamics.com (https; http only for
    /// 127.0.0.1/localhost).
    #[arg(long, env = "DATAVERSE_ENVIRONMENT_URL", value_name = "URL")]
    pub environment_url: String,
}

#[derive(Debug, Args)]
pub struct RegisterArgs {
    #[command(flatten)]
    pub environment: Environment,
    /// The Start function's URL, without the key (az functionapp function show … --query
    /// invokeUrlTemplate).
    #[arg(long, value_name = "URL")]
    pub start_url: String,
    /// Tables (logical names), comma-separated or repeated.
    #[arg(long = "table", value_delimiter = ',', required = true, value_name = "TABLE")]
    pub tables: Vec<String>,
    /// SDK messages, like Create,Update,Delete.
    #[arg(long, value_delimiter = ',', required = true, value_name = "MESSAGES")]
    pub messages: Vec<String>,
    /// For Update: the step fires only when one of these columns is in the request (present,
    /// changed or not). Leave out the columns your logic writes back.
    #[arg(long, value_delimiter = ',', value_name = "COLUMNS")]
    pub filtering_attributes: Vec<String>,
    /// The endpoint's name (starts with "leasehold") [default: leasehold-<host of --start-url>,
    /// with -low for --priority low].
    #[arg(long)]
    pub name: Option<String>,
    /// The lane these steps' events go to: high (the default: a person's saves) or low (bulk
    /// traffic: imports, integrations), a second endpoint whose URL asks Start for the low lane.
    #[arg(long, value_parser = ["high", "low"], default_value = "high")]
    pub priority: String,
    /// Read the Start key from this file instead of LEASEHOLD_START_KEY.
    #[arg(long, value_name = "PATH")]
    pub start_key_file: Option<PathBuf>,
    /// Take over an endpoint of this name that does not carry Leasehold's marker (one an
    /// earlier leasehold registered, say): register rewrites it and writes the marker. Only for
    /// an endpoint that is Leasehold's: a refusal says whose it looks like.
    #[arg(long)]
    pub adopt: bool,
    /// Print the requests (the key redacted) and send nothing; needs no credentials.
    #[arg(long)]
    pub dry_run: bool,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct ListArgs {
    #[command(flatten)]
    pub environment: Environment,
    /// Only the endpoint with this name.
    #[arg(long)]
    pub name: Option<String>,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct UnregisterArgs {
    #[command(flatten)]
    pub environment: Environment,
    /// The endpoint to remove [default: the only Leasehold endpoint there is].
    #[arg(long)]
    pub name: Option<String>,
    /// Delete without asking (needed when there is no terminal to ask on: scripts, CI).
    #[arg(long, short = 'y')]
    pub yes: bool,
    /// Delete the endpoint named by --name even though it does not carry Leasehold's marker
    /// (it is not Leasehold's, or an earlier leasehold's registered before the marker).
    #[arg(long, requires = "name")]
    pub force: bool,
    /// Print the requests and send nothing; needs no credentials.
    #[arg(long)]
    pub dry_run: bool,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

fn connect(environment: &Environment) -> Result<WebApi> {
    let url = client::environment_url(&environment.environment_url)?;
    WebApi::new(url, Credential::from_env()?, RetryPolicy::default())
}

/// Asks on `output` whether to go ahead; yes only for an answer of y or yes.
fn confirm(input: &mut impl BufRead, output: &mut impl Write, question: &str) -> std::io::Result<bool> {
    write!(output, "{question} [y/N] ")?;
    output.flush()?;
    let mut answer = String::new();
    input.read_line(&mut answer)?;
    Ok(matches!(answer.trim().to_ascii_lowercase().as_str(), "y" | "yes"))
}

fn to_json(value: &impl serde::Serialize) -> Result<String> {
    Ok(serde_json::to_string_pretty(value)?)
}

/// Runs a `dataverse` command; the text (or JSON) to print.
pub async fn run(command: DataverseCommand) -> Result<String> {
    match command {
        DataverseCommand::Register(a) => {
            let key = StartKey::load(a.start_key_file.as_deref())?;
            let named = a.name.is_some();
            let spec = RegisterSpec::new(
                &a.environment.environment_url,
                &a.start_url,
                a.name,
                &a.tables,
                &a.messages,
                &a.filtering_attributes,
                key,
            )?;
            let spec = if a.priority == "low" {
                spec.for_low_lane(named)?
            } else {
                spec
            };
            let spec = RegisterSpec {
                adopt: a.adopt,
                ..spec
            };
            if a.dry_run {
                let plan = plan_register(&spec)?;
                return if a.json {
                    to_json(&serde_json::json!({ "dryRun": true, "requests": plan }))
                } else {
                    Ok(text_plan(&plan))
                };
            }
            let report = register(&connect(&a.environment)?, &spec).await?;
            if a.json {
                to_json(&report)
            } else {
                Ok(text_register(&report))
            }
        }
        DataverseCommand::List(a) => {
            let report = list(&connect(&a.environment)?, a.name.as_deref()).await?;
            if a.json {
                to_json(&report)
            } else {
                Ok(text_list(&report))
            }
        }
        DataverseCommand::Unregister(a) => {
            if a.dry_run {
                let url = client::environment_url(&a.environment.environment_url)?;
                let plan = plan_unregister(&url, a.name.as_deref())?;
                return if a.json {
                    to_json(&serde_json::json!({ "dryRun": true, "requests": plan }))
                } else {
                    Ok(text_plan(&plan))
                };
            }
            let api = connect(&a.environment)?;
            let plan = plan_unregister_live(&api, a.name.as_deref(), a.force).await?;
            if !plan.endpoints.is_empty() && !a.yes {
                let listing = text_unregister_plan(&plan);
                if !(std::io::stdin().is_terminal() && std::io::stderr().is_terminal()) {
                    bail!(
                        "{listing}\nnothing deleted: unregister asks before it deletes, and there is no terminal to ask on; rerun with --yes to delete the above"
                    );
                }
                eprintln!("{listing}");
                let mut stderr = std::io::stderr();
                if !confirm(&mut std::io::stdin().lock(), &mut stderr, "Delete them?")? {
                    bail!("nothing deleted (not confirmed)");
                }
            }
            let report = unregister(&api, plan).await?;
            if a.json {
                to_json(&report)
            } else {
                Ok(text_unregister(&report))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn confirm_takes_only_yes() {
        for (answer, yes) in [
            ("y\n", true),
            ("YES\n", true),
            (" yes \n", true),
            ("\n", false),
            ("n\n", false),
            ("yep\n", false),
            ("", false),
        ] {
            let mut out = Vec::new();
            let got = confirm(&mut answer.as_bytes(), &mut out, "Delete them?").unwrap();
            assert_eq!(got, yes, "{answer:?}");
            assert_eq!(String::from_utf8(out).unwrap(), "Delete them? [y/N] ");
        }
    }
}
