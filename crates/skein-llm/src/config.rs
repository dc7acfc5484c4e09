//! The `[models]` table of `skein.toml`: providers, their secrets, and the price table.
//!
//! Deserialized with `deny_unknown_fields`, so a misspelt key is an error at start-up
//! rather than a setting silently ignored. Durations are strings such as `"120s"`,
//! `"500ms"`, `"2m"`, `"1m30s"` (a bare number counts as seconds; see
//! [`skein_core::duration`]).

use std::collections::BTreeMap;
use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::{Error, Result};

/// Standard OpenAI endpoint, used by the `openai` provider unless configured otherwise.
pub const OPENAI_BASE_URL: &str = "https://api.openai.com/v1";
/// Standard Anthropic endpoint, used by the `anthropic` provider unless configured otherwise.
pub const ANTHROPIC_BASE_URL: &str = "https://api.anthropic.com";
pub const OPENAI_KEY_ENV: &str = "OPENAI_API_KEY";
pub const ANTHROPIC_KEY_ENV: &str = "ANTHROPIC_API_KEY";
/// The OpenAI SDKs' variable for another endpoint; read for the `openai` provider when
/// its `base_url` is not configured.
pub const OPENAI_BASE_URL_ENV: &str = "OPENAI_BASE_URL";
/// The Anthropic SDKs' variable for another endpoint; read for the `anthropic` provider
/// when its `base_url` is not configured.
pub const ANTHROPIC_BASE_URL_ENV: &str = "ANTHROPIC_BASE_URL";

/// `[models]`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ModelsConfig {
    /// `[models.providers.NAME]`: the part of a model name before `:`.
    pub providers: BTreeMap<String, ProviderConfig>,
    /// `[models.prices."provider:model"]` (or `"provider:*"` for every model of one
    /// provider).
    pub prices: BTreeMap<String, Price>,
    /// The provider of a model named without one (`model: gemini-flash-latest`, as agent
    /// files written for other systems name models). None: such a name is refused.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub default_provider: Option<String>,
}

/// Which wire format a provider speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ProviderKind {
    /// OpenAI-compatible chat completions (OpenAI, vLLM, Ollama, llama.cpp, LM Studio,
    /// OpenRouter, …).
    #[serde(alias = "openai-compatible")]
    OpenAi,
    /// Anthropic Messages API.
    Anthropic,
}

/// How tools reach the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ToolMode {
    /// The API's own tool-calling fields.
    #[default]
    Native,
    /// Tools described in the system prompt; the model answers with a JSON object that
    /// is parsed from its text (for servers or models without tool calling).
    Json,
}

/// `[models.providers.NAME]`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ProviderConfig {
    /// Required, except for the providers named `openai` and `anthropic`.
    pub kind: Option<ProviderKind>,
    pub base_url: Option<String>,
    /// Name of the environment variable holding the API key.
    pub api_key_env: Option<String>,
    /// A file whose content (trimmed) is the API key, e.g. a mounted secret.
    pub api_key_file: Option<PathBuf>,
    /// Extra HTTP headers sent with every request.
    pub headers: BTreeMap<String, String>,
    /// Whole-request timeout (default 120s).
    pub timeout: Option<ConfigDuration>,
    /// Connection timeout (default 10s).
    pub connect_timeout: Option<ConfigDuration>,
    /// In-process retries of 429, 5xx and connection failures (default 2).
    pub max_retries: Option<u32>,
    pub tool_mode: ToolMode,
    /// `auto` (default), `none`, `required`, or the name of one tool to force.
    pub tool_choice: Option<String>,
    /// Whether the model may ask for several tools in one answer (not sent when unset).
    pub parallel_tool_calls: Option<bool>,
    /// Used when the request sets none.
    pub temperature: Option<f32>,
    /// Used when the request sets none (Anthropic requires one: default 4096).
    pub max_tokens: Option<u32>,
    /// Ask for the answer as a stream of server-sent events, so its text shows while it
    /// arrives (default true).
    pub stream: Option<bool>,
    /// With `stream`, ask an OpenAI-compatible server for usage in the stream
    /// (`stream_options.include_usage`, default true). A server that refuses the field
    /// needs `false`; its usage is then estimated.
    pub stream_usage: Option<bool>,
    /// With `stream`, stream answers to requests that offer tools too (default true).
    /// llama-cpp-python's function-calling format cannot; skein notices an empty stream
    /// and asks for whole answers, and `false` skips that first try.
    pub stream_tools: Option<bool>,
    /// `[models.providers.NAME.limits]`: the quota of every model of this provider (each
    /// model has its own), shared by every worker of a cluster.
    pub limits: Option<Limits>,
    /// `[models.providers.NAME.model_limits."MODEL"]`: one model's quota, in place of
    /// `limits`.
    pub model_limits: BTreeMap<String, Limits>,
}

