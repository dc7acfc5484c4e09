//! The set of agent definitions in force, checked as a whole: names, tools, pools, who
//! may call whom (no cycles unless recursive), and which agents may be answered from the
//! cache.

use std::collections::{BTreeMap, BTreeSet};

use super::{AgentDef, CacheSetting, Caching, BUILTIN_TOOLS, SIDE_EFFECT_FREE_TOOLS};
use crate::runtime_tool::RuntimeTool;
use crate::{Error, Result};

/// Every definition in force, by name, validated as a whole.
#[derive(Debug, Clone, Default)]
pub struct AgentSet {
    pub agents: BTreeMap<String, AgentDef>,
    /// File each agent came from, for messages.
    pub origins: BTreeMap<String, String>,
}

impl AgentSet {
    /// Builds and validates a set from `(origin, text)` pairs. `extra_tools` are tool
    /// names known besides the built-ins.
    pub fn load(files: &[(String, String)], extra_tools: &[String]) -> Result<Self> {
        let mut set = AgentSet::default();
        let mut problems = vec![];
        for (origin, text) in files {
            match AgentDef::parse(origin, text) {
                Ok(def) => {
                    let name = def.name().to_string();
                    if let Some(first) = set.origins.get(&name) {
                        problems.push(format!(
                            "{origin}: agent `{name}` is already defined in {first}"
                        ));
                        continue;
                    }
                    set.origins.insert(name.clone(), origin.clone());
                    set.agents.insert(name, def);
                }
                Err(e) => problems.push(e.to_string()),
            }
        }
        problems.extend(set.problems(extra_tools));
        if problems.is_empty() {
            Ok(set)
        } else {
            Err(Error::AgentSet(problems))
        }
    }

    pub fn get(&self, name: &str) -> Option<&AgentDef> {
        self.agents.get(name)
    }

    /// Whether completed sessions of `def` are cached (and a delegation to it may be
    /// answered from the cache or share an identical run). A `cache:` setting in the file
    /// decides; without one, an agent is cached only when nothing it may do, itself or
    /// through the agents it may start, has a side effect a cache hit would skip (see
    /// [`SIDE_EFFECT_FREE_TOOLS`]).
    pub fn caching(&self, def: &AgentDef) -> Caching {
        match &def.front.cache {
            Some(CacheSetting::Enabled(on)) => Caching {
                cached: *on,
                reason: format!("`cache: {on}` in its file"),
            },
            Some(CacheSetting::Ttl { ttl }) => Caching {
                cached: true,
                reason: format!("`cache: {{ttl: {ttl}}}` in its file"),
            },
            None => {
                let mut seen = BTreeSet::from([def.name().to_string()]);
                match self.side_effect(def, &mut seen) {
                    Some(why) => Caching {
                        cached: false,
                        reason: format!("it {why} (a cache hit would skip that); set `cache:` to cache it anyway"),
                    },
                    None => Caching {
                        cached: true,
                        reason: "nothing it may do has side effects".into(),
                    },
                }
            }
        }
    }

    /// Why `def` may have a side effect, if it may: a tool, or an agent it may start.
    fn side_effect(&self, def: &AgentDef, seen: &mut BTreeSet<String>) -> Option<String> {
        if let Some(t) = def.allowed_tools().into_iter().find(|t| {
            !RuntimeTool::CallAgent.is(t) && !SIDE_EFFECT_FREE_TOOLS.contains(&t.as_str())
        }) {
            let all = format!("{}{}", super::MCP_SEPARATOR, super::MCP_ALL);
            return Some(match t.strip_suffix(all.as_str()) {
                Some(server) => format!("may call the tools of MCP server `{server}`"),
                None => format!("may call `{t}`"),
            });
        }
        for next in def.starts() {
            if !seen.insert(next.to_string()) {
                continue;
            }
            match self.agents.get(next) {
                None => return Some(format!("may start `{next}`, which is not defined")),
                Some(d) => {
                    if let Some(why) = self.side_effect(d, seen) {
                        return Some(format!("may start `{next}`, which {why}"));
                    }
                }
            }
        }
        None
    }

