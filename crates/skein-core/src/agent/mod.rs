//! Agent definitions: Markdown with YAML front matter. The front matter is typed and
//! validated; the body is the system prompt. A definition is identified by the blake3
//! digest of its whole text, which is what a session records at submission.

use std::collections::BTreeSet;

use serde::{Deserialize, Serialize};

use crate::runtime_tool::RuntimeTool;
use crate::{Error, Result};

mod expansion;
mod set;

pub use expansion::check_yaml_expansion;
pub use set::AgentSet;

/// The tools every agent may be given by name.
pub const BUILTIN_TOOLS: &[&str] = &[
    RuntimeTool::CallAgent.as_str(),
    crate::runtime_tool::DELEGATE_TO_AGENT,
    RuntimeTool::AskUser.as_str(),
    RuntimeTool::ProposePatch.as_str(),
    RuntimeTool::UpdatePlan.as_str(),
    RuntimeTool::HandoffTo.as_str(),
    RuntimeTool::TeamBroadcast.as_str(),
    RuntimeTool::AskClarification.as_str(),
    "read_file",
    "write_file",
    "list_dir",
    "list_directory",
    "get_file_info",
    "search_files",
    "http_fetch",
    "shell",
];

/// Built-in tools whose every call waits for a person's approval, whatever `[limits]
/// approval_required` or the agent says. Part of the decision rules, so a log replays the
/// same way under any configuration.
pub const ALWAYS_APPROVED: &[&str] = &["shell"];

/// Between an MCP server's name and its tool's: `git__status`.
pub const MCP_SEPARATOR: &str = "__";

/// After [`MCP_SEPARATOR`] in an allowed set: every tool of that server.
pub const MCP_ALL: &str = "*";

/// Checks the name of an MCP server as an agent file gives it: 1 to 32 ASCII letters,
/// digits, `-` or `_`, without `__`.
pub fn validate_mcp_server(name: &str) -> std::result::Result<(), String> {
    let ok = !name.is_empty()
        && name.len() <= 32
        && !name.contains(MCP_SEPARATOR)
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_');
    if ok {
        Ok(())
    } else {
        Err(format!(
            "`{}` is not an MCP server's name (1 to 32 ASCII letters, digits, `-` or `_`, \
             without `__`)",
            name.escape_debug()
        ))
    }
}

/// `git.status` as the name the model knows: `git__status`.
fn mcp_dotted(t: &str) -> Option<String> {
    let (server, tool) = t.split_once('.')?;
    (validate_mcp_server(server).is_ok() && !tool.is_empty() && !tool.contains('.'))
        .then(|| format!("{server}{MCP_SEPARATOR}{tool}"))
}

/// Whether `tool` names an MCP server's tool (`SERVER__TOOL`), and which server.
pub fn mcp_server_of(tool: &str) -> Option<&str> {
    let (server, rest) = tool.split_once(MCP_SEPARATOR)?;
    (validate_mcp_server(server).is_ok() && !rest.is_empty()).then_some(server)
}

/// Whether an allowed set (of [`AgentDef::allowed_tools`], narrowed) lets a call of
/// `tool` through: named, or a tool of a server the set has whole (`SERVER__*`).
pub fn tool_allowed(allowed: &BTreeSet<String>, tool: &str) -> bool {
    // `SERVER__*` stands for tools; it is never one.
    !tool.ends_with(MCP_ALL)
        && (allowed.contains(tool) || allowed.iter().any(|a| wildcard_covers(a, tool)))
}

/// Whether `entry` is `SERVER__*` and `tool` one of that server's tools.
pub fn wildcard_covers(entry: &str, tool: &str) -> bool {
    entry
        .strip_suffix(MCP_ALL)
        .filter(|p| p.ends_with(MCP_SEPARATOR))
        .is_some_and(|prefix| {
            tool.len() > prefix.len() && tool.starts_with(prefix) && !tool.ends_with(MCP_ALL)
        })
}

