//! Connecting: the client options from `[nats]` (credentials, TLS, reconnects).

use std::time::Duration;

use skein_ports::{Error, Result};

use super::nats_err;
use crate::config::NatsConfig;

/// Connection options with the configured credentials and TLS (never logged), the server
/// addresses, and whether any credentials were given. Callers add their retry policy.
pub async fn connect_options(
    cfg: &NatsConfig,
) -> Result<(
    async_nats::ConnectOptions,
    Vec<async_nats::ServerAddr>,
    bool,
)> {
    let mut opts = async_nats::ConnectOptions::new()
        .name("skein")
        .connection_timeout(Duration::from_secs(5));
    let env = |v: &Option<String>| v.as_ref().and_then(|n| std::env::var(n).ok());
    let mut given = false;
    let password = env(&cfg.password_env).or(cfg.password.clone());
    if let (Some(u), Some(p)) = (&cfg.user, password) {
        opts = opts.user_and_password(u.clone(), p);
        given = true;
    }
    if let Some(t) = env(&cfg.token_env).or(cfg.token.clone()) {
        opts = opts.token(t);
        given = true;
    }
    if let Some(c) = &cfg.credentials_file {
        opts = opts.credentials_file(c).await.map_err(|e| {
            Error::unavailable(format!("nats: credentials file {}", c.display()), e)
        })?;
        given = true;
    }
    if let Some(ca) = &cfg.tls_ca {
        opts = opts.add_root_certificates(ca.clone());
    }
    if let (Some(c), Some(k)) = (&cfg.tls_cert, &cfg.tls_key) {
        opts = opts.add_client_certificate(c.clone(), k.clone());
    }
    if cfg.tls_required {
        opts = opts.require_tls(true);
    }
    let urls: Vec<async_nats::ServerAddr> = cfg
        .urls
        .iter()
        .map(|u| {
            u.parse().map_err(|e| {
                Error::refused(
                    skein_ports::RefusalKind::Config,
                    format!("nats url `{}`: {e}", crate::config::redact_url(u)),
                )
            })
        })
        .collect::<Result<_>>()?;
    Ok((opts, urls, given))
}

/// Connects with the configured credentials, retrying for as long as it takes (a worker
/// may start before its server).
pub async fn connect_client(cfg: &NatsConfig) -> Result<async_nats::Client> {
    let (opts, urls, _) = connect_options(cfg).await?;
    opts.retry_on_initial_connect()
        .max_reconnects(None)
        .event_callback(crate::health::event_logger())
        .connect(urls)
        .await
        .map_err(|e| nats_err("connect", e))
}