    /// Every agent a session of `name` may start, directly or through the sessions it
    /// starts (by `call_agent` or a pattern), `name` itself only if it can come back to it.
    pub fn reachable(&self, name: &str) -> BTreeSet<String> {
        let mut seen = BTreeSet::new();
        let mut todo: Vec<&str> = self.edges(name).into_iter().map(|(n, _)| n).collect();
        while let Some(n) = todo.pop() {
            if seen.insert(n.to_string()) {
                todo.extend(self.edges(n).into_iter().map(|(m, _)| m));
            }
        }
        seen
    }

    fn origin(&self, name: &str) -> &str {
        self.origins.get(name).map(String::as_str).unwrap_or("?")
    }

    /// Every problem of the set: unknown agents and tools, routers without destinations,
    /// and cycles (with their path) that the ancestry rule or a pattern would never stop.
    pub fn problems(&self, extra_tools: &[String]) -> Vec<String> {
        let mut out = vec![];
        // A server's tool (`SERVER__TOOL`) is checked against the servers a worker has
        // when it starts (`skein agents check`), not here.
        let known_tool = |t: &str| {
            BUILTIN_TOOLS.contains(&t)
                || extra_tools.iter().any(|x| x == t)
                || super::mcp_server_of(t).is_some()
        };
        for (name, def) in &self.agents {
            let origin = self.origin(name);
            let f = &def.front;
            for t in f
                .tools
                .iter()
                .chain(&f.requires_approval)
                .chain(&f.idempotent_tools)
            {
                if !known_tool(t) {
                    out.push(format!("{origin}: agent `{name}` names unknown tool `{t}`"));
                }
            }
            if f.tools.iter().any(|t| RuntimeTool::HandoffTo.is(t)) && f.router.is_none() {
                out.push(format!(
                    "{origin}: agent `{name}` lists `handoff_to`, the exit of a router, but \
                     has no `router: {{destinations}}`"
                ));
            }
            if f.tools.iter().any(|t| RuntimeTool::CallAgent.is(t)) && f.agents.is_empty() {
                out.push(format!(
                    "{origin}: agent `{name}` lists `{}` but no `agents:`; name the agents it \
                     may delegate to (`agents: [planner, reviewer]`): an agent delegates only \
                     to those",
                    def.delegation_tool()
                ));
            }
            if f.tools.iter().any(|t| t == RuntimeTool::CallAgent.as_str())
                && f.tools
                    .iter()
                    .any(|t| t == crate::runtime_tool::DELEGATE_TO_AGENT)
            {
                out.push(format!(
                    "{origin}: agent `{name}` lists both `call_agent` and `delegate_to_agent`, \
                     two names of one tool; keep the one its prompt uses"
                ));
            }
            if f.tools.iter().any(|t| RuntimeTool::TeamBroadcast.is(t)) {
                out.push(format!(
                    "{origin}: agent `{name}` lists `team_broadcast`, which the runtime gives \
                     to the members and the supervisor of a team; do not list it"
                ));
            }
            if f.team.is_some() && (f.router.is_some() || !f.advisors.is_empty()) {
                out.push(format!(
                    "{origin}: agent `{name}` has a `team` and a router or advisors; a team's \
                     host runs no model of its own (its supervisor answers), so give those \
                     to the supervisor"
                ));
            }
            for a in &f.advisors {
                if let Some(adv) = self.agents.get(a.as_str()) {
                    if adv.front.router.is_some() || adv.front.team.is_some() {
                        out.push(format!(
                            "{origin}: agent `{name}` advisors name `{a}`, a router or team; an \
                             advisor only advises and must not hand the request on"
                        ));
                    }
                }
            }
            if let Some(t) = &f.team {
                if t.members.is_empty() {
                    out.push(format!(
                        "{origin}: agent `{name}` has a team without members"
                    ));
                }
                if self
                    .agents
                    .get(t.supervisor.as_str())
                    .is_some_and(|d| d.front.handoff.is_some())
                {
                    out.push(format!(
                        "{origin}: agent `{name}` team supervisor `{}` declares `handoff`; \
                         the supervisor's answer is the team's",
                        t.supervisor
                    ));
                }
                for m in &t.members {
                    if self
                        .agents
                        .get(m.as_str())
                        .is_some_and(|d| d.front.handoff.is_some())
                    {
                        out.push(format!(
                            "{origin}: agent `{name}` team member `{m}` declares `handoff`; a \
                             member's only exit is its last broadcast"
                        ));
                    }
                }
            }
            let mut refs: Vec<(&str, &String)> = vec![];
            refs.extend(f.agents.iter().map(|a| ("agents", a)));
            refs.extend(f.handoff.iter().map(|a| ("handoff", a)));
            refs.extend(f.advisors.iter().map(|a| ("advisors", a)));
            if let Some(r) = &f.router {
                if r.destinations.is_empty() {
                    out.push(format!(
                        "{origin}: agent `{name}` is a router without destinations"
                    ));
                }
                refs.extend(r.destinations.iter().map(|a| ("router.destinations", a)));
            }
            if let Some(t) = &f.team {
                refs.extend(t.members.iter().map(|a| ("team.members", a)));
                refs.push(("team.supervisor", &t.supervisor));
            }
            for (field, a) in refs {
                if !self.agents.contains_key(a.as_str()) {
                    out.push(format!(
                        "{origin}: agent `{name}` {field} names unknown agent `{a}`"
                    ));
                }
            }
        }
        out.extend(self.cycles());
        out
    }