/// Largest agent definition accepted, in bytes (front matter and prompt together).
pub const MAX_DEFINITION_BYTES: usize = 256 * 1024;

/// What the front matter may amount to once YAML aliases are resolved: the bytes of every
/// scalar plus [`NODE_COST`] per node. An alias repeats its anchor's whole content, so a
/// small file could otherwise stand for gigabytes.
pub const MAX_FRONT_MATTER_EXPANSION: usize = 1024 * 1024;

/// What one YAML node (scalar, list, map, alias target) counts against
/// [`MAX_FRONT_MATTER_EXPANSION`] besides its bytes, so that aliases of empty lists cannot
/// multiply unchecked either.
pub const NODE_COST: usize = 8;

/// The largest priority a tree or an agent may have, and the opposite the smallest.
pub const MAX_PRIORITY: i32 = 100;

/// Checks a priority for model quotas (a tree's, `--priority`, or an agent's,
/// `priority:`): a whole number from -[`MAX_PRIORITY`] to [`MAX_PRIORITY`]. A session's
/// priority is its tree's plus its agent's; where a model's quota makes calls wait, a
/// higher priority goes first.
pub fn validate_priority(p: i32) -> std::result::Result<(), String> {
    if (-MAX_PRIORITY..=MAX_PRIORITY).contains(&p) {
        Ok(())
    } else {
        Err(format!(
            "priority {p} is out of range: a priority is a whole number from \
             -{MAX_PRIORITY} to {MAX_PRIORITY} (0 by default; higher goes first)"
        ))
    }
}

/// Longest pool name, in bytes.
pub const MAX_POOL_LEN: usize = 64;

/// Checks a pool name. A pool is one token of the NATS subject `skein.jobs.POOL.…` and the
/// name of a durable consumer, so it is 1 to 64 ASCII letters, digits, `-` or `_`.
pub fn validate_pool(pool: &str) -> std::result::Result<(), String> {
    const RULE: &str = "a pool is one NATS subject token: 1 to 64 ASCII letters, digits, `-` \
                        and `_`";
    if pool.is_empty() {
        return Err(format!("the pool name is empty; {RULE}"));
    }
    if pool.len() > MAX_POOL_LEN {
        return Err(format!(
            "pool `{}…` is {} bytes; {RULE}",
            crate::id::prefix_chars(pool, 16).escape_debug(),
            pool.len()
        ));
    }
    if let Some(c) = pool
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || *c == '-' || *c == '_'))
    {
        return Err(format!(
            "pool `{}` contains {c:?}; {RULE}",
            pool.escape_debug()
        ));
    }
    Ok(())
}

/// Tools whose calls change nothing a later run would miss: the workspace readers and the
/// runtime's own tools that only talk within the tree. Any other tool (`write_file`,
/// `shell`, `http_fetch`, a tool a deployment adds) may have side effects, so an agent
/// that may call one is not answered from the cache unless its file says `cache:`.
/// `call_agent` counts as the tools of the agents it may start. `ask_user` is not here:
/// a person's answer is an input the mission does not hold, so a run that may ask one is
/// neither answered from the cache nor shared with another tree (whose person would
/// otherwise answer this tree's question).
pub const SIDE_EFFECT_FREE_TOOLS: &[&str] = &[
    "read_file",
    "list_dir",
    "list_directory",
    "get_file_info",
    "search_files",
    RuntimeTool::AskClarification.as_str(),
    RuntimeTool::UpdatePlan.as_str(),
    RuntimeTool::ProposePatch.as_str(),
    RuntimeTool::HandoffTo.as_str(),
    RuntimeTool::TeamBroadcast.as_str(),
];

/// Whether an agent's answers are cached, and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Caching {
    pub cached: bool,
    pub reason: String,
}

