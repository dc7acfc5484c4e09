//! skein-llm: the `Model` trait and its providers.
//!
//! A model name is `provider:model` (`scripted:orchestrator`, `openai:gpt-4o-mini`,
//! `anthropic:claude-…`, or a provider named in config such as `local:qwen`). The
//! [`Registry`] routes a request to its provider and prices the answer from the price
//! table. Providers never see session state: a request in, an answer and its usage out.
//! Of skein's crates it depends on `skein-core` alone, and never on the runtime.
//!
//! Providers: [`scripted`] (offline, deterministic), [`openai`] (OpenAI-compatible chat
//! completions: OpenAI, vLLM, Ollama, llama.cpp, LM Studio, OpenRouter) and
//! [`anthropic`] (Messages API), configured from `[models]` ([`config`],
//! [`registry_from_config`]); see `docs/providers.md`.
//!
//! # Errors
//!
//! A provider returns a precise [`Error`] kind; the runtime records every failed call and
//! retries what [`Error::is_retryable`] allows, waiting at least [`Error::retry_after`].
//! The HTTP providers also retry 408/429/5xx and connection failures a few times in
//! process ([`http`]). No error message carries an API key.
//!
//! # Tool calls that could not be read: the `_raw`/`_error` convention
//!
//! A model sometimes asks for a tool with arguments that are not JSON. The call is kept
//! (so the turn still has its call and the model hears back) and its `args` are
//!
//! ```json
//! {"_raw": "<the arguments exactly as the model wrote them>", "_error": "<why they could not be read>"}
//! ```
//!
//! ([`malformed_args`], recognised by [`args_error`]). The runtime is to answer such a
//! call with a failed tool result quoting `_error` instead of running the tool (a tool
//! would only complain about missing fields), so the model can correct itself on its
//! next turn. A call with no tool name at all, and in
//! `tool_mode = "json"` an answer that holds a `{` but no readable call or answer, becomes
//! a call of the tool [`INVALID_TOOL_CALL`] with the same arguments (see [`json_tool`]).
//! When the transcript is sent back, `_raw` is what the provider sees as that call's
//! arguments, so the model reads what it actually wrote.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use std::path::Path;

use async_trait::async_trait;
use serde_json::{json, Value};
use skein_core::{Message, ModelRequest, ModelResponse, Usage};

mod alarm;
pub mod anthropic;
pub mod config;
pub mod http;
pub mod json_tool;
pub mod openai;
pub mod ratelimit;
pub mod scripted;
pub mod stream;

pub use config::{
    ApiKey, KeySource, Limits, ModelsConfig, Price, ProviderConfig, ProviderKind, ProviderSettings,
    ToolMode,
};
pub use stream::TextSink;

/// Most tool calls read from one streamed answer (a bound on what a server can make a
/// worker hold).
pub(crate) const MAX_STREAMED_CALLS: usize = 1024;

/// Key of the arguments as the model wrote them, in arguments that could not be read.
pub const RAW_KEY: &str = "_raw";
/// Key of the reason they could not be read.
pub const ERROR_KEY: &str = "_error";
/// Tool name of a call that could not be read at all.
pub const INVALID_TOOL_CALL: &str = "_invalid_tool_call";

/// Arguments `{"_raw": raw, "_error": error}` for a call whose arguments could not be
/// read (see the crate docs).
pub fn malformed_args(raw: &str, error: &str) -> Value {
    json!({ RAW_KEY: raw, ERROR_KEY: error })
}

/// `(raw, error)` when `args` follow the `_raw`/`_error` convention.
pub fn args_error(args: &Value) -> Option<(&str, &str)> {
    let o = args.as_object()?;
    Some((o.get(RAW_KEY)?.as_str()?, o.get(ERROR_KEY)?.as_str()?))
}

/// One provider's answer to one request.
#[derive(Debug, Clone, PartialEq)]
pub struct Completion {
    pub response: ModelResponse,
    pub usage: Usage,
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// No provider of that name is configured.
    #[error("unknown model provider `{provider}` in `{model}`; configured: {known}")]
    UnknownProvider {
        provider: String,
        model: String,
        known: String,
    },
    #[error(
        "model `{model}` is not of the form `provider:model` (a bare model name needs \
         `[models] default_provider`)"
    )]
    BadModelName { model: String },
    /// The provider's configuration is unusable (missing key, bad script …).
    #[error("{0}")]
    Config(String),
    /// HTTP status from the provider; `retry_after` from its header when given.
    #[error("provider answered HTTP {status}: {message}")]
    Http {
        status: u16,
        message: String,
        retry_after: Option<Duration>,
    },
    #[error("request timed out after {0:?}")]
    Timeout(Duration),
    #[error("connection failed: {0}")]
    Connect(String),
    /// The answer could not be understood.
    #[error("malformed answer: {0}")]
    Malformed(String),
}

