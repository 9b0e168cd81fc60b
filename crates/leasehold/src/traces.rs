//! Span export over OTLP/HTTP (protobuf), configured by the standard `OTEL_*` variables.
//!
//! Nothing is exported, and nothing is installed, unless `OTEL_EXPORTER_OTLP_ENDPOINT` (or
//! `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) is set, or `OTEL_TRACES_EXPORTER` names `azuremonitor`
//! (Application Insights, straight from `APPLICATIONINSIGHTS_CONNECTION_STRING`: no collector): the libraries' spans
//! ([`leasehold_runtime::trace`]) then go to OpenTelemetry's no-op tracer, and only the trace
//! contexts travel (in messages, logs, history and to the logic). When it is set, this installs
//! the global tracer provider with a batch exporter; the exporter reads the endpoint, headers
//! (`OTEL_EXPORTER_OTLP_HEADERS`, e.g. a collector's API key) and compression from the
//! environment itself, the provider reads the sampler (`OTEL_TRACES_SAMPLER`,
//! `OTEL_TRACES_SAMPLER_ARG`) and the resource (`OTEL_SERVICE_NAME`, default `leasehold`;
//! `OTEL_RESOURCE_ATTRIBUTES`).
//!
//! The requests go through a `reqwest` client of ours (the crates' own HTTP client features
//! would build a second `reqwest`, or a blocking one), run on the process's tokio runtime: the
//! SDK's batch processor exports from a thread of its own.

use std::time::Duration;

use anyhow::{Context as _, bail};
use async_trait::async_trait;
use bytes::Bytes;
use opentelemetry_http::{HttpClient, HttpError, Request, Response};
use opentelemetry_otlp::{Protocol, WithExportConfig, WithHttpConfig};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::SdkTracerProvider;

/// The service name when `OTEL_SERVICE_NAME` (or `service.name` in `OTEL_RESOURCE_ATTRIBUTES`)
/// does not name one.
pub const DEFAULT_SERVICE_NAME: &str = "leasehold";

/// Longest collector answer read, in bytes (the answer to an export is small; the SDK's own
/// clients stop at 4 MiB).
const MAX_ANSWER_BYTES: usize = 1 << 20;

/// An export's time limit when `OTEL_EXPORTER_OTLP_TIMEOUT` names none (the specification's
/// default).
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);

/// The installed exporter; [`Traces::shutdown`] sends what is left.
#[derive(Debug)]
pub struct Traces {
    provider: SdkTracerProvider,
}

fn var(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.trim().is_empty())
}

