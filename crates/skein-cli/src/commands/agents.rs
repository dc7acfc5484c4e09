//! `skein agents`: check the definitions, and change which version of them a cluster
//! runs (`push`, `list`, `diff`, `rollback`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::Subcommand;
use skein_core::definitions::short;
use skein_core::{AgentSet, Definitions};
use skein_llm::scripted::{ScriptSource, ScriptedProvider};
use skein_nats::backend::{Move, VersionInfo};

use crate::app::App;
use crate::render;

#[derive(Subcommand, Debug)]
pub enum AgentsCmd {
    /// Load and validate every agent definition (and the scripts scripted agents use).
    Check {
        #[arg(long)]
        json: bool,
    },
    /// Publish the agent definitions and scripts to the cluster as a new version named by
    /// its digest, and make it current: trees submitted from now on run on it; running
    /// trees keep the version they started with.
    Push {
        /// The agents directory (default: `agents_dir`).
        dir: Option<PathBuf>,
        /// The scripts directory (default: `scripts` beside DIR when DIR is given and has
        /// one, else `scripts_dir`).
        #[arg(long)]
        scripts: Option<PathBuf>,
        /// A few words kept with the version (who pushed it, why).
        #[arg(long)]
        note: Option<String>,
        #[arg(long)]
        json: bool,
    },
    /// The versions pushed to the cluster, oldest first, and which is current.
    List {
        #[arg(long)]
        json: bool,
    },
    /// What changed, file by file, between two versions (digests or unique prefixes;
    /// `current` names the current one). Without TO, FROM is compared with the local
    /// files (what a push would change); without either, the current version is.
    Diff {
        from: Option<String>,
        to: Option<String>,
        #[arg(long)]
        json: bool,
    },
    /// Make the version current before this one current again (or VERSION, any version
    /// pushed). Running trees keep the version they started with.
    Rollback {
        version: Option<String>,
        #[arg(long)]
        json: bool,
    },
}

pub async fn run(app: &App, cmd: AgentsCmd) -> Result<ExitCode> {
    match cmd {
        AgentsCmd::Check { json } => check(app, json).await,
        AgentsCmd::Push {
            dir,
            scripts,
            note,
            json,
        } => push(app, dir, scripts, note, json).await,
        AgentsCmd::List { json } => list(app, json).await,
        AgentsCmd::Diff { from, to, json } => diff(app, from, to, json).await,
        AgentsCmd::Rollback { version, json } => rollback(app, version, json).await,
    }
}

/// What is wrong with the scripts and models of `set`'s agents, with `scripts` as the
/// scripted model's scripts.
fn model_problems(app: &App, set: &AgentSet, scripts: ScriptSource) -> Result<Vec<String>> {
    let mut problems = vec![];
    let models = app.models()?;
    let scripted = ScriptedProvider::from_source(scripts);
    for (name, def) in &set.agents {
        let origin = &set.origins[name];
        match models.resolve(&def.front.model) {
            Ok(("scripted", script)) => {
                if let Err(e) = scripted.load(script) {
                    problems.push(format!("{origin}: {e}"));
                }
            }
            Ok((provider, _)) if !models.has(provider) => problems.push(format!(
                "{origin}: agent `{name}` uses provider `{provider}`, which is not \
                 configured (known: {})",
                models.names().join(", ")
            )),
            Ok(_) => {}
            Err(e) => problems.push(format!("{origin}: {e}")),
        }
    }
    Ok(problems)
}

