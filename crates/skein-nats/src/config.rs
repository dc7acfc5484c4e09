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
    /// Where JetStream keeps the streams and buckets skein creates.
    pub storage: StorageType,
    /// How long events are kept ("0": forever).
    #[serde(deserialize_with = "skein_core::duration::serde::text")]
    pub events_max_age: String,
    /// Lifetime of cache entries in the KV bucket ("0": forever; entries also carry their
    /// own expiry).
    #[serde(deserialize_with = "skein_core::duration::serde::text")]
    pub cache_max_age: String,
    /// How long a single-flight claim lives if its holder vanishes.
    #[serde(deserialize_with = "skein_core::duration::serde::text")]
    pub inflight_max_age: String,
    /// Window in which a repeated `Nats-Msg-Id` is dropped as a duplicate.
    #[serde(deserialize_with = "skein_core::duration::serde::text")]
    pub duplicate_window: String,
    /// Retention run by the workers: remove the finished trees whose last event is older
    /// than this ("0": keep every tree). A tree in flight or waiting for a person is never
    /// removed.
    #[serde(deserialize_with = "skein_core::duration::serde::text")]
    pub retain_finished: String,
    /// Archive each tree (its audit export) in the object store `skein_archive` before it
    /// is removed.
    pub archive_finished: bool,
    /// How often a worker looks for trees to remove.
    #[serde(deserialize_with = "skein_core::duration::serde::text")]
    pub retention_every: String,
    /// Tree workspaces as directories `<workspace_dir>/<root>` on a volume every worker
    /// mounts (and `shell` can run in), instead of the object store `skein_workspace`.
    pub workspace_dir: Option<PathBuf>,
    /// Appends to the event log made together go to the server as one atomic batch, which
    /// nats-server 2.15.1 and later writes with one sync where every write is synced
    /// (`sync_interval: always`). For servers that sync every write: with the default
    /// sync a batch costs the server more than the messages it holds. Used where the
    /// stream allows it (a single replica, servers 2.15.1 and later). Off (the default):
    /// each append is its own publish.
    pub group_commit: bool,
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
            storage: StorageType::File,
            events_max_age: "0".into(),
            cache_max_age: "0".into(),
            inflight_max_age: "1h".into(),
            duplicate_window: "2m".into(),
            retain_finished: "0".into(),
            archive_finished: true,
            retention_every: "1h".into(),
            workspace_dir: None,
            group_commit: false,
        }
    }
}

/// Where JetStream keeps a stream or bucket: `"file"` or `"memory"` in the config; any
/// other value is refused when the config is read.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum StorageType {
    /// On disk (the default).
    #[default]
    File,
    /// In the server's memory: lost when the server stops.
    Memory,
}

impl std::fmt::Debug for NatsConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let hidden = |o: &Option<String>| o.as_ref().map(|_| "<redacted>");
        let urls: Vec<String> = self.urls.iter().map(|u| redact_url(u)).collect();
        f.debug_struct("NatsConfig")
            .field("urls", &urls)
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
            .field("workspace_dir", &self.workspace_dir)
            .finish_non_exhaustive()
    }
}

impl NatsConfig {
    /// Every secret value this configuration uses: the password and token (read from their
    /// environment variables where named) and what URLs carry before `@`. For scrubbing
    /// output; never for display.
    pub fn secrets(&self) -> Vec<String> {
        let env = |v: &Option<String>| v.as_ref().and_then(|n| std::env::var(n).ok());
        let mut out: Vec<String> = [
            self.password.clone(),
            env(&self.password_env),
            self.token.clone(),
            env(&self.token_env),
        ]
        .into_iter()
        .flatten()
        .collect();
        out.extend(self.urls.iter().filter_map(|u| url_secret(u)));
        out.retain(|s| !s.is_empty());
        out
    }

    /// Moves credentials written into the URLs (`nats://user:pass@host`, `nats://token@host`)
    /// to the fields the connection uses, and strips them from the URLs, so they are never
    /// logged with an address. Fields already set win over URL credentials; the first URL
    /// that carries any is used.
    pub fn take_url_credentials(&mut self) {
        let mut found = None;
        for u in &mut self.urls {
            let Some((a, b)) = userinfo(u) else { continue };
            if found.is_none() {
                found = Some(u[a..b].to_string());
            }
            *u = format!("{}{}", &u[..a], &u[b + 1..]);
        }
        let Some(info) = found else { return };
        let has_login = self.user.is_some() || self.token.is_some() || self.token_env.is_some();
        if has_login || self.credentials_file.is_some() {
            return;
        }
        match info.split_once(':') {
            Some((user, pass)) => {
                self.user = Some(percent_decoded(user));
                if self.password.is_none() && self.password_env.is_none() {
                    self.password = Some(percent_decoded(pass));
                }
            }
            None => self.token = Some(percent_decoded(&info)),
        }
    }

    /// The server list for messages and logs, secrets redacted.
    pub fn shown_urls(&self) -> String {
        self.urls
            .iter()
            .map(|u| redact_url(u))
            .collect::<Vec<_>>()
            .join(",")
    }
}

/// Where the user information of a URL lies: the byte range between `://` (or the start)
/// and the `@` that ends it, if any.
fn userinfo(url: &str) -> Option<(usize, usize)> {
    let start = url.find("://").map(|i| i + 3).unwrap_or(0);
    let rest = &url[start..];
    let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let at = rest[..end].rfind('@')?;
    Some((start, start + at))
}