/// A model's quota, as the provider states it: how many requests and tokens a minute,
/// and how many requests at once. Unset figures are not limited (until the provider's
/// answers teach one; see docs/operations.md, "Model quotas").
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Limits {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub requests_per_minute: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub input_tokens_per_minute: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub output_tokens_per_minute: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub concurrent_requests: Option<u64>,
}

impl Limits {
    /// Whether no figure is set.
    pub fn is_empty(&self) -> bool {
        *self == Limits::default()
    }

    /// Refuses a zero figure (a quota of nothing would stop the model for ever) and
    /// absurd ones; `at` names the table in the error.
    pub fn check(&self, at: &str) -> Result<()> {
        let figures = [
            ("requests_per_minute", self.requests_per_minute),
            ("input_tokens_per_minute", self.input_tokens_per_minute),
            ("output_tokens_per_minute", self.output_tokens_per_minute),
            ("concurrent_requests", self.concurrent_requests),
        ];
        for (name, v) in figures {
            match v {
                Some(0) => {
                    return Err(Error::Config(format!(
                        "{at}: {name} must be at least 1 (leave it out for no limit)"
                    )))
                }
                Some(n) if n > MAX_LIMIT => {
                    return Err(Error::Config(format!(
                        "{at}: {name} = {n} is more than {MAX_LIMIT}; leave it out for no limit"
                    )))
                }
                _ => {}
            }
        }
        Ok(())
    }
}

/// The largest figure a quota may state.
pub const MAX_LIMIT: u64 = 1_000_000_000_000;

/// US dollars per million tokens.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Price {
    pub input_per_mtok: f64,
    pub output_per_mtok: f64,
    /// Input tokens read from the provider's prompt cache (default: `input_per_mtok`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_read_per_mtok: Option<f64>,
    /// Input tokens written to the provider's prompt cache (default: `input_per_mtok`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_write_per_mtok: Option<f64>,
}

impl Price {
    /// Dollars for `usage`: cache reads and writes at their own prices, the rest of the
    /// input at the input price.
    pub fn cost(&self, usage: &skein_core::Usage) -> f64 {
        let cached = usage
            .cache_read_tokens
            .saturating_add(usage.cache_write_tokens);
        let plain = usage.input_tokens.saturating_sub(cached);
        let read = self.cache_read_per_mtok.unwrap_or(self.input_per_mtok);
        let write = self.cache_write_per_mtok.unwrap_or(self.input_per_mtok);
        (plain as f64 * self.input_per_mtok
            + usage.cache_read_tokens as f64 * read
            + usage.cache_write_tokens as f64 * write
            + usage.output_tokens as f64 * self.output_per_mtok)
            / 1e6
    }

    /// Every price, for checks.
    pub fn all(&self) -> [f64; 4] {
        [
            self.input_per_mtok,
            self.output_per_mtok,
            self.cache_read_per_mtok.unwrap_or(0.0),
            self.cache_write_per_mtok.unwrap_or(0.0),
        ]
    }
}

/// A duration written as `"120s"`, `"500ms"`, `"2m"`, `"1h"`, `"1m30s"` or a number of
/// seconds: the grammar of [`skein_core::duration`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConfigDuration(#[serde(with = "skein_core::duration::serde")] pub Duration);

/// An API key. Its `Debug` and `Display` print `***`; only [`ApiKey::expose`] gives
/// the value, for the one header that carries it.
#[derive(Clone, PartialEq, Eq)]
pub struct ApiKey(String);

impl ApiKey {
    pub fn new(key: impl Into<String>) -> Self {
        Self(key.into())
    }

    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("***")
    }
}

impl fmt::Display for ApiKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("***")
    }
}

/// Where a provider's key comes from. Read at every call, so a rotated key file or a
/// key set after start-up is picked up, and a missing key fails the call (not the
/// start-up of a process that may never use that provider).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum KeySource {
    /// No key is sent (a local server).
    #[default]
    None,
    Env(String),
    File(PathBuf),
    /// A key given in code (tests, embedding); never read from config.
    Value(ApiKey),
    /// The variable's value when it is set, else no key: the `openai` provider pointed
    /// elsewhere by `OPENAI_BASE_URL` (a local server needs none).
    EnvIfSet(String),
}

