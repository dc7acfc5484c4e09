//! OpenTelemetry trace export, configured by the standard variables and off when they
//! name no endpoint: `OTEL_EXPORTER_OTLP_ENDPOINT` (or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`)
//! turns it on; `OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`, `OTEL_TRACES_SAMPLER`
//! (`_ARG`), `OTEL_EXPORTER_OTLP_HEADERS`, `OTEL_BSP_SCHEDULE_DELAY` and the rest are read
//! by the SDK and the exporter; `OTEL_SDK_DISABLED=true` or `OTEL_TRACES_EXPORTER=none`
//! turn it off. Spans go out as OTLP over HTTP with protobuf bodies.
//!
//! The spans themselves are made in `skein_runtime::spans`; the id generator here gives a
//! session's span the id that module planned for it, so that every worker names a
//! session's span alike.

use anyhow::{Context, Result};
use opentelemetry::trace::{SpanId, TraceId};
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
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
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