/// The secret part of a URL's user information: the password of `user:pass@`, or the
/// whole of `token@` (a NATS URL with a user and no password carries a token).
fn url_secret(url: &str) -> Option<String> {
    let (a, b) = userinfo(url)?;
    let info = &url[a..b];
    Some(match info.split_once(':') {
        Some((_, pass)) => pass.to_string(),
        None => info.to_string(),
    })
}

/// `%XX` escapes of URL user information decoded (a `%` not followed by two hex digits is
/// kept as it is; bytes that are not UTF-8 become U+FFFD).
fn percent_decoded(s: &str) -> String {
    percent_encoding::percent_decode_str(s)
        .decode_utf8_lossy()
        .into_owned()
}

/// A URL fit to print: `nats://user:pass@host` becomes `nats://user:***@host`, and
/// `nats://token@host` becomes `nats://***@host`. Anything else is returned unchanged.
pub fn redact_url(url: &str) -> String {
    let Some((a, b)) = userinfo(url) else {
        return url.to_string();
    };
    let shown = match url[a..b].split_once(':') {
        Some((user, _)) => format!("{user}:***"),
        None => "***".to_string(),
    };
    format!("{}{shown}{}", &url[..a], &url[b..])
}

/// `90s`, `15m`, `2h`, `1h30m`, `7d`, `0` (none): see [`skein_core::duration`].
pub fn duration(s: &str) -> Option<Duration> {
    skein_core::duration::parse(s).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_shown_without_their_secrets() {
        assert_eq!(
            redact_url("nats://alice:hunter2@db.example:4222"),
            "nats://alice:***@db.example:4222"
        );
        assert_eq!(
            redact_url("tls://s3cret-token@10.0.0.1"),
            "tls://***@10.0.0.1"
        );
        assert_eq!(redact_url("bob:pw@host:4222"), "bob:***@host:4222");
        assert_eq!(
            redact_url("nats://127.0.0.1:4222/a@b"),
            "nats://127.0.0.1:4222/a@b"
        );
        assert_eq!(redact_url("nats://127.0.0.1:4222"), "nats://127.0.0.1:4222");
    }

    #[test]
    fn escapes_in_url_credentials() {
        assert_eq!(percent_decoded("p%40ss%3A%2f"), "p@ss:/");
        assert_eq!(percent_decoded("100%"), "100%");
        assert_eq!(percent_decoded("a%4"), "a%4");
        assert_eq!(percent_decoded("%zz%41"), "%zzA");
        assert_eq!(percent_decoded("%C3%A9"), "é");
        assert_eq!(percent_decoded("%ff"), "\u{fffd}");
    }

    #[test]
    fn storage_is_file_or_memory_and_nothing_else() {
        let read = |v: serde_json::Value| serde_json::from_value::<NatsConfig>(v);
        assert_eq!(NatsConfig::default().storage, StorageType::File);
        let c = read(serde_json::json!({"storage": "memory"})).unwrap();
        assert_eq!(c.storage, StorageType::Memory);
        let c = read(serde_json::json!({"storage": "file"})).unwrap();
        assert_eq!(c.storage, StorageType::File);
        for bad in ["disk", "Memory", ""] {
            let e = read(serde_json::json!({ "storage": bad })).unwrap_err();
            assert!(
                e.to_string().contains(&format!(
                    "unknown variant `{bad}`, expected `file` or `memory`"
                )),
                "{e}"
            );
        }
    }

    #[test]
    fn url_credentials_move_to_the_login_fields() {
        let mut c = NatsConfig {
            urls: vec![
                "nats://alice:p%40ss@h1:4222".into(),
                "nats://h2:4222".into(),
                "nats://bob:other@h3".into(),
            ],
            ..NatsConfig::default()
        };
        c.take_url_credentials();
        assert_eq!(c.urls, ["nats://h1:4222", "nats://h2:4222", "nats://h3"]);
        assert_eq!(c.user.as_deref(), Some("alice"));
        assert_eq!(c.password.as_deref(), Some("p@ss"));

        let mut c = NatsConfig {
            urls: vec!["tok%zz@h1".into()],
            ..NatsConfig::default()
        };
        c.take_url_credentials();
        assert_eq!(
            (c.urls[0].as_str(), c.token.as_deref()),
            ("h1", Some("tok%zz"))
        );

        let mut c = NatsConfig {
            urls: vec!["nats://alice:url@h1".into()],
            user: Some("carol".into()),
            password_env: Some("CAROL_PW".into()),
            ..NatsConfig::default()
        };
        c.take_url_credentials();
        assert_eq!(c.urls, ["nats://h1"]);
        assert_eq!(c.user.as_deref(), Some("carol"));
        assert_eq!(c.password, None);
    }

    #[test]
    fn debug_and_secrets_cover_urls_passwords_and_tokens() {
        let cfg = NatsConfig {
            urls: vec![
                "nats://alice:hunter2@h1:4222".into(),
                "nats://tok-in-url@h2:4222".into(),
            ],
            user: Some("alice".into()),
            password: Some("pw-in-config".into()),
            token: Some("token-in-config".into()),
            ..NatsConfig::default()
        };
        let shown = format!("{cfg:?} {}", cfg.shown_urls());
        for s in ["hunter2", "tok-in-url", "pw-in-config", "token-in-config"] {
            assert!(!shown.contains(s), "{s} shown: {shown}");
            assert!(cfg.secrets().iter().any(|x| x == s), "{s} not listed");
        }
        assert!(shown.contains("nats://alice:***@h1:4222"), "{shown}");
    }
}