impl KeySource {
    /// The key, or a `Config` error naming where it was looked for (never a value).
    pub fn resolve(&self, provider: &str) -> Result<Option<ApiKey>> {
        match self {
            KeySource::None => Ok(None),
            KeySource::Value(k) => Ok(Some(k.clone())),
            KeySource::EnvIfSet(var) => Ok(std::env::var(var)
                .ok()
                .filter(|v| !v.trim().is_empty())
                .map(|v| ApiKey(v.trim().to_string()))),
            KeySource::Env(var) => match std::env::var(var) {
                Ok(v) if !v.trim().is_empty() => Ok(Some(ApiKey(v.trim().to_string()))),
                _ => Err(Error::Config(format!(
                    "provider `{provider}`: no API key: environment variable {var} is not set"
                ))),
            },
            KeySource::File(path) => match std::fs::read_to_string(path) {
                Ok(v) if !v.trim().is_empty() => Ok(Some(ApiKey(v.trim().to_string()))),
                Ok(_) => Err(Error::Config(format!(
                    "provider `{provider}`: API key file {} is empty",
                    path.display()
                ))),
                Err(e) => Err(Error::Config(format!(
                    "provider `{provider}`: cannot read API key file {}: {}",
                    path.display(),
                    e.kind()
                ))),
            },
        }
    }
}

/// Timeouts and the in-process retry policy of one provider.
#[derive(Debug, Clone, PartialEq)]
pub struct HttpOptions {
    pub timeout: Duration,
    pub connect_timeout: Duration,
    /// Retries after the first attempt, for 408/429/5xx answers and connection failures.
    pub max_retries: u32,
    /// First backoff delay; doubled each retry, jittered down by up to half.
    pub backoff: Duration,
    pub max_backoff: Duration,
    /// A `Retry-After` longer than this is not waited for in process: the error goes
    /// back to the runtime, which schedules the retry durably.
    pub max_retry_after: Duration,
}

impl Default for HttpOptions {
    fn default() -> Self {
        Self {
            timeout: Duration::from_secs(120),
            connect_timeout: Duration::from_secs(10),
            max_retries: 2,
            backoff: Duration::from_millis(500),
            max_backoff: Duration::from_secs(8),
            max_retry_after: Duration::from_secs(20),
        }
    }
}

/// One provider's configuration with every default filled in.
#[derive(Debug, Clone, PartialEq)]
pub struct ProviderSettings {
    pub name: String,
    pub kind: ProviderKind,
    /// Without a trailing `/`.
    pub base_url: String,
    pub key: KeySource,
    pub headers: BTreeMap<String, String>,
    pub http: HttpOptions,
    pub tool_mode: ToolMode,
    pub tool_choice: String,
    pub parallel_tool_calls: Option<bool>,
    pub temperature: Option<f32>,
    pub max_tokens: Option<u32>,
    pub stream: bool,
    pub stream_usage: bool,
    pub stream_tools: bool,
    /// The quota of every model of this provider without one of its own.
    pub limits: Limits,
    /// Models' own quotas, by model name.
    pub model_limits: BTreeMap<String, Limits>,
}

impl ProviderSettings {
    /// The API key as it reads now, when there is one (for scrubbing, never for display).
    pub fn current_key(&self) -> Option<String> {
        self.key
            .resolve(&self.name)
            .ok()
            .flatten()
            .map(|k| k.expose().to_string())
    }

