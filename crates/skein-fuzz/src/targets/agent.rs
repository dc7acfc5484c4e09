//! `agent`: an agent definition file (Markdown with YAML front matter), parsed and then
//! validated together with the demo catalogue, as `skein agents check` and every worker
//! do at start.

use rand::Rng as _;
use skein_core::{AgentDef, AgentSet};

use super::{text, Spec, Target};
use crate::fixtures::catalog;
use crate::mutate::Dict;
use crate::structured::reshape_yaml;
use crate::{Error, Result, Rng};

pub const SPEC: Spec = Spec {
    name: "agent",
    about: "agent files: YAML front matter and prompt (AgentDef::parse, AgentSet checks)",
    max_len: 64 * 1024,
    make: || Ok(Box::new(Agents::new()?)),
    reshape,
    tokens: &[
        "---\n",
        "name: ",
        "model: ",
        "scripted:",
        "tools: [",
        "agents: [",
        "pool: ",
        "limits:\n  max_steps: ",
        "cache:\n  ttl: ",
        "router:\n  destinations: [",
        "team:\n  members: [",
        "supervisor: ",
        "summarize:\n  max_chars: ",
        "requires_approval: [",
        "idempotent_tools: [",
        "recursive: true",
        "chat: true",
        "&a ",
        "*a",
        "<<: ",
        "!!binary ",
        "? ",
        "|\n",
        ">-\n",
    ],
};

pub struct Agents {
    base: AgentSet,
}

impl Agents {
    pub fn new() -> Result<Self> {
        Ok(Self {
            base: catalog().map_err(|e| Error::setup(SPEC.name, e))?,
        })
    }
}

impl Target for Agents {
    fn run(&mut self, data: &[u8]) -> bool {
        let text = text(data);
        let Ok(def) = AgentDef::parse("fuzz.md", &text) else {
            return false;
        };
        let _ = (def.allowed_tools(), def.cache_enabled());
        // A parsed definition is rendered again for custom agents and stored by digest:
        // its rendering must parse.
        if let Ok(rendered) = AgentDef::render(&def.front, &def.prompt) {
            let reparsed = AgentDef::parse("rendered", &rendered);
            let again = reparsed
                .as_ref()
                .map(|r| AgentDef::render(&r.front, &r.prompt));
            assert!(
                matches!(&again, Ok(Ok(a)) if *a == rendered),
                "a parsed definition renders to one that does not read back the same: \
                 {reparsed:?}"
            );
        }
        // The whole-catalogue checks, as `AgentSet::load` makes them.
        let mut set = self.base.clone();
        let name = def.name().to_string();
        let duplicate = set.agents.contains_key(&name);
        set.origins.insert(name.clone(), "fuzz.md".into());
        set.agents.insert(name, def);
        set.problems(&[]).is_empty() && !duplicate
    }
}

fn reshape(rng: &mut Rng, seed: &[u8], dict: &Dict) -> Option<Vec<u8>> {
    let text = std::str::from_utf8(seed).ok()?;
    let rest = text.strip_prefix("---\n")?;
    let end = rest.find("\n---\n")?;
    let (yaml, body) = (&rest[..=end], &rest[end + 5..]);
    let yaml = reshape_yaml(rng, yaml, dict)?;
    let body = if rng.gen_bool(0.1) {
        body.repeat(rng.gen_range(2..50))
    } else {
        body.to_string()
    };
    Some(format!("---\n{yaml}---\n{body}").into_bytes())
}