impl Error {
    /// Whether trying the same request again may succeed.
    pub fn is_retryable(&self) -> bool {
        match self {
            Error::Http { status, .. } => *status == 429 || *status == 408 || *status >= 500,
            Error::Timeout(_) | Error::Connect(_) => true,
            Error::Malformed(_) => true,
            Error::UnknownProvider { .. } | Error::BadModelName { .. } | Error::Config(_) => false,
        }
    }

    /// How long the provider asked us to wait, if it said.
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            Error::Http { retry_after, .. } => *retry_after,
            _ => None,
        }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// A source of model answers.
#[async_trait]
pub trait Provider: Send + Sync {
    /// Answers `req`; `model` is the part of `req.model` after `provider:`.
    async fn complete(&self, model: &str, req: &ModelRequest) -> Result<Completion>;

    /// Answers `req` as [`Provider::complete`] does, sending the answer's text to
    /// `on_text` while it arrives. A provider that cannot stream answers whole (and says
    /// nothing to `on_text`). The completion is the same either way.
    async fn complete_streaming(
        &self,
        model: &str,
        req: &ModelRequest,
        on_text: TextSink<'_>,
    ) -> Result<Completion> {
        let _ = on_text;
        self.complete(model, req).await
    }

    /// The secret values this provider sends (its API key as it reads now), so that
    /// whatever is recorded or shown can be scrubbed of them.
    fn known_secrets(&self) -> Vec<String> {
        Vec::new()
    }
}

/// Splits `provider:model`.
pub fn split_model(model: &str) -> Result<(&str, &str)> {
    model
        .split_once(':')
        .filter(|(p, m)| !p.is_empty() && !m.is_empty())
        .ok_or_else(|| Error::BadModelName {
            model: model.to_string(),
        })
}

/// Providers by name, and the prices of their models.
#[derive(Clone, Default)]
pub struct Registry {
    providers: BTreeMap<String, Arc<dyn Provider>>,
    prices: BTreeMap<String, Price>,
    /// `[models] default_provider`: the provider of a model named without one.
    default_provider: Option<String>,
    /// Each provider's quotas: the provider's own, and its models' (see
    /// [`Registry::limits`]).
    limits: BTreeMap<String, (Limits, BTreeMap<String, Limits>)>,
}

impl Registry {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn insert(&mut self, name: impl Into<String>, provider: Arc<dyn Provider>) {
        self.providers.insert(name.into(), provider);
    }

    pub fn names(&self) -> Vec<&str> {
        self.providers.keys().map(String::as_str).collect()
    }

    pub fn has(&self, name: &str) -> bool {
        self.providers.contains_key(name)
    }

