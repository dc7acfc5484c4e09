//! OpenTelemetry trace export, configured by the standard variables and off when they
//! name no endpoint: `OTEL_EXPORTER_OTLP_ENDPOINT` (or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`)
//! turns it on; `OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`, `OTEL_TRACES_SAMPLER`
//! (`_ARG`), `OTEL_EXPORTER_OTLP_HEADERS`, `OTEL_BSP_SCHEDULE_DELAY` and the rest are read
//! by the SDK and the exporter; `OTEL_SDK_DISABLED=true` or `OTEL_TRACES_EXPORTER=none`
//! turn it off. Spans go out as OTLP over HTTP with protobuf bodies, to an `http://` or an
//! `https://` endpoint: for TLS, `OTEL_EXPORTER_OTLP_CERTIFICATE` (or `…_TRACES_CERTIFICATE`)
//! names a PEM file of CA certificates trusted besides the usual roots, and
//! `OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE` with `OTEL_EXPORTER_OTLP_CLIENT_KEY` a client
//! certificate for mutual TLS. The values of `OTEL_EXPORTER_OTLP_HEADERS` (an
//! `authorization=…` for a hosted collector, say) are kept out of diagnostics.
//!
//! The spans themselves are made in `skein_runtime::spans`; the id generator here gives a
//! session's span the id that module planned for it, so that every worker names a
//! session's span alike.

use std::time::Duration;

use anyhow::{Context, Result};
use opentelemetry::trace::{SpanId, TraceId};
use opentelemetry_http::{Bytes, HttpClient, HttpError, Request, Response};
use opentelemetry_otlp::WithHttpConfig;
use opentelemetry_sdk::trace::{IdGenerator, RandomIdGenerator, SdkTracerProvider};
use opentelemetry_sdk::Resource;

/// Ids planned by `skein_runtime::spans`, random ones otherwise.
#[derive(Debug, Default)]
struct PlannedIds(RandomIdGenerator);

impl IdGenerator for PlannedIds {
    fn new_trace_id(&self) -> TraceId {
        skein_runtime::spans::planned_trace_id()
            .map(|t| TraceId::from_bytes(t.to_be_bytes()))
            .unwrap_or_else(|| self.0.new_trace_id())
    }

    fn new_span_id(&self) -> SpanId {
        skein_runtime::spans::planned_span_id()
            .map(|s| SpanId::from_bytes(s.to_be_bytes()))
            .unwrap_or_else(|| self.0.new_span_id())
    }
}

fn set(name: &str) -> bool {
    std::env::var(name).is_ok_and(|v| !v.trim().is_empty())
}

