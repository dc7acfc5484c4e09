//! Layered configuration: built-in defaults → the config file → `SKEIN__SECTION__KEY`
//! environment variables → command-line flags. Paths in the file are relative to the
//! file's directory.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use figment::providers::{Env, Format, Serialized, Toml};
use figment::Figment;
use serde::{Deserialize, Serialize};
use skein_core::Limits;

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
    /// Name recorded in the log for this worker (default: host-pid).
    pub worker_id: Option<String>,
    /// Pools a worker takes jobs from (default: every pool the agents name).
    pub pools: Vec<String>,
}

impl Default for RuntimeSection {
    fn default() -> Self {
        Self {
            concurrency: 64,
            lease: "30s".into(),
            max_deliver: 5,
            blob_threshold: 64 * 1024,
            state_cache: 10_000,
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
        }
    }
}

/// The config file used when none is named: `config/skein.toml` under the current
/// directory, if it exists.
pub fn default_config_path() -> Option<PathBuf> {
    let p = PathBuf::from("config/skein.toml");
    p.exists().then_some(p)
}

pub fn load(file: Option<&Path>) -> Result<SkeinConfig> {
    let mut fig = Figment::from(Serialized::defaults(SkeinConfig::default()));
    let base = match file {
        Some(f) => {
            if !f.exists() {
                anyhow::bail!("config file {} does not exist", f.display());
            }
            fig = fig.merge(Toml::file(f));
            f.parent().map(Path::to_path_buf).unwrap_or_default()
        }
        None => PathBuf::new(),
    };
    fig = fig.merge(Env::prefixed("SKEIN__").split("__"));
    let mut cfg: SkeinConfig = fig.extract().context("configuration")?;
    let file_set = |key: &str| {
        file.is_some()
            && fig
                .find_metadata(key)
                .is_some_and(|m| m.name.contains("TOML"))
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
    Ok(cfg)
}

const SECRET_WORDS: &[&str] = &["password", "token", "secret", "key", "credentials", "nkey"];

fn redact(t: &mut toml::Table) {
    for (k, v) in t.iter_mut() {
        let lk = k.to_lowercase();
        let names_a_source = lk.ends_with("_env") || lk.ends_with("_file") || lk.ends_with("_path");
        match v {
            toml::Value::Table(inner) => redact(inner),
            toml::Value::String(s)
                if SECRET_WORDS.iter().any(|w| lk.contains(w)) && !names_a_source =>
            {
                *s = "<redacted>".into()
            }
            _ => {}
        }
    }
}

/// The configuration in force as TOML, with secrets replaced.
pub fn dump(cfg: &SkeinConfig) -> Result<String> {
    let mut c = cfg.clone();
    redact(&mut c.models);
    redact(&mut c.tools);
    redact(&mut c.nats);
    Ok(toml::to_string_pretty(&c)?)
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
}
