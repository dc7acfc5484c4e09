//! NATS connection and topology settings (`[nats]` in config).

use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

#[derive(Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct NatsConfig {
    /// Server URLs; the client fails over between them.
    pub urls: Vec<String>,
    pub user: Option<String>,
    /// Prefer `password_env`: a password here is read from the file.
    pub password: Option<String>,
    /// Environment variable holding the password.
    pub password_env: Option<String>,
    pub token: Option<String>,
    /// Environment variable holding the auth token.
    pub token_env: Option<String>,
    /// A `.creds` file (JWT + nkey seed).
    pub credentials_file: Option<PathBuf>,
    /// CA certificate to trust for TLS.
    pub tls_ca: Option<PathBuf>,
    /// Client certificate and key for mutual TLS.
    pub tls_cert: Option<PathBuf>,
    pub tls_key: Option<PathBuf>,
    pub tls_required: bool,
    /// Replicas of every stream and bucket (3 in a 3-node cluster).
    pub replicas: usize,
    /// `file` or `memory`.
    pub storage: String,
    /// How long events are kept ("0": forever).
    pub events_max_age: String,
    /// Lifetime of cache entries in the KV bucket ("0": forever; entries also carry their
    /// own expiry).
    pub cache_max_age: String,
    /// How long a single-flight claim lives if its holder vanishes.
    pub inflight_max_age: String,
    /// Window in which a repeated `Nats-Msg-Id` is dropped as a duplicate.
    pub duplicate_window: String,
}

impl Default for NatsConfig {
    fn default() -> Self {
        Self {
            urls: vec!["nats://127.0.0.1:4222".into()],
            user: None,
            password: None,
            password_env: None,
            token: None,
            token_env: None,
            credentials_file: None,
            tls_ca: None,
            tls_cert: None,
            tls_key: None,
            tls_required: false,
            replicas: 1,
            storage: "file".into(),
            events_max_age: "0".into(),
            cache_max_age: "0".into(),
            inflight_max_age: "1h".into(),
            duplicate_window: "2m".into(),
        }
    }
}

impl std::fmt::Debug for NatsConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let hidden = |o: &Option<String>| o.as_ref().map(|_| "<redacted>");
        f.debug_struct("NatsConfig")
            .field("urls", &self.urls)
            .field("user", &self.user)
            .field("password", &hidden(&self.password))
            .field("password_env", &self.password_env)
            .field("token", &hidden(&self.token))
            .field("token_env", &self.token_env)
            .field("credentials_file", &self.credentials_file)
            .field("tls_ca", &self.tls_ca)
            .field("tls_cert", &self.tls_cert)
            .field("tls_key", &self.tls_key)
            .field("tls_required", &self.tls_required)
            .field("replicas", &self.replicas)
            .field("storage", &self.storage)
            .finish_non_exhaustive()
    }
}

/// `90s`, `15m`, `2h`, `7d`, `0` (none).
pub fn duration(s: &str) -> Option<Duration> {
    skein_runtime::worker::parse_duration(s)
}