/// Installs the global tracer provider when the environment asks for export (see the module's
/// doc); `None` when it does not. Refuses settings it cannot honour (a protocol other than
/// `http/protobuf`, an exporter other than `otlp`) rather than export nothing quietly.
pub fn install() -> anyhow::Result<Option<Traces>> {
    if var("OTEL_SDK_DISABLED").is_some_and(|v| v.eq_ignore_ascii_case("true")) {
        return Ok(None);
    }
    let endpoint = var("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT").or_else(|| var("OTEL_EXPORTER_OTLP_ENDPOINT"));
    // OTEL_TRACES_EXPORTER is a comma list: otlp (the default when an endpoint is set),
    // azuremonitor, none.
    let (mut otlp, mut azure) = (false, false);
    match var("OTEL_TRACES_EXPORTER") {
        None => otlp = endpoint.is_some(),
        Some(list) => {
            for name in list.split(',').map(str::trim).filter(|n| !n.is_empty()) {
                match name {
                    "otlp" => otlp = true,
                    "azuremonitor" => azure = true,
                    "none" => {}
                    other => bail!(
                        "OTEL_TRACES_EXPORTER names {other:?}: leasehold exports over otlp or to azuremonitor (Application Insights), or none"
                    ),
                }
            }
        }
    }
    if !otlp && !azure {
        return Ok(None);
    }
    let timeout = var("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT")
        .or_else(|| var("OTEL_EXPORTER_OTLP_TIMEOUT"))
        .map(|ms| {
            ms.parse::<u64>()
                .map(Duration::from_millis)
                .with_context(|| format!("OTEL_EXPORTER_OTLP_TIMEOUT={ms:?} is not a number of milliseconds"))
        })
        .transpose()?
        .unwrap_or(DEFAULT_TIMEOUT);
    let named = var("OTEL_SERVICE_NAME").is_some()
        || var("OTEL_RESOURCE_ATTRIBUTES")
            .is_some_and(|a| a.split(',').any(|kv| kv.trim().starts_with("service.name=")));
    let mut resource = Resource::builder();
    if !named {
        resource = resource.with_service_name(DEFAULT_SERVICE_NAME);
    }
    let mut provider = SdkTracerProvider::builder().with_resource(resource.build());
    if otlp {
        let Some(endpoint) = endpoint else {
            bail!(
                "OTEL_TRACES_EXPORTER names otlp, but neither OTEL_EXPORTER_OTLP_ENDPOINT nor OTEL_EXPORTER_OTLP_TRACES_ENDPOINT is set"
            );
        };
        for name in [
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
            "OTEL_EXPORTER_OTLP_PROTOCOL",
        ] {
            if let Some(protocol) = var(name)
                && protocol != "http/protobuf"
            {
                bail!(
                    "{name}={protocol:?}: leasehold exports over OTLP/HTTP with protobuf only (http/protobuf)"
                );
            }
        }
        let url = reqwest::Url::parse(&endpoint)
            .with_context(|| format!("the OTLP endpoint {endpoint:?} is not a URL"))?;
        if !matches!(url.scheme(), "http" | "https") {
            bail!("the OTLP endpoint must be http or https, not {:?}", url.scheme());
        }
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_protocol(Protocol::HttpBinary)
            .with_timeout(timeout)
            .with_http_client(Client::new(timeout)?)
            .build()
            .context("the OTLP span exporter")?;
        provider = provider.with_batch_exporter(exporter);
        // Only the host: a path or query may hold a key.
        tracing::info!(endpoint = %url.host_str().unwrap_or(""), "exporting traces over OTLP/HTTP");
    }
    if azure {
        let Some(connection) = var("APPLICATIONINSIGHTS_CONNECTION_STRING") else {
            bail!(
                "OTEL_TRACES_EXPORTER names azuremonitor, but APPLICATIONINSIGHTS_CONNECTION_STRING is not set"
            );
        };
        // The connection string is not logged (its key identifies the resource); its error
        // says what is wrong without it.
        let exporter = opentelemetry_application_insights::Exporter::new_from_connection_string(
            &connection,
            Client::new(timeout)?,
        )
        .map_err(|e| {
            anyhow::anyhow!("APPLICATIONINSIGHTS_CONNECTION_STRING is not a connection string: {e}")
        })?;
        provider = provider.with_batch_exporter(exporter);
        tracing::info!("exporting traces to Application Insights");
    }
    let provider = provider.build();
    opentelemetry::global::set_tracer_provider(provider.clone());
    Ok(Some(Traces { provider }))
}

impl Traces {
    /// Exports what is left (within `limit`) and stops the exporter.
    pub async fn shutdown(self, limit: Duration) {
        let provider = self.provider;
        let done = tokio::task::spawn_blocking(move || provider.shutdown_with_timeout(limit));
        match tokio::time::timeout(limit + Duration::from_secs(1), done).await {
            Ok(Ok(Ok(()))) => {}
            Ok(Ok(Err(e))) => tracing::warn!(error = %e, "traces: the last spans were not all exported"),
            _ => tracing::warn!(?limit, "traces: the exporter did not stop in time"),
        }
    }
}

/// The exporter's HTTP client: `reqwest` on the tokio runtime that installed it.
#[derive(Debug)]
struct Client {
    client: reqwest::Client,
    runtime: tokio::runtime::Handle,
}

impl Client {
    fn new(timeout: Duration) -> anyhow::Result<Self> {
        let client = reqwest::Client::builder()
            .timeout(timeout)
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .context("the OTLP exporter's HTTP client")?;
        Ok(Self {
            client,
            runtime: tokio::runtime::Handle::try_current()
                .context("the OTLP exporter needs the tokio runtime")?,
        })
    }
}

#[async_trait]
impl HttpClient for Client {
    async fn send_bytes(&self, request: Request<Bytes>) -> Result<Response<Bytes>, HttpError> {
        let request = reqwest::Request::try_from(request.map(reqwest::Body::from))?;
        let client = self.client.clone();
        // On the runtime, whatever thread the batch processor exports from.
        let sent = self.runtime.spawn(async move {
            let mut response = client.execute(request).await.map_err(|e| e.without_url())?;
            let status = response.status();
            let mut body = Vec::new();
            while let Some(chunk) = response.chunk().await.map_err(|e| e.without_url())? {
                if body.len() + chunk.len() > MAX_ANSWER_BYTES {
                    break;
                }
                body.extend_from_slice(&chunk);
            }
            Ok::<_, reqwest::Error>((status, body))
        });
        let (status, body) = sent.await??;
        Ok(Response::builder().status(status).body(Bytes::from(body))?)
    }
}