    /// The provider and model a model name stands for: `provider:model`, or a bare model
    /// name under `[models] default_provider`.
    pub fn resolve<'m>(&'m self, model: &'m str) -> Result<(&'m str, &'m str)> {
        match (split_model(model), &self.default_provider) {
            (Ok(pm), _) => Ok(pm),
            (Err(_), Some(p)) if !model.trim().is_empty() => Ok((p.as_str(), model)),
            (Err(e), _) => Err(e),
        }
    }

    /// Sets `[models] default_provider`.
    pub fn set_default_provider(&mut self, provider: Option<String>) {
        self.default_provider = provider;
    }

    /// Every provider's [`Provider::known_secrets`].
    pub fn known_secrets(&self) -> Vec<String> {
        self.providers
            .values()
            .flat_map(|p| p.known_secrets())
            .collect()
    }

    /// Sets `provider`'s quotas: `limits` for each of its models, `models` for the models
    /// named there instead.
    pub fn set_limits(
        &mut self,
        provider: impl Into<String>,
        limits: Limits,
        models: BTreeMap<String, Limits>,
    ) {
        self.limits.insert(provider.into(), (limits, models));
    }

    /// The quota key of `model` (`provider:model`, whatever the name's form) and its
    /// declared limits (empty when none are declared). None for a name that resolves to
    /// no provider, and for `scripted`, which has no quota.
    pub fn limits(&self, model: &str) -> Option<(String, Limits)> {
        let (provider, bare) = self.resolve(model).ok()?;
        if provider == "scripted" || !self.has(provider) {
            return None;
        }
        let declared = self
            .limits
            .get(provider)
            .map(|(all, own)| own.get(bare).copied().unwrap_or(*all))
            .unwrap_or_default();
        Some((format!("{provider}:{bare}"), declared))
    }

    /// Prices `model` (`provider:model`, or `provider:*` for all of a provider's models).
    pub fn set_price(&mut self, model: impl Into<String>, price: Price) {
        self.prices.insert(model.into(), price);
    }

    /// The price of `model`: its own entry, else its provider's `provider:*` entry.
    pub fn price(&self, model: &str) -> Option<Price> {
        if let Some(p) = self.prices.get(model) {
            return Some(*p);
        }
        let (provider, bare) = self.resolve(model).ok()?;
        if let Some(p) = self.prices.get(&format!("{provider}:{bare}")) {
            return Some(*p);
        }
        self.prices.get(&format!("{provider}:*")).copied()
    }

    /// Routes `req` to its provider; when the model has a price, `usage.cost` is set from
    /// it.
    pub async fn complete(&self, req: &ModelRequest) -> Result<Completion> {
        let (p, model) = self.route(req)?;
        let c = p.complete(model, req).await?;
        Ok(self.priced(req, c))
    }

    /// [`Registry::complete`], with the answer's text sent to `on_text` as it arrives
    /// (see [`Provider::complete_streaming`]).
    pub async fn complete_streaming(
        &self,
        req: &ModelRequest,
        on_text: TextSink<'_>,
    ) -> Result<Completion> {
        let (p, model) = self.route(req)?;
        let c = p.complete_streaming(model, req, on_text).await?;
        Ok(self.priced(req, c))
    }

    fn route<'r>(&'r self, req: &'r ModelRequest) -> Result<(&'r Arc<dyn Provider>, &'r str)> {
        let (provider, model) = self.resolve(&req.model)?;
        let p = self
            .providers
            .get(provider)
            .ok_or_else(|| Error::UnknownProvider {
                provider: provider.to_string(),
                model: req.model.clone(),
                known: self.names().join(", "),
            })?;
        Ok((p, model))
    }

    fn priced(&self, req: &ModelRequest, mut c: Completion) -> Completion {
        if let Some(price) = self.price(&req.model) {
            c.usage.cost = price.cost(&c.usage);
        }
        c
    }
}

/// A provider of the kind `settings` names.
pub fn build_provider(settings: ProviderSettings) -> Result<Arc<dyn Provider>> {
    Ok(match settings.kind {
        ProviderKind::OpenAi => Arc::new(openai::OpenAiProvider::new(settings)?),
        ProviderKind::Anthropic => Arc::new(anthropic::AnthropicProvider::new(settings)?),
    })
}

/// The registry `[models]` describes: `scripted` (reading `scripts_dir`), every
/// configured provider, `openai` and `anthropic` with their defaults when not configured,
/// and the price table. Keys are not read here but at each call, so a provider whose key
/// is missing fails only when used.
pub fn registry_from_config(models: &ModelsConfig, scripts_dir: &Path) -> Result<Registry> {
    registry_with_scripts(
        models,
        scripted::ScriptSource::Dir(scripts_dir.to_path_buf()),
    )
}

/// [`registry_from_config`] with the `scripted` provider's scripts from `scripts`.
pub fn registry_with_scripts(
    models: &ModelsConfig,
    scripts: scripted::ScriptSource,
) -> Result<Registry> {
    let mut r = Registry::new();
    r.insert(
        "scripted",
        Arc::new(scripted::ScriptedProvider::from_source(scripts)),
    );
    let mut providers = models.providers.clone();
    for default in ["openai", "anthropic"] {
        providers.entry(default.to_string()).or_default();
    }
    for (name, cfg) in &providers {
        if name == "scripted" {
            return Err(Error::Config(
                "[models.providers.scripted]: `scripted` is built in and takes no settings".into(),
            ));
        }
        if name.is_empty() || name.contains(':') {
            return Err(Error::Config(format!(
                "[models.providers]: `{name}` is not a usable provider name (no `:`)"
            )));
        }
        let settings = ProviderSettings::from_config(name, cfg)?;
        r.set_limits(name.clone(), settings.limits, settings.model_limits.clone());
        r.insert(name.clone(), build_provider(settings)?);
    }
    for (model, price) in &models.prices {
        split_model(model).map_err(|_| {
            Error::Config(format!(
                "[models.prices]: `{model}` is not `provider:model`"
            ))
        })?;
        if !price.all().iter().all(|x| x.is_finite() && *x >= 0.0) {
            return Err(Error::Config(format!(
                "[models.prices.\"{model}\"]: prices must be non-negative numbers"
            )));
        }
        r.set_price(model.clone(), *price);
    }
    if let Some(p) = &models.default_provider {
        if !r.has(p) {
            return Err(Error::Config(format!(
                "[models] default_provider: `{p}` is not a provider (known: {})",
                r.names().join(", ")
            )));
        }
    }
    r.set_default_provider(models.default_provider.clone());
    Ok(r)
}