    /// Edges of "who may start whom", labelled with whether the edge is a delegation
    /// (`call_agent`, stopped by the ancestry rule unless the target is recursive) or a
    /// pattern edge (handoff, router, advisors, team: never allowed to cycle).
    fn edges(&self, name: &str) -> Vec<(&str, bool)> {
        let Some(def) = self.agents.get(name) else {
            return vec![];
        };
        let f = &def.front;
        let mut e: Vec<(&str, bool)> = f.agents.iter().map(|a| (a.as_str(), true)).collect();
        e.extend(f.handoff.iter().map(|a| (a.as_str(), false)));
        e.extend(f.advisors.iter().map(|a| (a.as_str(), false)));
        if let Some(r) = &f.router {
            e.extend(r.destinations.iter().map(|a| (a.as_str(), false)));
        }
        if let Some(t) = &f.team {
            e.extend(t.members.iter().map(|a| (a.as_str(), false)));
            e.push((t.supervisor.as_str(), false));
        }
        e
    }

    fn cycles(&self) -> Vec<String> {
        // A cycle is a problem unless it is made only of delegation edges into agents
        // marked `recursive: true` (then the depth limit bounds it, by choice).
        let mut reported = BTreeSet::new();
        let mut out = vec![];
        for start in self.agents.keys() {
            let mut path = vec![start.as_str()];
            let mut tolerated = vec![];
            self.walk(start, &mut path, &mut tolerated, &mut reported, &mut out);
        }
        out
    }

    fn walk<'a>(
        &'a self,
        start: &'a str,
        path: &mut Vec<&'a str>,
        tolerated: &mut Vec<bool>,
        reported: &mut BTreeSet<Vec<String>>,
        out: &mut Vec<String>,
    ) {
        let Some(&here) = path.last() else { return };
        for (next, delegation) in self.edges(here) {
            let ok = delegation && self.agents.get(next).is_some_and(|d| d.front.recursive);
            if next == start {
                let mut cyc: Vec<String> = path.iter().map(|s| s.to_string()).collect();
                let all_ok = ok && tolerated.iter().all(|t| *t);
                // Report each cycle once, from its smallest member.
                let min = cyc.iter().min().cloned().unwrap_or_default();
                if !all_ok && start == min && reported.insert(cyc.clone()) {
                    cyc.push(start.to_string());
                    out.push(format!("{}: cycle {}", self.origin(start), cyc.join(" → ")));
                }
                continue;
            }
            if path.contains(&next) || !self.agents.contains_key(next) {
                continue;
            }
            path.push(next);
            tolerated.push(ok);
            self.walk(start, path, tolerated, reported, out);
            path.pop();
            tolerated.pop();
        }
    }
}
