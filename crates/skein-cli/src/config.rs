//! Layered configuration: built-in defaults → the config file → `SKEIN__SECTION__KEY`
//! environment variables → command-line flags. Paths in the file are relative to the
//! file's directory.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use figment::providers::{Env, Format, Serialized, Toml};
use figment::Figment;
use serde::{Deserialize, Serialize};
use skein_core::Limits;

/// The first batch of a wide turn's delegations on the embedded store: there a batch
/// costs one `fdatasync`, and its children run on the cores the rest of the turn leaves
/// idle (`docs/perf.md`).
pub const EMBEDDED_DELEGATION_BATCH: usize = 16;

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RuntimeSection {
    /// Jobs one process works on at once.
    pub concurrency: usize,
    /// How long a claimed job is held without a heartbeat.
    pub lease: String,
    /// Deliveries of a job before its session is failed as dead-lettered.
    pub max_deliver: u32,
    /// Tool outputs longer than this (bytes) go to the blob store.
    pub blob_threshold: usize,
    /// Folded session states a worker keeps in memory.
    pub state_cache: usize,
    /// The first batch of a wide turn's delegations (each next one twice as large, up to
    /// 128), so the first children start while the rest are made; 0 records a turn's
    /// delegations in one batch. Default: [`EMBEDDED_DELEGATION_BATCH`] on the embedded
    /// store, 0 on NATS.
    pub delegation_batch: Option<usize>,
    /// Name recorded in the log for this worker (default: host-pid).
    pub worker_id: Option<String>,
    /// Pools a worker takes jobs from (default: every pool the agents name).
    pub pools: Vec<String>,
}

impl RuntimeSection {
    /// `delegation_batch` as set, else its default for the backend.
    pub fn delegation_batch_on(&self, nats: bool) -> usize {
        self.delegation_batch
            .unwrap_or(if nats { 0 } else { EMBEDDED_DELEGATION_BATCH })
    }
}