#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AgentLimits {
    pub max_steps: Option<u32>,
    pub max_children_per_turn: Option<u32>,
    /// Tool calls one model turn may make (`[limits] max_tool_calls_per_turn` otherwise).
    pub max_tool_calls_per_turn: Option<u32>,
    /// Tokens this agent's session may spend (its subtree included).
    pub max_tokens: Option<u64>,
    /// Wall time a session of this agent may run, from its submission (a duration such
    /// as "90s" or "5m"). Past it the session and everything under it are cancelled,
    /// and its caller reads why.
    pub timeout: Option<String>,
}

impl AgentLimits {
    /// `timeout`, read. A definition whose timeout does not read is refused when it
    /// loads, so this is `None` only when none is set.
    pub fn timeout(&self) -> Option<std::time::Duration> {
        self.timeout
            .as_deref()
            .and_then(|t| crate::duration::parse(t).ok())
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Router {
    pub destinations: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Team {
    pub members: Vec<String>,
    pub supervisor: String,
    /// Model turns each member may make (its agent's `max_steps` otherwise).
    #[serde(default, alias = "memberMaxTurns")]
    pub member_max_turns: Option<u32>,
    /// Model turns the supervisor may make: the bound of the whole team.
    #[serde(default, alias = "supervisorMaxTurns")]
    pub supervisor_max_turns: Option<u32>,
}

/// `cache: false`, or `cache: {ttl: "1h"}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum CacheSetting {
    Enabled(bool),
    Ttl { ttl: String },
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Summarize {
    pub max_chars: usize,
    #[serde(default)]
    pub model: Option<String>,
}

/// Front matter as written in the file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FrontMatter {
    pub name: String,
    #[serde(default)]
    pub description: String,
    pub model: String,
    #[serde(default)]
    pub temperature: Option<f32>,
    #[serde(default)]
    pub max_tokens: Option<u32>,
    /// Nucleus sampling (0 < top_p ≤ 1), sent to the provider as given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_p: Option<f32>,
    /// Sample among this many most likely tokens (Anthropic, and OpenAI-compatible
    /// servers that take it, such as llama.cpp and vLLM).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_k: Option<u32>,
    #[serde(default)]
    pub tools: Vec<String>,
    /// MCP servers (`[mcp.servers.NAME]`) whose every tool this agent may call, as
    /// `NAME__TOOL`. A single tool is named in `tools` instead (`git__status`, or
    /// `git.status`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mcp: Vec<String>,
    /// The sub-agents this agent may call with `call_agent`.
    #[serde(default, alias = "sub_agents", alias = "sub-agents")]
    pub agents: Vec<String>,
    /// Whether this agent may appear twice on one delegation path.
    #[serde(default)]
    pub recursive: bool,
    #[serde(default)]
    pub pool: Option<String>,
    /// This agent's priority for model quotas, added to its tree's (see
    /// [`validate_priority`]). None: 0.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority: Option<i32>,
    #[serde(default)]
    pub limits: AgentLimits,
    /// Tools that are safe to run again when a crash hid their outcome.
    #[serde(default)]
    pub idempotent_tools: Vec<String>,
    #[serde(default)]
    pub requires_approval: Vec<String>,
    #[serde(default)]
    pub handoff: Option<String>,
    #[serde(default)]
    pub router: Option<Router>,
    #[serde(default)]
    pub advisors: Vec<String>,
    #[serde(default)]
    pub team: Option<Team>,
    #[serde(default)]
    pub chat: bool,
    #[serde(default)]
    pub cache: Option<CacheSetting>,
    #[serde(default)]
    pub summarize: Option<Summarize>,
    #[serde(default)]
    pub strategy: Option<String>,
    /// Ask the model provider to cache this agent's stable prompt prefix (Anthropic's
    /// prompt caching; other providers cache on their own or not at all).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub prompt_cache: bool,
}

/// A parsed agent definition.
#[derive(Debug, Clone, PartialEq)]
pub struct AgentDef {
    pub front: FrontMatter,
    pub prompt: String,
    /// Hex blake3 of the definition text.
    pub digest: String,
    /// The definition text, as stored by digest.
    pub text: String,
}

/// Digest of a definition text.
pub fn def_digest(text: &str) -> String {
    blake3::hash(text.as_bytes()).to_hex().to_string()
}

fn split_front_matter(text: &str) -> Option<(&str, &str)> {
    let rest = text.strip_prefix("---")?;
    let rest = rest
        .strip_prefix('\n')
        .or_else(|| rest.strip_prefix("\r\n"))?;
    let mut offset = 0;
    for line in rest.split_inclusive('\n') {
        if line.trim_end() == "---" {
            let body = &rest[offset + line.len()..];
            return Some((&rest[..offset], body));
        }
        offset += line.len();
    }
    None
}

impl AgentDef {
    /// Parses a definition. `origin` names the file in errors.
    pub fn parse(origin: &str, text: &str) -> Result<Self> {
        if text.len() > MAX_DEFINITION_BYTES {
            return Err(Error::AgentDef {
                origin: origin.into(),
                reason: format!(
                    "the definition is {} bytes; at most {MAX_DEFINITION_BYTES} (256 KiB) are \
                     accepted",
                    text.len()
                ),
            });
        }
        let (yaml, body) = split_front_matter(text).ok_or_else(|| Error::AgentDef {
            origin: origin.into(),
            reason: "no YAML front matter: the file must start with `---` and the front \
                     matter must end with a line `---`"
                .into(),
        })?;
        check_yaml_expansion(yaml, MAX_FRONT_MATTER_EXPANSION).map_err(|e| Error::AgentDef {
            origin: origin.into(),
            reason: format!("front matter: {e}"),
        })?;
        let mut front: FrontMatter = serde_norway::from_str(yaml).map_err(|e| Error::AgentDef {
            origin: origin.into(),
            reason: format!("front matter: {e}"),
        })?;
        for server in &front.mcp {
            validate_mcp_server(server).map_err(|e| Error::AgentDef {
                origin: origin.into(),
                reason: format!("mcp: {e}"),
            })?;
        }
        for t in front
            .tools
            .iter_mut()
            .chain(front.requires_approval.iter_mut())
            .chain(front.idempotent_tools.iter_mut())
        {
            if let Some(n) = mcp_dotted(t) {
                *t = n;
            }
        }
        crate::id::validate_token(&front.name).map_err(|e| Error::AgentDef {
            origin: origin.into(),
            reason: format!("name: {e}"),
        })?;
        if let Some(p) = front.priority {
            validate_priority(p).map_err(|e| Error::AgentDef {
                origin: origin.into(),
                reason: format!("agent `{}`: {e}", front.name),
            })?;
        }
        if let Some(pool) = &front.pool {
            validate_pool(pool).map_err(|e| Error::AgentDef {
                origin: origin.into(),
                reason: format!("agent `{}`: {e}", front.name),
            })?;
        }
        // `provider:model`, or a bare model name that `[models] default_provider` places
        // (the registry resolves it; `skein agents check` says when nothing does).
        let bad = match front.model.split_once(':') {
            Some((p, m)) => p.trim().is_empty() || m.trim().is_empty(),
            None => front.model.trim().is_empty(),
        };
        if bad {
            return Err(Error::AgentDef {
                origin: origin.into(),
                reason: format!(
                    "model `{}` must be `provider:model`, e.g. `scripted:writer` or \
                     `openai:gpt-4o-mini` (or a bare model name with `[models] \
                     default_provider` set)",
                    front.model
                ),
            });
        }
        if let Some(t) = &front.limits.timeout {
            let d = crate::duration::parse(t).map_err(|e| Error::AgentDef {
                origin: origin.into(),
                reason: format!("limits.timeout: {e}"),
            })?;
            if d.is_zero() {
                return Err(Error::AgentDef {
                    origin: origin.into(),
                    reason: "limits.timeout: must be longer than zero".into(),
                });
            }
        }
        if let Some(CacheSetting::Ttl { ttl }) = &front.cache {
            crate::duration::parse(ttl).map_err(|e| Error::AgentDef {
                origin: origin.into(),
                reason: format!("cache.ttl: {e}"),
            })?;
        }
        Ok(Self {
            front,
            prompt: body.trim().to_string(),
            digest: def_digest(text),
            text: text.to_string(),
        })
    }

    /// A definition for a custom agent made at run time by `caller`.
    pub fn custom(caller: &AgentDef, system_prompt: &str, tools: &[String]) -> Result<Self> {
        let front = FrontMatter {
            name: "custom".into(),
            description: format!("custom agent made by {}", caller.front.name),
            model: caller.front.model.clone(),
            temperature: caller.front.temperature,
            max_tokens: caller.front.max_tokens,
            top_p: caller.front.top_p,
            top_k: caller.front.top_k,
            tools: tools.to_vec(),
            mcp: vec![],
            agents: vec![],
            recursive: false,
            pool: caller.front.pool.clone(),
            priority: caller.front.priority,
            limits: AgentLimits::default(),
            idempotent_tools: caller.front.idempotent_tools.clone(),
            requires_approval: caller.front.requires_approval.clone(),
            handoff: None,
            router: None,
            advisors: vec![],
            team: None,
            chat: false,
            cache: None,
            summarize: None,
            strategy: None,
            prompt_cache: caller.front.prompt_cache,
        };
        Self::parse(
            "custom agent_definition",
            &Self::render(&front, system_prompt)?,
        )
    }

    /// The definition text for front matter and a prompt.
    pub fn render(front: &FrontMatter, prompt: &str) -> Result<String> {
        let yaml = serde_norway::to_string(front).map_err(|e| Error::Encode(e.to_string()))?;
        Ok(format!("---\n{yaml}---\n{prompt}\n"))
    }

    pub fn name(&self) -> &str {
        &self.front.name
    }

    /// Every tool this agent may call: its `tools`, plus `call_agent` when it has
    /// sub-agents, plus the exits its orchestration pattern needs, plus `NAME__*` for
    /// each MCP server of its `mcp` (see [`tool_allowed`]).
    pub fn allowed_tools(&self) -> BTreeSet<String> {
        let mut t: BTreeSet<String> = self.front.tools.iter().cloned().collect();
        t.extend(
            self.front
                .mcp
                .iter()
                .map(|s| format!("{s}{MCP_SEPARATOR}{MCP_ALL}")),
        );
        if !self.front.agents.is_empty() {
            t.insert(self.delegation_tool().into());
        }
        if self.front.router.is_some() {
            t.insert(RuntimeTool::HandoffTo.as_str().into());
        }
        t
    }

    /// The name this agent's model knows delegation by: `delegate_to_agent` when its
    /// `tools` list that name, else `call_agent`. Either is the same tool.
    pub fn delegation_tool(&self) -> &'static str {
        if self
            .front
            .tools
            .iter()
            .any(|t| t == crate::runtime_tool::DELEGATE_TO_AGENT)
        {
            crate::runtime_tool::DELEGATE_TO_AGENT
        } else {
            RuntimeTool::CallAgent.as_str()
        }
    }

    /// Whether the file disables caching (`cache: false`). Whether a session of this agent
    /// is cached also depends on what it may do: see [`AgentSet::caching`].
    pub fn cache_enabled(&self) -> bool {
        !matches!(self.front.cache, Some(CacheSetting::Enabled(false)))
    }

    /// The agents a session of this one may start: sub-agents, handoff, advisors, router
    /// destinations, team members and supervisor.
    pub fn starts(&self) -> Vec<&str> {
        let f = &self.front;
        let mut out: Vec<&str> = f.agents.iter().map(String::as_str).collect();
        out.extend(f.handoff.iter().map(String::as_str));
        out.extend(f.advisors.iter().map(String::as_str));
        if let Some(r) = &f.router {
            out.extend(r.destinations.iter().map(String::as_str));
        }
        if let Some(t) = &f.team {
            out.extend(t.members.iter().map(String::as_str));
            out.push(t.supervisor.as_str());
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(name: &str, extra: &str) -> (String, String) {
        (
            format!("agents/{name}.md"),
            format!("---\nname: {name}\nmodel: scripted:{name}\n{extra}---\nYou are {name}.\n"),
        )
    }

    #[test]
    fn parses_front_matter_and_body() {
        let (o, t) = file("writer", "tools: [read_file]\ntemperature: 0.2\n");
        let d = AgentDef::parse(&o, &t).unwrap();
        assert_eq!(d.name(), "writer");
        assert_eq!(d.prompt, "You are writer.");
        assert_eq!(d.front.tools, vec!["read_file"]);
        assert_eq!(d.digest, def_digest(&t));
    }

    #[test]
    fn unknown_field_and_missing_front_matter_are_named() {
        let (o, t) = file("w", "tols: [x]\n");
        let e = AgentDef::parse(&o, &t).unwrap_err().to_string();
        assert!(e.contains("agents/w.md") && e.contains("tols"), "{e}");
        let e = AgentDef::parse("x.md", "just text")
            .unwrap_err()
            .to_string();
        assert!(e.contains("x.md") && e.contains("front matter"), "{e}");
    }

    #[test]
    fn cycle_is_reported_with_path_unless_recursive() {
        let files = vec![
            file("a", "agents: [b]\n"),
            file("b", "agents: [c]\n"),
            file("c", "agents: [a]\n"),
        ];
        let e = AgentSet::load(&files, &[]).unwrap_err().to_string();
        assert!(e.contains("cycle a → b → c → a"), "{e}");
        assert!(e.contains("agents/a.md"), "{e}");

        let files = vec![
            file("a", "agents: [b]\nrecursive: true\n"),
            file("b", "agents: [a]\nrecursive: true\n"),
        ];
        AgentSet::load(&files, &[]).unwrap();

        let files = vec![
            file("a", "handoff: b\n"),
            file("b", "handoff: a\nrecursive: true\n"),
        ];
        let e = AgentSet::load(&files, &[]).unwrap_err().to_string();
        assert!(e.contains("cycle a → b → a"), "{e}");
    }

    #[test]
    fn agents_that_may_have_side_effects_are_not_cached_unless_their_file_says_so() {
        let files = vec![
            file("reader", "tools: [read_file, list_dir]\n"),
            file("scribe", "tools: [read_file, write_file]\n"),
            file("boss", "agents: [reader, middle]\n"),
            file("middle", "handoff: scribe\n"),
            file("calm", "agents: [reader]\n"),
            file("forced", "tools: [write_file]\ncache: true\n"),
            file("timed", "tools: [shell]\ncache: {ttl: 1h}\n"),
            file("off", "cache: false\n"),
        ];
        let set = AgentSet::load(&files, &[]).unwrap();
        let c = |n: &str| set.caching(set.get(n).unwrap());
        assert!(c("reader").cached, "{:?}", c("reader"));
        assert!(c("calm").cached, "{:?}", c("calm"));
        let s = c("scribe");
        assert!(
            !s.cached && s.reason.contains("may call `write_file`"),
            "{s:?}"
        );
        let b = c("boss");
        assert!(!b.cached, "{b:?}");
        assert!(
            b.reason.contains(
                "may start `middle`, which may start `scribe`, which may call `write_file`"
            ),
            "{b:?}"
        );
        assert!(c("forced").cached && c("timed").cached);
        assert!(!c("off").cached);
        // A custom agent is judged by its own tools.
        let custom =
            AgentDef::custom(set.get("scribe").unwrap(), "p", &["read_file".into()]).unwrap();
        assert!(set.caching(&custom).cached);
    }

    #[test]
    fn mcp_servers_and_their_tools_are_allowed_by_name_or_whole() {
        let files = vec![
            file(
                "git_user",
                "mcp: [git]\ntools: [tickets.create, read_file]\n",
            ),
            file("reader", "tools: [read_file]\n"),
        ];
        let set = AgentSet::load(&files, &[]).unwrap();
        let d = set.get("git_user").unwrap();
        assert_eq!(d.front.tools, vec!["tickets__create", "read_file"]);
        let allowed = d.allowed_tools();
        assert!(allowed.contains("git__*"), "{allowed:?}");
        for ok in ["git__status", "git__commit", "tickets__create", "read_file"] {
            assert!(tool_allowed(&allowed, ok), "{ok}");
        }
        for no in [
            "git__",
            "git__*",
            "tickets__delete",
            "gitx__status",
            "write_file",
            "git",
        ] {
            assert!(!tool_allowed(&allowed, no), "{no}");
        }
        let c = set.caching(d);
        assert!(!c.cached && c.reason.contains("MCP server `git`"), "{c:?}");
        assert!(set.caching(set.get("reader").unwrap()).cached);
        // Bad server names are refused with the file named.
        let (o, t) = file("w", "mcp: [\"a.b\"]\n");
        let e = AgentDef::parse(&o, &t).unwrap_err().to_string();
        assert!(e.contains("agents/w.md") && e.contains("MCP server"), "{e}");
        let (o, t) = file("w", "mcp: [git__x]\n");
        assert!(AgentDef::parse(&o, &t).is_err());
    }

    #[test]
    fn unknown_agents_and_tools_are_named() {
        let files = vec![file("a", "agents: [ghost]\ntools: [teleport]\n")];
        let e = AgentSet::load(&files, &[]).unwrap_err().to_string();
        assert!(e.contains("unknown agent `ghost`"), "{e}");
        assert!(e.contains("unknown tool `teleport`"), "{e}");
        let files = vec![file("r", "router: {destinations: []}\n")];
        let e = AgentSet::load(&files, &[]).unwrap_err().to_string();
        assert!(e.contains("router without destinations"), "{e}");
    }

    #[test]
    fn a_priority_is_a_whole_number_within_its_range() {
        for ok in ["-100", "0", "7", "100"] {
            let (o, t) = file("w", &format!("priority: {ok}\n"));
            let def = AgentDef::parse(&o, &t).unwrap();
            assert_eq!(def.front.priority, Some(ok.parse().unwrap()));
        }
        for bad in ["101", "-101", "2147483647"] {
            let (o, t) = file("w", &format!("priority: {bad}\n"));
            let e = AgentDef::parse(&o, &t).unwrap_err().to_string();
            assert!(e.contains("agent `w`"), "{e}");
            assert!(
                e.contains(&format!("priority {bad} is out of range")),
                "{e}"
            );
            assert!(e.contains("-100 to 100"), "{e}");
        }
        let (o, t) = file("w", "priority: high\n");
        let e = AgentDef::parse(&o, &t).unwrap_err().to_string();
        assert!(e.contains("priority"), "{e}");
    }

    #[test]
    fn pools_must_be_one_subject_token() {
        for bad in [
            "a.>",
            "../../x",
            "a b",
            "*",
            ">",
            "",
            "gpu\u{7}",
            "tab\there",
            "é",
        ] {
            let (o, t) = file("w", &format!("pool: {}\n", serde_json::json!(bad)));
            let e = AgentDef::parse(&o, &t).unwrap_err().to_string();
            assert!(e.contains("agents/w.md"), "{e}");
            assert!(e.contains("agent `w`"), "{e}");
            assert!(e.contains("pool"), "{e}");
            assert!(!e.contains('\u{7}'), "{e:?}");
            if !bad.is_empty() && bad.is_ascii() && !bad.contains(['\t', '\u{7}']) {
                assert!(e.contains(&format!("`{bad}`")), "the value is named: {e}");
            }
        }
        let long = "p".repeat(MAX_POOL_LEN + 1);
        let (o, t) = file("w", &format!("pool: {long}\n"));
        let e = AgentDef::parse(&o, &t).unwrap_err().to_string();
        assert!(e.contains("65 bytes"), "{e}");
        for good in ["gpu", "eu-west_1", "P", "p".repeat(MAX_POOL_LEN).as_str()] {
            let (o, t) = file("w", &format!("pool: {good}\n"));
            let d = AgentDef::parse(&o, &t).unwrap();
            assert_eq!(d.front.pool.as_deref(), Some(good));
        }
        // A whole set is refused for one bad pool, with the file named.
        let files = vec![file("a", "pool: \"a.>\"\n"), file("b", "")];
        let e = AgentSet::load(&files, &[]).unwrap_err().to_string();
        assert!(e.contains("agents/a.md") && e.contains("`a.>`"), "{e}");
    }

    #[test]
    fn an_alias_bomb_is_refused_before_it_expands() {
        // 100 KiB behind an anchor, repeated 2,000 times: 200 MB once resolved, from a
        // file of about 108 KiB.
        let big = "x".repeat(100 * 1024);
        let aliases = vec!["*s"; 2000].join(", ");
        let (o, t) = file("w", &format!("description: &s {big}\ntools: [{aliases}]\n"));
        assert!(t.len() < MAX_DEFINITION_BYTES);
        let e = AgentDef::parse(&o, &t).unwrap_err().to_string();
        assert!(e.contains("agents/w.md"), "{e}");
        assert!(e.contains("aliases are resolved"), "{e}");
        assert!(e.len() < 2000, "the error stays short: {} bytes", e.len());
        // Nested aliases of small lists grow exponentially; they are stopped too.
        let mut y = String::from("l0: &l0 [a, a, a, a, a, a, a, a]\n");
        for i in 1..12 {
            let p = i - 1;
            y.push_str(&format!(
                "l{i}: &l{i} [*l{p}, *l{p}, *l{p}, *l{p}, *l{p}, *l{p}]\n"
            ));
        }
        // (the YAML reader's own repetition limit may be what stops these first).
        let e = check_yaml_expansion(&y, MAX_FRONT_MATTER_EXPANSION).unwrap_err();
        assert!(
            e.contains("aliases are resolved") || e.contains("repetition limit"),
            "{e}"
        );
        let e = check_yaml_expansion("a: &a [x, x, x, x]\nb: [*a, *a, *a]\n", 60).unwrap_err();
        assert!(e.contains("more than 60 bytes"), "{e}");
        check_yaml_expansion("a: &a [x, x, x, x]\nb: [*a, *a, *a]\n", 1000).unwrap();
        // Modest use of anchors is fine.
        let (o, t) = file(
            "w",
            "tools: &t [read_file]\nidempotent_tools: *t\ndescription: &d hi\nstrategy: *d\n",
        );
        let d = AgentDef::parse(&o, &t).unwrap();
        assert_eq!(d.front.idempotent_tools, vec!["read_file"]);
    }

    #[test]
    fn an_oversized_definition_is_refused_with_its_size() {
        let body = "y".repeat(MAX_DEFINITION_BYTES);
        let t = format!("---\nname: w\nmodel: scripted:w\n---\n{body}\n");
        let e = AgentDef::parse("agents/w.md", &t).unwrap_err().to_string();
        assert!(e.contains("agents/w.md"), "{e}");
        assert!(e.contains(&format!("{} bytes", t.len())), "{e}");
        assert!(e.contains("256 KiB"), "{e}");
    }
}
