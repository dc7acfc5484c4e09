//! `skein agents check`: load and validate every agent definition.

use std::process::ExitCode;

use anyhow::Result;
use clap::Subcommand;
use skein_core::AgentSet;

use crate::app::App;
use crate::render;

#[derive(Subcommand, Debug)]
pub enum AgentsCmd {
    /// Load and validate every agent definition (and the scripts scripted agents use).
    Check {
        #[arg(long)]
        json: bool,
    },
}

pub async fn run(app: &App, cmd: AgentsCmd) -> Result<ExitCode> {
    let AgentsCmd::Check { json } = cmd;
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
        let models = app.models()?;
        let scripted = skein_llm::scripted::ScriptedProvider::from_source(app.scripts());
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