impl Default for RuntimeSection {
    fn default() -> Self {
        Self {
            concurrency: 64,
            lease: "30s".into(),
            max_deliver: 5,
            blob_threshold: 64 * 1024,
            state_cache: 10_000,
            delegation_batch: None,
            worker_id: None,
            pools: vec![],
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CacheSection {
    /// Default lifetime of a cached sub-agent answer ("0" keeps entries forever).
    pub ttl: String,
}

impl Default for CacheSection {
    fn default() -> Self {
        Self { ttl: "24h".into() }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SkeinConfig {
    /// Directory of agent definitions (`*.md`).
    pub agents_dir: PathBuf,
    /// Directory of scripts for the `scripted` model.
    pub scripts_dir: PathBuf,
    /// Where embedded trees keep their workspaces (default: `<data>/workspaces`).
    pub workspace_dir: Option<PathBuf>,
    pub runtime: RuntimeSection,
    pub limits: Limits,
    pub cache: CacheSection,
    /// Model providers and prices (see docs/providers.md).
    pub models: toml::Table,
    /// Built-in tool settings (see docs/tools.md).
    pub tools: toml::Table,
    /// NATS connection and topology (see docs/nats.md).
    pub nats: toml::Table,
    /// MCP servers whose tools agents may use (`[mcp.servers.NAME]`, see docs/mcp.md).
    pub mcp: toml::Table,
    /// The agents are the binary's built-in demo, not `agents_dir` (see [`crate::builtin`]).
    #[serde(skip)]
    pub builtin_agents: bool,
    /// The scripts are the binary's built-in demo, not `scripts_dir`.
    #[serde(skip)]
    pub builtin_scripts: bool,
}

impl Default for SkeinConfig {
    fn default() -> Self {
        Self {
            agents_dir: "config/agents".into(),
            scripts_dir: "config/scripts".into(),
            workspace_dir: None,
            runtime: RuntimeSection::default(),
            limits: Limits::default(),
            cache: CacheSection::default(),
            models: toml::Table::new(),
            tools: toml::Table::new(),
            nats: toml::Table::new(),
            mcp: toml::Table::new(),
            builtin_agents: false,
            builtin_scripts: false,
        }
    }
}

/// Where the configuration comes from (see [`crate::builtin`] for the order).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// A file: named by `--config`, or `config/skein.toml` under the current directory.
    File(PathBuf),
    /// No file, with `config/agents` and `config/scripts` under the current directory.
    Defaults,
    /// The binary's built-in demo.
    BuiltIn,
}

impl Source {
    /// `explicit` (`--config`), else `config/skein.toml`, else `config/agents` with the
    /// defaults, else the built-in demo, all under the current directory.
    pub fn locate(explicit: Option<PathBuf>) -> Self {
        if let Some(f) = explicit {
            return Self::File(f);
        }
        let p = PathBuf::from("config/skein.toml");
        if p.exists() {
            Self::File(p)
        } else if Path::new("config/agents").is_dir() {
            Self::Defaults
        } else {
            Self::BuiltIn
        }
    }
}

/// The configuration of `file`, or of the defaults when `None` (see [`load_from`]).
pub fn load(file: Option<&Path>) -> Result<SkeinConfig> {
    match file {
        Some(f) => load_from(&Source::File(f.to_path_buf())),
        None => load_from(&Source::Defaults),
    }
}

pub fn load_from(source: &Source) -> Result<SkeinConfig> {
    let mut fig = Figment::from(Serialized::defaults(SkeinConfig::default()));
    let file = match source {
        Source::File(f) => Some(f.as_path()),
        _ => None,
    };
    let base = match source {
        Source::File(f) => {
            if !f.exists() {
                anyhow::bail!("config file {} does not exist", f.display());
            }
            fig = fig.merge(Toml::file(f));
            f.parent().map(Path::to_path_buf).unwrap_or_default()
        }
        Source::Defaults => PathBuf::new(),
        Source::BuiltIn => {
            fig = fig.merge(Toml::string(crate::builtin::CONFIG));
            PathBuf::new()
        }
    };
    fig = fig.merge(Env::prefixed("SKEIN__").split("__"));
    let mut cfg: SkeinConfig = fig.extract().context("configuration")?;
    if *source == Source::BuiltIn {
        let from_env = |key: &str| {
            fig.find_metadata(key)
                .is_some_and(|m| m.name.contains("environment"))
        };
        cfg.builtin_agents = !from_env("agents_dir");
        cfg.builtin_scripts = !from_env("scripts_dir");
        if cfg.builtin_agents {
            cfg.agents_dir = PathBuf::from(format!("{}/agents", crate::builtin::ORIGIN));
        }
        if cfg.builtin_scripts {
            cfg.scripts_dir = PathBuf::from(format!("{}/scripts", crate::builtin::ORIGIN));
        }
    }
    let file_set = |key: &str| {
        file.is_some()
            && fig
                .find_metadata(key)
                .is_some_and(|m| matches!(m.source, Some(figment::Source::File(_))))
    };
    if file_set("agents_dir") && cfg.agents_dir.is_relative() {
        cfg.agents_dir = base.join(&cfg.agents_dir);
    }
    if file_set("scripts_dir") && cfg.scripts_dir.is_relative() {
        cfg.scripts_dir = base.join(&cfg.scripts_dir);
    }
    if let Some(w) = &cfg.workspace_dir {
        if file_set("workspace_dir") && w.is_relative() {
            cfg.workspace_dir = Some(base.join(w));
        }
    }
    for pool in &cfg.runtime.pools {
        skein_core::agent::validate_pool(pool)
            .map_err(|e| anyhow::anyhow!("runtime.pools: {e}"))?;
    }
    check(&cfg)?;
    Ok(cfg)
}

/// What later reads the configuration would refuse, refused at load: every duration (the
/// error names its key and value) and the `[tools]`, `[models]` and `[nats]` tables.
fn check(cfg: &SkeinConfig) -> Result<()> {
    for (key, text) in [
        ("runtime.lease", &cfg.runtime.lease),
        ("cache.ttl", &cfg.cache.ttl),
    ] {
        skein_core::duration::parse_key(key, text).map_err(anyhow::Error::msg)?;
    }
    let _: skein_tools::ToolsConfig = cfg.tools.clone().try_into().context("[tools]")?;
    let _: skein_llm::ModelsConfig = cfg.models.clone().try_into().context("[models]")?;
    let _: skein_nats::NatsConfig = cfg.nats.clone().try_into().context("[nats]")?;
    let mcp: skein_mcp::McpConfig = cfg.mcp.clone().try_into().context("[mcp]")?;
    for (name, server) in &mcp.servers {
        server.check(name).map_err(anyhow::Error::msg)?;
    }
    Ok(())
}

/// Puts the connection flags (`--nats`, `--nats-user`, …) over the `[nats]` table: flags
/// win over the file and `SKEIN__NATS__*`. A password or token given as a flag also wins
/// over a `password_env` / `token_env` of the file.
pub fn apply_nats_flags(t: &mut toml::Table, g: &crate::GlobalArgs) {
    let path = |p: &Path| toml::Value::String(p.display().to_string());
    if let Some(urls) = g.nats_urls() {
        t.insert(
            "urls".into(),
            toml::Value::Array(urls.into_iter().map(toml::Value::String).collect()),
        );
    }
    if let Some(u) = &g.nats_user {
        t.insert("user".into(), u.clone().into());
    }
    if let Some(p) = &g.nats_password {
        t.insert("password".into(), p.clone().into());
        t.remove("password_env");
    }
    if let Some(tok) = &g.nats_token {
        t.insert("token".into(), tok.clone().into());
        t.remove("token_env");
    }
    for (key, v) in [
        ("credentials_file", &g.nats_credentials_file),
        ("tls_ca", &g.nats_tls_ca),
        ("tls_cert", &g.nats_tls_cert),
        ("tls_key", &g.nats_tls_key),
    ] {
        if let Some(p) = v {
            t.insert(key.into(), path(p));
        }
    }
    if g.nats_tls_required {
        t.insert("tls_required".into(), true.into());
    }
}

/// Secret values known to this process (passwords, tokens, URL user info): diagnostics
/// and error messages are scrubbed of them before they are written.
static SECRETS: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());

/// Every secret value registered so far (see [`register_secrets`]).
pub fn known_secrets() -> Vec<String> {
    SECRETS.lock().unwrap_or_else(|p| p.into_inner()).clone()
}

pub fn register_secrets(secrets: impl IntoIterator<Item = String>) {
    let mut known = SECRETS.lock().unwrap_or_else(|p| p.into_inner());
    for s in secrets {
        if !s.is_empty() && !known.contains(&s) {
            known.push(s);
        }
    }
    // Longest first, so a secret that contains another is replaced whole.
    known.sort_by_key(|s| std::cmp::Reverse(s.len()));
}

/// `text` with every registered secret replaced by `***`.
pub fn scrub(text: &str) -> String {
    let known = SECRETS.lock().unwrap_or_else(|p| p.into_inner());
    let mut out = text.to_string();
    for s in known.iter() {
        if out.contains(s.as_str()) {
            out = out.replace(s.as_str(), "***");
        }
    }
    out
}

const SECRET_WORDS: &[&str] = &["password", "token", "secret", "key", "credentials", "nkey"];

/// Keys that name where a secret lives (a variable, a file), not the secret.
fn names_a_source(key: &str) -> bool {
    key.ends_with("_env")
        || key.ends_with("_file")
        || key.ends_with("_path")
        || matches!(key, "tls_key" | "tls_cert" | "tls_ca")
}

/// Strings that are URLs keep their host but lose the secret of their user info.
fn redact_urls(v: &mut toml::Value) {
    match v {
        toml::Value::String(s) if s.contains('@') => {
            *s = skein_nats::config::redact_url(s);
        }
        toml::Value::Array(items) => items.iter_mut().for_each(redact_urls),
        _ => {}
    }
}

fn redact(t: &mut toml::Table) {
    for (k, v) in t.iter_mut() {
        let lk = k.to_lowercase();
        match v {
            toml::Value::Table(inner) => redact(inner),
            toml::Value::String(s)
                if SECRET_WORDS.iter().any(|w| lk.contains(w)) && !names_a_source(&lk) =>
            {
                *s = "<redacted>".into()
            }
            _ => redact_urls(v),
        }
    }
}

/// `[mcp]`: what a stdio server is given in `env` may be a key, whatever its name, so
/// every value is hidden; `headers_env` names variables and is kept.
fn redact_mcp(t: &mut toml::Table) {
    redact(t);
    if let Some(toml::Value::Table(servers)) = t.get_mut("servers") {
        for (_, server) in servers.iter_mut() {
            if let Some(toml::Value::Table(env)) = server.get_mut("env") {
                for (_, v) in env.iter_mut() {
                    *v = toml::Value::String("<redacted>".into());
                }
            }
        }
    }
}

/// The configuration in force as TOML, with secrets replaced.
pub fn dump(cfg: &SkeinConfig) -> Result<String> {
    let mut c = cfg.clone();
    redact(&mut c.models);
    redact(&mut c.tools);
    redact(&mut c.nats);
    redact_mcp(&mut c.mcp);
    let mut out = String::new();
    if cfg.builtin_agents || cfg.builtin_scripts {
        out.push_str(
            "# No config/skein.toml here: the binary's built-in demo is in force \
             (`skein init` writes a project).\n",
        );
    }
    out.push_str(&toml::to_string_pretty(&c)?);
    Ok(scrub(&out))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dump_redacts_secrets_but_keeps_their_sources() {
        let mut cfg = SkeinConfig::default();
        cfg.nats.insert("password".into(), "hunter2".into());
        cfg.nats
            .insert("credentials_file".into(), "/etc/creds".into());
        let mut p = toml::Table::new();
        p.insert("api_key".into(), "sk-live-abc".into());
        p.insert("api_key_env".into(), "OPENAI_API_KEY".into());
        cfg.models.insert("openai".into(), toml::Value::Table(p));
        let out = dump(&cfg).unwrap();
        assert!(
            !out.contains("hunter2") && !out.contains("sk-live-abc"),
            "{out}"
        );
        assert!(
            out.contains("OPENAI_API_KEY") && out.contains("/etc/creds"),
            "{out}"
        );
    }

    #[test]
    fn dump_redacts_urls_with_user_info() {
        let mut cfg = SkeinConfig::default();
        cfg.nats.insert(
            "urls".into(),
            toml::Value::Array(vec![
                "nats://alice:url-pass@h1:4222".into(),
                "nats://h2:4222".into(),
            ]),
        );
        cfg.nats
            .insert("tls_key".into(), "/etc/nats/client.key".into());
        let out = dump(&cfg).unwrap();
        assert!(!out.contains("url-pass"), "{out}");
        assert!(out.contains("nats://alice:***@h1:4222"), "{out}");
        assert!(out.contains("nats://h2:4222"), "{out}");
        assert!(out.contains("/etc/nats/client.key"), "{out}");
    }

    #[test]
    fn flags_override_the_nats_table_and_its_env_names() {
        use clap::Parser;
        let cli = crate::Cli::parse_from([
            "skein",
            "sessions",
            "--nats",
            "nats://a:4222, nats://b:4222",
            "--nats-user",
            "bob",
            "--nats-password",
            "flag-pass",
            "--nats-creds",
            "/etc/bob.creds",
            "--nats-ca",
            "/etc/ca.pem",
        ]);
        let mut t = toml::Table::new();
        t.insert("user".into(), "alice".into());
        t.insert("password_env".into(), "SOME_VAR".into());
        t.insert("replicas".into(), 3.into());
        apply_nats_flags(&mut t, &cli.global);
        let c: skein_nats::NatsConfig = t.try_into().unwrap();
        assert_eq!(c.urls, ["nats://a:4222", "nats://b:4222"]);
        assert_eq!(c.user.as_deref(), Some("bob"));
        assert_eq!(c.password.as_deref(), Some("flag-pass"));
        assert_eq!(c.password_env, None);
        assert_eq!(c.replicas, 3);
        assert_eq!(
            c.credentials_file.as_deref(),
            Some(Path::new("/etc/bob.creds"))
        );
        assert_eq!(c.tls_ca.as_deref(), Some(Path::new("/etc/ca.pem")));
        let shown = format!("{:?}", cli.global);
        assert!(!shown.contains("flag-pass"), "{shown}");
    }

    #[test]
    fn runtime_pools_must_be_subject_tokens() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("skein.toml");
        std::fs::write(&f, "[runtime]\npools = [\"gpu\", \"a.>\"]\n").unwrap();
        let e = format!("{:#}", load(Some(&f)).unwrap_err());
        assert!(e.contains("runtime.pools") && e.contains("`a.>`"), "{e}");
        std::fs::write(&f, "[runtime]\npools = [\"gpu\", \"eu-1\"]\n").unwrap();
        assert_eq!(load(Some(&f)).unwrap().runtime.pools, ["gpu", "eu-1"]);
    }

    #[test]
    fn scrub_replaces_registered_secrets() {
        register_secrets(["scrub-me-123".to_string(), String::new()]);
        assert_eq!(scrub("a scrub-me-123 b"), "a *** b");
        assert_eq!(scrub("nothing here"), "nothing here");
    }
}
