//! skein-llm: the `Model` trait and its providers.
//!
//! A model name is `provider:model` (`scripted:orchestrator`, `openai:gpt-4o-mini`,
//! `anthropic:claude-…`, or a provider named in config such as `local:qwen`). The
//! [`Registry`] routes a request to its provider. Providers never see session state: a
//! request in, an answer and its usage out. This crate never depends on the runtime.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use skein_core::{ModelRequest, ModelResponse, Usage};

pub mod scripted;

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
    #[error("model `{model}` is not of the form `provider:model`")]
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

/// Providers by name.
#[derive(Clone, Default)]
pub struct Registry {
    providers: BTreeMap<String, Arc<dyn Provider>>,
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

    pub async fn complete(&self, req: &ModelRequest) -> Result<Completion> {
        let (provider, model) = split_model(&req.model)?;
        let p = self
            .providers
            .get(provider)
            .ok_or_else(|| Error::UnknownProvider {
                provider: provider.to_string(),
                model: req.model.clone(),
                known: self.names().join(", "),
            })?;
        p.complete(model, req).await
    }
}

/// Rough token count of a text (4 bytes a token), for providers that report none.
pub fn estimate_tokens(text: &str) -> u64 {
    (text.len() as u64).div_ceil(4)
}
