//! Where `leasehold dataverse` gets its bearer token, in this order: `DATAVERSE_ACCESS_TOKEN`,
//! a client secret (`AZURE_TENANT_ID`, `AZURE_CLIENT_ID`, `AZURE_CLIENT_SECRET`), else the Azure
//! CLI login. The scope is `<environment-url>/.default`. Tokens are never printed or logged.

use std::fmt;
use std::sync::Arc;

use anyhow::{Context, Result};
use azure_core::credentials::{Secret, TokenCredential};
use azure_identity::{AzureCliCredential, ClientSecretCredential};

/// The variable holding a ready bearer token (scripts, CI).
pub const TOKEN_VAR: &str = "DATAVERSE_ACCESS_TOKEN";

/// One of the three credential sources.
pub enum Credential {
    /// A bearer token from `DATAVERSE_ACCESS_TOKEN`.
    Token(String),
    /// An app registration's client secret (its application user in the environment).
    ClientSecret {
        tenant_id: String,
        client_id: String,
        credential: Arc<ClientSecretCredential>,
    },
    /// The developer's `az login`.
    AzureCli(Arc<AzureCliCredential>),
}

impl fmt::Debug for Credential {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.describe())
    }
}

fn var(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.trim().is_empty())
}

impl Credential {
    /// The first source that is configured.
    pub fn from_env() -> Result<Self> {
        if let Some(token) = var(TOKEN_VAR) {
            return Ok(Credential::Token(token.trim().to_owned()));
        }
        let Some(secret) = var("AZURE_CLIENT_SECRET") else {
            // AZURE_CLIENT_ID alone is how a managed identity is chosen elsewhere: without a
            // secret there is no client-secret credential, so the Azure CLI login it is.
            let credential = AzureCliCredential::new(None).context("the Azure CLI credential")?;
            return Ok(Credential::AzureCli(credential));
        };
        let (Some(tenant_id), Some(client_id)) = (var("AZURE_TENANT_ID"), var("AZURE_CLIENT_ID")) else {
            anyhow::bail!(
                "AZURE_CLIENT_SECRET is set, but a client secret also needs AZURE_TENANT_ID and AZURE_CLIENT_ID"
            );
        };
        let credential =
            ClientSecretCredential::new(&tenant_id, client_id.clone(), Secret::new(secret), None).context(
                "the client secret credential (AZURE_TENANT_ID, AZURE_CLIENT_ID, AZURE_CLIENT_SECRET)",
            )?;
        Ok(Credential::ClientSecret {
            tenant_id,
            client_id,
            credential,
        })
    }

    /// Which credential this is, for errors (never the secret).
    pub fn describe(&self) -> String {
        match self {
            Credential::Token(_) => format!("the bearer token in {TOKEN_VAR}"),
            Credential::ClientSecret {
                tenant_id, client_id, ..
            } => format!(
                "the client secret of application {client_id} in tenant {tenant_id} (AZURE_CLIENT_ID)"
            ),
            Credential::AzureCli(_) => "the Azure CLI login (az login)".to_owned(),
        }
    }

    /// Whether the identity is an application (an application user in Dataverse) rather than
    /// a person.
    pub fn is_application(&self) -> bool {
        matches!(self, Credential::ClientSecret { .. })
    }

    /// A bearer token for `scope`.
    pub async fn token(&self, scope: &str) -> Result<String> {
        let credential: &dyn TokenCredential = match self {
            Credential::Token(token) => return Ok(token.clone()),
            Credential::ClientSecret { credential, .. } => credential.as_ref(),
            Credential::AzureCli(credential) => credential.as_ref(),
        };
        let token = credential
            .get_token(&[scope], None)
            .await
            .with_context(|| format!("getting a token for {scope} with {}", self.describe()))?;
        Ok(token.token.secret().to_owned())
    }
}