/// Whether the environment asks for trace export.
pub fn wanted() -> bool {
    let disabled = std::env::var("OTEL_SDK_DISABLED").is_ok_and(|v| v.eq_ignore_ascii_case("true"));
    let exporter_none = std::env::var("OTEL_TRACES_EXPORTER")
        .is_ok_and(|v| v.split(',').all(|e| e.trim().eq_ignore_ascii_case("none")));
    !disabled
        && !exporter_none
        && (set("OTEL_EXPORTER_OTLP_ENDPOINT") || set("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))
}

/// Installs the tracer provider when the environment asks for it; the returned provider
/// must be shut down before the process exits, which sends what is still buffered. Call it
/// outside the async runtime (the exporter's HTTP client blocks).
pub fn install() -> Result<Option<SdkTracerProvider>> {
    if !wanted() {
        return Ok(None);
    }
    crate::config::register_secrets(header_values());
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_http_client(Exporter(client()?))
        .build()
        .context("OpenTelemetry: cannot make the OTLP exporter (OTEL_EXPORTER_OTLP_*)")?;
    let resource = Resource::builder().build();
    let resource = if set("OTEL_SERVICE_NAME") || resource_names_service() {
        resource
    } else {
        Resource::builder().with_service_name("skein").build()
    };
    let provider = SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_id_generator(PlannedIds::default())
        .with_resource(resource)
        .build();
    opentelemetry::global::set_tracer_provider(provider.clone());
    skein_runtime::spans::record_spans(true);
    Ok(Some(provider))
}

/// The first of `names` that is set, with its value.
fn first_set(names: &[&'static str]) -> Option<(&'static str, String)> {
    names
        .iter()
        .find_map(|n| Some((*n, std::env::var(n).ok().filter(|v| !v.trim().is_empty())?)))
}

/// The values of the export's headers (`k=v,…`, values percent-encoded or not), to scrub.
fn header_values() -> Vec<String> {
    let mut out = vec![];
    for var in [
        "OTEL_EXPORTER_OTLP_HEADERS",
        "OTEL_EXPORTER_OTLP_TRACES_HEADERS",
    ] {
        for pair in std::env::var(var).unwrap_or_default().split(',') {
            if let Some((_, v)) = pair.split_once('=') {
                let v = v.trim();
                out.push(v.to_string());
                out.push(v.replace("%20", " "));
            }
        }
    }
    out
}

/// The HTTP client the exporter sends with: the usual roots plus any CA named, a client
/// identity when one is named, and the export timeout (`OTEL_EXPORTER_OTLP_TIMEOUT`, ms).
fn client() -> Result<reqwest::blocking::Client> {
    let read = |var: &str, path: &str| {
        std::fs::read(path).with_context(|| format!("OpenTelemetry: cannot read {var}={path}"))
    };
    let timeout = first_set(&[
        "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT",
        "OTEL_EXPORTER_OTLP_TIMEOUT",
    ])
    .map(|(var, v)| {
        v.trim()
            .parse::<u64>()
            .map(Duration::from_millis)
            .with_context(|| format!("OpenTelemetry: {var}={v} is not a number of milliseconds"))
    })
    .transpose()?
    .unwrap_or(Duration::from_secs(10));
    let mut b = reqwest::blocking::Client::builder().timeout(timeout);
    if let Some((var, path)) = first_set(&[
        "OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE",
        "OTEL_EXPORTER_OTLP_CERTIFICATE",
    ]) {
        let pem = read(var, &path)?;
        let certs = reqwest::Certificate::from_pem_bundle(&pem)
            .with_context(|| format!("OpenTelemetry: {var}={path} holds no PEM certificate"))?;
        anyhow::ensure!(
            !certs.is_empty(),
            "OpenTelemetry: {var}={path} holds no PEM certificate"
        );
        for c in certs {
            b = b.add_root_certificate(c);
        }
    }
    let cert = first_set(&[
        "OTEL_EXPORTER_OTLP_TRACES_CLIENT_CERTIFICATE",
        "OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE",
    ]);
    let key = first_set(&[
        "OTEL_EXPORTER_OTLP_TRACES_CLIENT_KEY",
        "OTEL_EXPORTER_OTLP_CLIENT_KEY",
    ]);
    match (cert, key) {
        (Some((cv, cp)), Some((kv, kp))) => {
            let mut pem = read(cv, &cp)?;
            pem.push(b'\n');
            pem.extend(read(kv, &kp)?);
            let id = reqwest::Identity::from_pem(&pem).with_context(|| {
                format!("OpenTelemetry: {cv}={cp} with {kv}={kp} is not a PEM certificate and key")
            })?;
            b = b.identity(id);
        }
        (None, None) => {}
        _ => anyhow::bail!(
            "OpenTelemetry: OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE and \
             OTEL_EXPORTER_OTLP_CLIENT_KEY go together"
        ),
    }
    b.build()
        .context("OpenTelemetry: cannot make the exporter's HTTP client")
}

/// [`HttpClient`] over reqwest's blocking client: the exporter's batch thread waits for
/// each export, as with the client the exporter would make itself.
#[derive(Debug)]
struct Exporter(reqwest::blocking::Client);

#[async_trait::async_trait]
impl HttpClient for Exporter {
    async fn send_bytes(&self, request: Request<Bytes>) -> Result<Response<Bytes>, HttpError> {
        let (parts, body) = request.into_parts();
        let resp = self
            .0
            .request(parts.method, parts.uri.to_string())
            .headers(parts.headers)
            .body(body.to_vec())
            .send()?;
        let mut out = Response::builder().status(resp.status());
        if let Some(h) = out.headers_mut() {
            *h = resp.headers().clone();
        }
        // A collector's answer is a short status message; a longer one is cut.
        let mut body = Vec::new();
        std::io::Read::read_to_end(&mut std::io::Read::take(resp, 1 << 20), &mut body)?;
        Ok(out.body(Bytes::from(body))?)
    }
}

fn resource_names_service() -> bool {
    std::env::var("OTEL_RESOURCE_ATTRIBUTES").is_ok_and(|a| {
        a.split(',')
            .any(|kv| kv.trim().starts_with("service.name="))
    })
}

/// Sends what is buffered and stops the exporter.
pub fn shutdown(provider: Option<SdkTracerProvider>) {
    if let Some(p) = provider {
        if let Err(e) = p.shutdown() {
            tracing::warn!(error = %e, "OpenTelemetry: spans could not all be sent");
        }
    }
}