/// Usage estimated from text length (see [`estimate_tokens`]), `estimated: true`, for
/// an answer that reported none.
pub fn estimate_usage(req: &ModelRequest, resp: &ModelResponse) -> Usage {
    let calls = |calls: &[skein_core::ToolCall]| -> u64 {
        calls
            .iter()
            .map(|c| estimate_tokens(&c.name) + estimate_json_tokens(&c.args))
            .sum()
    };
    let messages: u64 = req
        .messages
        .iter()
        .map(|m| match m {
            Message::System { content } | Message::User { content } => estimate_tokens(content),
            Message::Assistant {
                content,
                tool_calls,
            } => estimate_tokens(content.as_deref().unwrap_or("")) + calls(tool_calls),
            Message::Tool { content, .. } => estimate_tokens(content),
        })
        .sum();
    let tools: u64 = req
        .tools
        .iter()
        .map(|t| {
            estimate_tokens(&t.name)
                + estimate_tokens(&t.description)
                + estimate_tokens(&t.parameters.to_string())
        })
        .sum();
    Usage {
        input_tokens: messages + tools,
        output_tokens: estimate_tokens(resp.content.as_deref().unwrap_or(""))
            + calls(&resp.tool_calls),
        cost: 0.0,
        estimated: true,
        ..Default::default()
    }
}

/// An error object in a 2xx body that lacks `expected` (some gateways answer errors
/// with 200): an [`Error::Http`] with the code it names, else 502.
pub(crate) fn error_in_body(body: &Value, expected: &str) -> Option<Error> {
    if body.get(expected).is_some() {
        return None;
    }
    let err = body.get("error").filter(|e| !e.is_null())?;
    let status = err
        .get("code")
        .and_then(|c| c.as_u64().or_else(|| c.as_str()?.parse().ok()))
        .filter(|c| (400..600).contains(c))
        .unwrap_or(502) as u16;
    Some(Error::Http {
        status,
        message: http::error_message(&body.to_string()),
        retry_after: None,
    })
}

/// An `f32` setting as the JSON number it was written as (0.2, not 0.20000000298…).
pub(crate) fn wire_number(x: f32) -> Value {
    x.to_string()
        .parse::<f64>()
        .ok()
        .and_then(serde_json::Number::from_f64)
        .map(Value::Number)
        .unwrap_or(Value::Null)
}

/// Rough token count of a text (4 bytes a token), for providers that report none.
pub fn estimate_tokens(text: &str) -> u64 {
    (text.len() as u64).div_ceil(4)
}

/// [`estimate_tokens`] of a JSON value's compact text (as `to_string` writes it), counted
/// as it is written rather than built: a call's arguments are counted at every turn.
pub fn estimate_json_tokens(value: &Value) -> u64 {
    struct Count(u64);
    impl std::io::Write for Count {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0 += buf.len() as u64;
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut n = Count(0);
    // Writing into a counter cannot fail, nor can a `Value` fail to serialize.
    let _ = serde_json::to_writer(&mut n, value);
    n.0.div_ceil(4)
}

#[cfg(test)]
mod tests {
    use super::{estimate_json_tokens, estimate_tokens};
    use serde_json::json;

    #[test]
    fn json_is_counted_as_its_compact_text_is() {
        // Usage recorded by the scripted model comes from this count: it must stay what
        // counting `to_string()` gave, escapes, non-ASCII text and floats included.
        for v in [
            json!(null),
            json!(""),
            json!("a \"quoted\" line\nand a tab\t and \u{1} and é and 🦀"),
            json!(0.1),
            json!(-1.5e300),
            json!(u64::MAX),
            json!({"path": ".", "deep": {"list": [1, 2.25, "x", {"k": []}]}, "": true}),
            json!([[], {}, [[[]]], "x".repeat(1001)]),
        ] {
            assert_eq!(
                estimate_json_tokens(&v),
                estimate_tokens(&v.to_string()),
                "{v}"
            );
        }
    }
}