    /// Settings with defaults and no key.
    pub fn new(name: impl Into<String>, kind: ProviderKind, base_url: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            kind,
            base_url: base_url.into().trim_end_matches('/').to_string(),
            key: KeySource::None,
            headers: BTreeMap::new(),
            http: HttpOptions::default(),
            tool_mode: ToolMode::Native,
            tool_choice: "auto".into(),
            parallel_tool_calls: None,
            temperature: None,
            max_tokens: None,
            stream: true,
            stream_usage: true,
            stream_tools: true,
            limits: Limits::default(),
            model_limits: BTreeMap::new(),
        }
    }

    /// The quota of `model` (the part after `provider:`): its own, else the provider's.
    pub fn limits_of(&self, model: &str) -> Limits {
        self.model_limits.get(model).copied().unwrap_or(self.limits)
    }

    /// Fills in the defaults: the `openai` and `anthropic` providers know their kind,
    /// URL and key variable; any `anthropic`-kind provider reads `ANTHROPIC_API_KEY`
    /// unless told otherwise; another `openai`-kind provider sends no key unless given
    /// one (a local server). `OPENAI_BASE_URL` and `ANTHROPIC_BASE_URL` are read from
    /// the environment.
    pub fn from_config(name: &str, cfg: &ProviderConfig) -> Result<Self> {
        Self::from_config_with(name, cfg, &|var| std::env::var(var).ok())
    }

    /// [`ProviderSettings::from_config`] with the environment given by `env`.
    pub fn from_config_with(
        name: &str,
        cfg: &ProviderConfig,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<Self> {
        let kind = match (cfg.kind, name) {
            (Some(k), _) => k,
            (None, "openai") => ProviderKind::OpenAi,
            (None, "anthropic") => ProviderKind::Anthropic,
            (None, _) => {
                return Err(Error::Config(format!(
                    "[models.providers.{name}]: `kind` is required (\"openai\" or \"anthropic\")"
                )))
            }
        };
        let from_env = |var: &str| env(var).filter(|v| !v.trim().is_empty());
        let env_url = match (name, kind) {
            ("openai", ProviderKind::OpenAi) => from_env(OPENAI_BASE_URL_ENV),
            ("anthropic", ProviderKind::Anthropic) => from_env(ANTHROPIC_BASE_URL_ENV),
            _ => None,
        };
        let base_url = match (&cfg.base_url, kind) {
            (Some(u), _) => u.clone(),
            (None, _) if env_url.is_some() => env_url.clone().unwrap_or_default(),
            (None, ProviderKind::OpenAi) if name == "openai" => OPENAI_BASE_URL.into(),
            (None, ProviderKind::Anthropic) => ANTHROPIC_BASE_URL.into(),
            (None, ProviderKind::OpenAi) => {
                return Err(Error::Config(format!(
                    "[models.providers.{name}]: `base_url` is required"
                )))
            }
        };
        let base_url = base_url.trim().to_string();
        if !(base_url.starts_with("http://") || base_url.starts_with("https://")) {
            let from = match (&cfg.base_url, name) {
                (None, "openai") => OPENAI_BASE_URL_ENV.to_string(),
                (None, "anthropic") => ANTHROPIC_BASE_URL_ENV.to_string(),
                _ => format!("[models.providers.{name}]: base_url"),
            };
            return Err(Error::Config(format!(
                "{from} `{base_url}` is not an http(s) URL"
            )));
        }
        let key = match (&cfg.api_key_env, &cfg.api_key_file) {
            (Some(_), Some(_)) => {
                return Err(Error::Config(format!(
                    "[models.providers.{name}]: set api_key_env or api_key_file, not both"
                )))
            }
            (Some(v), None) => KeySource::Env(v.clone()),
            (None, Some(f)) => KeySource::File(f.clone()),
            (None, None) => match kind {
                ProviderKind::Anthropic => KeySource::Env(ANTHROPIC_KEY_ENV.into()),
                // Pointed elsewhere by OPENAI_BASE_URL: the key only if one is set.
                ProviderKind::OpenAi
                    if name == "openai" && env_url.is_some() && cfg.base_url.is_none() =>
                {
                    KeySource::EnvIfSet(OPENAI_KEY_ENV.into())
                }
                ProviderKind::OpenAi if name == "openai" => KeySource::Env(OPENAI_KEY_ENV.into()),
                ProviderKind::OpenAi => KeySource::None,
            },
        };
        let mut http = HttpOptions::default();
        if let Some(t) = cfg.timeout {
            http.timeout = t.0;
        }
        if let Some(t) = cfg.connect_timeout {
            http.connect_timeout = t.0;
        }
        if let Some(n) = cfg.max_retries {
            http.max_retries = n;
        }
        let mut s = Self::new(name, kind, base_url);
        s.key = key;
        s.headers = cfg.headers.clone();
        s.http = http;
        s.tool_mode = cfg.tool_mode;
        if let Some(c) = &cfg.tool_choice {
            if c.trim().is_empty() {
                return Err(Error::Config(format!(
                    "[models.providers.{name}]: tool_choice is empty"
                )));
            }
            s.tool_choice = c.trim().to_string();
        }
        s.parallel_tool_calls = cfg.parallel_tool_calls;
        s.temperature = cfg.temperature;
        s.max_tokens = cfg.max_tokens;
        s.stream = cfg.stream.unwrap_or(true);
        s.stream_usage = cfg.stream_usage.unwrap_or(true);
        s.stream_tools = cfg.stream_tools.unwrap_or(true);
        if let Some(l) = cfg.limits {
            l.check(&format!("[models.providers.{name}.limits]"))?;
            s.limits = l;
        }
        for (model, l) in &cfg.model_limits {
            if model.trim().is_empty() {
                return Err(Error::Config(format!(
                    "[models.providers.{name}.model_limits]: a model name is empty"
                )));
            }
            l.check(&format!(
                "[models.providers.{name}.model_limits.\"{model}\"]"
            ))?;
        }
        s.model_limits = cfg.model_limits.clone();
        Ok(s)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    #[test]
    fn api_key_never_prints() {
        let k = ApiKey::new("test-key-not-secret");
        assert_eq!(format!("{k:?}"), "***");
        assert_eq!(format!("{k}"), "***");
        let s = KeySource::Value(k);
        assert!(!format!("{s:?}").contains("test-key-not-secret"));
    }

    #[test]
    fn defaults_by_name_and_kind() {
        let o = ProviderSettings::from_config("openai", &ProviderConfig::default()).unwrap();
        assert_eq!(o.kind, ProviderKind::OpenAi);
        assert_eq!(o.base_url, OPENAI_BASE_URL);
        assert_eq!(o.key, KeySource::Env(OPENAI_KEY_ENV.into()));
        assert_eq!(o.tool_choice, "auto");
        assert_eq!(o.http.max_retries, 2);

        let a = ProviderSettings::from_config("anthropic", &ProviderConfig::default()).unwrap();
        assert_eq!(a.kind, ProviderKind::Anthropic);
        assert_eq!(a.key, KeySource::Env(ANTHROPIC_KEY_ENV.into()));

        let local = ProviderConfig {
            kind: Some(ProviderKind::OpenAi),
            base_url: Some("http://localhost:11434/v1/".into()),
            ..Default::default()
        };
        let l = ProviderSettings::from_config("local", &local).unwrap();
        assert_eq!(l.key, KeySource::None);
        assert_eq!(l.base_url, "http://localhost:11434/v1");

        let e = ProviderSettings::from_config("x", &ProviderConfig::default()).unwrap_err();
        assert!(e.to_string().contains("`kind` is required"), "{e}");
        let no_url = ProviderConfig {
            kind: Some(ProviderKind::OpenAi),
            ..Default::default()
        };
        let e = ProviderSettings::from_config("x", &no_url).unwrap_err();
        assert!(e.to_string().contains("base_url"), "{e}");
    }

    #[test]
    fn base_urls_from_the_sdk_variables() {
        let env = |var: &str| match var {
            OPENAI_BASE_URL_ENV => Some("http://127.0.0.1:8080/v1/".to_string()),
            ANTHROPIC_BASE_URL_ENV => Some("https://gateway.example/anthropic".to_string()),
            _ => None,
        };
        let none = ProviderConfig::default();
        let o = ProviderSettings::from_config_with("openai", &none, &env).unwrap();
        assert_eq!(o.base_url, "http://127.0.0.1:8080/v1");
        // A local server needs no key; one set is still sent.
        assert_eq!(o.key, KeySource::EnvIfSet(OPENAI_KEY_ENV.into()));
        let a = ProviderSettings::from_config_with("anthropic", &none, &env).unwrap();
        assert_eq!(a.base_url, "https://gateway.example/anthropic");
        assert_eq!(a.key, KeySource::Env(ANTHROPIC_KEY_ENV.into()));
        // Configuration wins over the environment; other providers ignore it.
        let configured = ProviderConfig {
            base_url: Some("https://api.example/v1".into()),
            ..Default::default()
        };
        let o = ProviderSettings::from_config_with("openai", &configured, &env).unwrap();
        assert_eq!(o.base_url, "https://api.example/v1");
        assert_eq!(o.key, KeySource::Env(OPENAI_KEY_ENV.into()));
        let local = ProviderConfig {
            kind: Some(ProviderKind::OpenAi),
            ..Default::default()
        };
        let e = ProviderSettings::from_config_with("local", &local, &env).unwrap_err();
        assert!(e.to_string().contains("base_url"), "{e}");
        // A variable that is not a URL is named.
        let bad = |_: &str| Some("localhost:8080".to_string());
        let e = ProviderSettings::from_config_with("openai", &none, &bad).unwrap_err();
        assert!(e.to_string().contains(OPENAI_BASE_URL_ENV), "{e}");
        // Unset or empty: the defaults.
        let empty = |_: &str| Some(" ".to_string());
        let o = ProviderSettings::from_config_with("openai", &none, &empty).unwrap();
        assert_eq!(o.base_url, OPENAI_BASE_URL);
        assert!(o.stream && o.stream_usage);
    }

    #[test]
    fn missing_key_names_its_source_only() {
        let e = KeySource::Env("SKEIN_LLM_TEST_SURELY_UNSET".into())
            .resolve("p")
            .unwrap_err();
        assert!(matches!(e, Error::Config(_)));
        assert!(e.to_string().contains("SKEIN_LLM_TEST_SURELY_UNSET"), "{e}");
        assert!(!e.is_retryable());

        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("key");
        std::fs::write(&f, "  test-key-not-secret\n").unwrap();
        let k = KeySource::File(f.clone()).resolve("p").unwrap().unwrap();
        assert_eq!(k.expose(), "test-key-not-secret");
        let e = KeySource::File(dir.path().join("absent"))
            .resolve("p")
            .unwrap_err();
        assert!(e.to_string().contains("absent"), "{e}");
    }

    #[test]
    fn limits_are_read_and_checked() {
        let cfg: ModelsConfig = toml::from_str(
            r#"
            [providers.openai.limits]
            requests_per_minute = 500
            input_tokens_per_minute = 200000
            [providers.openai.model_limits."gpt-4o"]
            requests_per_minute = 60
            concurrent_requests = 4
            "#,
        )
        .unwrap();
        let s = ProviderSettings::from_config("openai", &cfg.providers["openai"]).unwrap();
        assert_eq!(s.limits_of("gpt-4o-mini").requests_per_minute, Some(500));
        assert_eq!(
            s.limits_of("gpt-4o-mini").input_tokens_per_minute,
            Some(200_000)
        );
        let own = s.limits_of("gpt-4o");
        assert_eq!(own.requests_per_minute, Some(60));
        assert_eq!(own.concurrent_requests, Some(4));
        assert_eq!(
            own.input_tokens_per_minute, None,
            "a model's own table replaces"
        );

        let zero: ModelsConfig =
            toml::from_str("[providers.openai.limits]\nrequests_per_minute = 0").unwrap();
        let e = ProviderSettings::from_config("openai", &zero.providers["openai"]).unwrap_err();
        assert!(
            e.to_string()
                .contains("requests_per_minute must be at least 1"),
            "{e}"
        );
        assert!(
            e.to_string().contains("[models.providers.openai.limits]"),
            "{e}"
        );
        let typo = toml::from_str::<ModelsConfig>("[providers.openai.limits]\nrpm = 5");
        assert!(typo.unwrap_err().to_string().contains("rpm"));
        let negative =
            toml::from_str::<ModelsConfig>("[providers.openai.limits]\nrequests_per_minute = -5");
        assert!(negative.is_err());
        let huge: ModelsConfig = toml::from_str(
            "[providers.openai.model_limits.\"m\"]\nconcurrent_requests = 10000000000000",
        )
        .unwrap();
        let e = ProviderSettings::from_config("openai", &huge.providers["openai"]).unwrap_err();
        assert!(e.to_string().contains("model_limits.\"m\""), "{e}");
    }

    #[test]
    fn price_cost() {
        let mut p = Price {
            input_per_mtok: 0.15,
            output_per_mtok: 0.60,
            ..Default::default()
        };
        let mut u = skein_core::Usage {
            input_tokens: 1_000_000,
            output_tokens: 500_000,
            ..Default::default()
        };
        let c = p.cost(&u);
        assert!((c - 0.45).abs() < 1e-12, "{c}");
        // Half the input read from the cache at a tenth of the price, a tenth written.
        u.cache_read_tokens = 500_000;
        u.cache_write_tokens = 100_000;
        assert!(
            (p.cost(&u) - 0.45).abs() < 1e-12,
            "unpriced cache tokens cost as input"
        );
        p.cache_read_per_mtok = Some(0.015);
        p.cache_write_per_mtok = Some(0.1875);
        let want = 0.4 * 0.15 + 0.5 * 0.015 + 0.1 * 0.1875 + 0.5 * 0.60;
        assert!((p.cost(&u) - want).abs() < 1e-12, "{}", p.cost(&u));
    }
}