async fn check(app: &App, json: bool) -> Result<ExitCode> {
    let files = app.agent_files()?;
    let mut problems = vec![];
    let set = match AgentSet::load(&files, &[]) {
        Ok(s) => Some(s),
        Err(skein_core::Error::AgentSet(p)) => {
            problems.extend(p);
            None
        }
        Err(e) => return Err(e.into()),
    };
    if let Some(set) = &set {
        problems.extend(model_problems(app, set, app.scripts())?);
    }
    // The MCP servers are started here, as a worker would: one that will not start is
    // reported now, and so is an agent naming a server or tool that none offers.
    let mcp_cfg = app.mcp_config()?;
    let mcp = app.mcp_tools()?;
    problems.extend(mcp.problems());
    let offered = mcp.tool_names();
    if let Some(set) = &set {
        for (name, def) in &set.agents {
            let origin = &set.origins[name];
            for server in &def.front.mcp {
                if !mcp_cfg.servers.contains_key(server) {
                    problems.push(format!(
                        "{origin}: agent `{name}` names MCP server `{server}`, which is not \
                         configured (add [mcp.servers.{server}])"
                    ));
                }
            }
            for t in &def.front.tools {
                let Some(server) = skein_core::agent::mcp_server_of(t) else {
                    continue;
                };
                if !mcp_cfg.servers.contains_key(server) {
                    problems.push(format!(
                        "{origin}: agent `{name}` names tool `{t}` of MCP server `{server}`, \
                         which is not configured (add [mcp.servers.{server}])"
                    ));
                } else if !mcp.failed.iter().any(|(n, _)| n == server) && !offered.contains(t) {
                    problems.push(format!(
                        "{origin}: agent `{name}` names tool `{t}`, which MCP server \
                         `{server}` does not offer"
                    ));
                }
            }
        }
    }
    if json {
        let v = serde_json::json!({
            "mcp_tools": offered,
            "ok": problems.is_empty(),
            "agents": set.as_ref().map(|s| s.agents.keys().cloned().collect::<Vec<_>>()),
            "caching": set.as_ref().map(|s| {
                s.agents
                    .iter()
                    .map(|(n, d)| (n.clone(), serde_json::json!(s.caching(d))))
                    .collect::<serde_json::Map<_, _>>()
            }),
            "problems": problems,
        });
        crate::outln!("{}", serde_json::to_string_pretty(&v)?)?;
    } else if problems.is_empty() {
        if let Some(set) = &set {
            for (name, def) in &set.agents {
                let c = set.caching(def);
                let line = format!(
                    "ok  {name:<16} {}  ({})  {}: {}",
                    def.front.model,
                    set.origins[name],
                    if c.cached { "cached" } else { "not cached" },
                    c.reason
                );
                crate::outln!("{}", render::safe_line(&line))?;
            }
        }
    } else {
        crate::errln!(
            "agent definitions in {} rejected:",
            app.cfg.agents_dir.display()
        );
        for p in &problems {
            crate::errln!("  {}", render::safe(p));
        }
    }
    Ok(if problems.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// The files of one version as read from disk: agents under `dir` by their path relative
/// to it (no machine path enters the version), scripts by the name a `scripted:NAME` model
/// gives.
fn read_version(app: &App, dir: Option<PathBuf>, scripts: Option<PathBuf>) -> Result<Definitions> {
    let (agents, scripts) = match dir {
        None if app.cfg.builtin_agents => (
            crate::builtin::agent_files()
                .into_iter()
                .map(|(o, t)| (o.rsplit('/').next().unwrap_or(&o).to_string(), t))
                .collect(),
            match scripts {
                Some(s) => read_scripts(&s)?,
                None if app.cfg.builtin_scripts => crate::builtin::scripts(),
                None => read_scripts(&app.cfg.scripts_dir)?,
            },
        ),
        _ => {
            let dir = dir.unwrap_or_else(|| app.cfg.agents_dir.clone());
            let agents = crate::app::read_agent_files(&dir)?
                .into_iter()
                .map(|(path, text)| {
                    let rel = Path::new(&path)
                        .strip_prefix(&dir)
                        .map(|p| p.to_string_lossy().into_owned())
                        .unwrap_or(path);
                    (rel, text)
                })
                .collect();
            let beside = dir.parent().map(|p| p.join("scripts"));
            let scripts = match scripts {
                Some(s) => read_scripts(&s)?,
                None if beside.as_ref().is_some_and(|b| b.is_dir()) => {
                    read_scripts(beside.as_deref().unwrap_or(Path::new(".")))?
                }
                None if app.cfg.builtin_scripts => crate::builtin::scripts(),
                None => read_scripts(&app.cfg.scripts_dir)?,
            };
            (agents, scripts)
        }
    };
    let mut defs = Definitions::new(agents, scripts);
    // What a tree's decisions depend on beyond its agents goes with them: `[limits]` and
    // the provider of a bare model name. Provider settings and keys stay each worker's.
    defs.limits = Some(app.cfg.limits.clone());
    defs.default_provider = app
        .cfg
        .models
        .get("default_provider")
        .and_then(|v| v.as_str())
        .map(str::to_string);
    Ok(defs)
}

/// Every `NAME.yaml` of `dir`, by NAME (none when `dir` does not exist: a set of agents
/// may use no scripted model).
fn read_scripts(dir: &Path) -> Result<BTreeMap<String, String>> {
    let mut out = BTreeMap::new();
    if !dir.exists() {
        return Ok(out);
    }
    let entries = std::fs::read_dir(dir)
        .with_context(|| format!("cannot read the scripts directory {}", dir.display()))?;
    for e in entries {
        let p = e?.path();
        if p.extension().is_some_and(|x| x == "yaml") {
            if let Some(name) = p.file_stem().and_then(|s| s.to_str()) {
                let text = std::fs::read_to_string(&p)
                    .with_context(|| format!("cannot read {}", p.display()))?;
                out.insert(name.to_string(), text);
            }
        }
    }
    Ok(out)
}

fn need_nats(app: &App) -> Result<()> {
    anyhow::ensure!(
        app.global.nats.is_some(),
        "definitions are pushed to a cluster: pass --nats URL or set SKEIN_NATS_URL (on one \
         machine, the agent files themselves are in force)"
    );
    Ok(())
}

/// A version's content, read from the cluster's blob store.
async fn fetch(store: &skein_nats::NatsStore, digest: &str) -> Result<Definitions> {
    use skein_runtime::ports::Blobs;
    let bytes = store
        .get(digest)
        .await?
        .with_context(|| format!("definitions version {digest} is not in the blob store"))?;
    Ok(Definitions::decode(&bytes)?)
}

async fn push(
    app: &App,
    dir: Option<PathBuf>,
    scripts: Option<PathBuf>,
    note: Option<String>,
    json: bool,
) -> Result<ExitCode> {
    need_nats(app)?;
    let defs = read_version(app, dir, scripts)?;
    // Refused before anything is stored: a version that cannot run (a cycle, an unknown
    // agent, a script missing or broken) never becomes current.
    let set = match defs.agent_set(&[]) {
        Ok(s) => s,
        Err(skein_core::Error::AgentSet(p)) => {
            crate::errln!("definitions refused, nothing pushed:");
            for p in &p {
                crate::errln!("  {}", render::safe(p));
            }
            return Ok(ExitCode::FAILURE);
        }
        Err(e) => return Err(e.into()),
    };
    let problems: Vec<String> =
        model_problems(app, &set, ScriptSource::Texts(defs.scripts.clone()))?
            .into_iter()
            // A provider is the workers' configuration, not the version's: a worker that lacks
            // one leaves the job for one that has it.
            .filter(|p| !p.contains("which is not configured"))
            .collect();
    if !problems.is_empty() {
        crate::errln!("definitions refused, nothing pushed:");
        for p in &problems {
            crate::errln!("  {}", render::safe(p));
        }
        return Ok(ExitCode::FAILURE);
    }
    // Keys stay in each worker's environment: a version holding one (a value this process
    // knows as secret, or text shaped like a key) is refused, naming where it is.
    let _ = app.models();
    let mut secrets = crate::config::known_secrets();
    secrets.extend(std::env::var("SKEIN_TOKEN_SECRET").ok());
    let leaks = defs.secrets_in(&secrets);
    if !leaks.is_empty() {
        crate::errln!(
            "definitions refused, nothing pushed: {} hold(s) what looks like a secret (an API \
             key, a token); keys stay in each worker's environment (`api_key_env`), never in \
             pushed definitions",
            leaks.join(", ")
        );
        return Ok(ExitCode::FAILURE);
    }
    let store = app.nats().await?;
    let bytes = defs.encode()?;
    let digest = {
        use skein_runtime::ports::Blobs;
        store.put(&bytes).await?
    };
    let previous = store.defs_current().await?;
    let info = VersionInfo {
        digest: digest.clone(),
        at: skein_runtime::now_ms(),
        agents: set.agents.keys().cloned().collect(),
        scripts: defs.scripts.keys().cloned().collect(),
        note,
    };
    store.defs_record(&info).await?;
    let changes = match &previous {
        Some(p) if p.digest == digest => vec![],
        Some(p) => defs.diff(&fetch(&store, &p.digest).await?),
        None => defs.diff(&Definitions::default()),
    };
    let current = store
        .defs_move(Move::To(digest.clone()), skein_runtime::now_ms())
        .await?;
    if json {
        let v = serde_json::json!({
            "version": digest,
            "current": current.digest,
            "previous": previous.map(|p| p.digest),
            "agents": info.agents,
            "scripts": info.scripts,
            "changes": changes,
        });
        crate::outln!("{}", serde_json::to_string_pretty(&v)?)?;
    } else {
        crate::outln!(
            "pushed {} ({} agents, {} scripts); current now",
            short(&digest),
            info.agents.len(),
            info.scripts.len()
        )?;
        if changes.is_empty() {
            crate::outln!("  no change from the version current before")?;
        }
        for c in &changes {
            crate::outln!("  {}", render::safe_line(c))?;
        }
    }
    Ok(ExitCode::SUCCESS)
}

async fn list(app: &App, json: bool) -> Result<ExitCode> {
    need_nats(app)?;
    let store = app.nats().await?;
    let versions = store.defs_versions().await?;
    let current = store.defs_current().await?.map(|c| c.digest);
    if json {
        let v: Vec<_> = versions
            .iter()
            .map(|v| {
                serde_json::json!({
                    "version": v.digest, "at": v.at, "agents": v.agents, "scripts": v.scripts,
                    "note": v.note, "current": current.as_deref() == Some(v.digest.as_str()),
                })
            })
            .collect();
        crate::outln!("{}", serde_json::to_string_pretty(&v)?)?;
        return Ok(ExitCode::SUCCESS);
    }
    if versions.is_empty() {
        crate::outln!("no definitions pushed: every worker runs on its own agent files")?;
    }
    for v in &versions {
        let mark = if current.as_deref() == Some(v.digest.as_str()) {
            "*"
        } else {
            " "
        };
        let line = format!(
            "{mark} {}  {}  {} agents: {}{}",
            short(&v.digest),
            humantime::format_rfc3339_seconds(
                std::time::UNIX_EPOCH + std::time::Duration::from_millis(v.at)
            ),
            v.agents.len(),
            v.agents.join(", "),
            v.note
                .as_deref()
                .map(|n| format!("  ({n})"))
                .unwrap_or_default()
        );
        crate::outln!("{}", render::safe_line(&line))?;
    }
    Ok(ExitCode::SUCCESS)
}

/// The digest a name stands for: `current`, or a version's digest or unique prefix.
async fn resolve(store: &skein_nats::NatsStore, name: &str) -> Result<String> {
    if name == "current" {
        return store
            .defs_current()
            .await?
            .map(|c| c.digest)
            .context("no definitions version is current: nothing was pushed");
    }
    Ok(store.defs_version(name).await?.digest)
}

async fn diff(app: &App, from: Option<String>, to: Option<String>, json: bool) -> Result<ExitCode> {
    need_nats(app)?;
    let store = app.nats().await?;
    let from = resolve(&store, from.as_deref().unwrap_or("current")).await?;
    let old = fetch(&store, &from).await?;
    let (to_name, new) = match &to {
        Some(t) => {
            let d = resolve(&store, t).await?;
            (short(&d).to_string(), fetch(&store, &d).await?)
        }
        None => (
            "the local files".to_string(),
            read_version(app, None, None)?,
        ),
    };
    let changes = new.diff(&old);
    if json {
        let v = serde_json::json!({"from": from, "to": to_name, "changes": changes});
        crate::outln!("{}", serde_json::to_string_pretty(&v)?)?;
    } else if changes.is_empty() {
        crate::outln!("{} and {to_name}: the same files", short(&from))?;
    } else {
        crate::outln!("from {} to {to_name}:", short(&from))?;
        for c in &changes {
            crate::outln!("  {}", render::safe_line(c))?;
        }
    }
    Ok(ExitCode::SUCCESS)
}

async fn rollback(app: &App, version: Option<String>, json: bool) -> Result<ExitCode> {
    need_nats(app)?;
    let store = app.nats().await?;
    let before = store.defs_current().await?.map(|c| c.digest);
    let to = match version {
        Some(v) => Move::To(resolve(&store, &v).await?),
        None => Move::Back,
    };
    let now = store.defs_move(to, skein_runtime::now_ms()).await?;
    if json {
        let v = serde_json::json!({"current": now.digest, "previous": before});
        crate::outln!("{}", serde_json::to_string_pretty(&v)?)?;
    } else {
        crate::outln!(
            "current now {} (was {}); running trees keep their version",
            short(&now.digest),
            before.as_deref().map(short).unwrap_or("none")
        )?;
    }
    Ok(ExitCode::SUCCESS)
}
